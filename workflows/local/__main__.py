"""``python -m workflows.local``: run a compiled Workflow on this machine."""

import sys

from workflows.local.runner import main

sys.exit(main())
