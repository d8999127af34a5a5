"""``give-up``: fail the workflow on purpose when ``classify-failure`` decided to stop.

Usage: ``python -m recovery_steps.give_up --failure-class C --reason TEXT``. Prints
``giving up: class C: TEXT`` to stderr and exits 1; Argo shows that message on the failed node.

Destructive acts: none (the exit handler stops the gang, on its own evidence).
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from recovery_steps.kernel import cli
from recovery_steps.kernel.contract import FailureClass
from recovery_steps.kernel.step import Step
from recovery_steps.kernel.step import main as step_main


def run(failure_class: str, reason: str, err: TextIO | None = None) -> int:
    """Print why the run stops and return the exit code (always 1: this step exists to fail).

    Args:
        failure_class: the class of the last failure (one of ``FailureClass``; anything else is shown as given).
        reason: classify-failure's reason.
        err: stream for the message (stderr by default).

    Returns:
        1.
    """
    err = err if err is not None else sys.stderr
    known = {c.value for c in FailureClass}
    cls = failure_class if failure_class in known else f"{failure_class} (not a known failure class)"
    print(f"giving up: class {cls}: {' '.join(reason.split()) or 'no reason given'}", file=err)
    return 1


def parser() -> argparse.ArgumentParser:
    """The step's arguments."""
    p = cli.StepArgumentParser(prog="python -m recovery_steps.give_up", description=__doc__)
    p.add_argument("--failure-class", required=True, type=cli.bounded_text(64, "--failure-class"))
    p.add_argument("--reason", required=True, type=cli.bounded_text(4096, "--reason"))
    return p


def act(args: argparse.Namespace) -> tuple[int, str]:
    """Say why the run stops (on stderr, where Argo shows it) and fail."""
    return run(args.failure_class, args.reason), ""


STEP = Step("give-up", parser, act)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m recovery_steps.give_up``."""
    return step_main(STEP, argv)


if __name__ == "__main__":
    sys.exit(main())
