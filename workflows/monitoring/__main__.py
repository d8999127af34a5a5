"""``python -m workflows.monitoring``: render one job's monitoring files."""

import sys

from workflows.monitoring import main

sys.exit(main())
