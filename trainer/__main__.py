"""``python -m trainer``: run one worker of a training segment (see trainer.app.run)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run the worker; the worker leaves by os._exit with a contract code."""
    from trainer.app import parse_args, run

    run(parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
