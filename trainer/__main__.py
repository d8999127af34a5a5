"""``python -m trainer``: run one worker of a training segment (see trainer.app.run)."""

from __future__ import annotations

import faulthandler
import sys
from collections.abc import Sequence
from typing import IO

from jaxrec.model.names import termination_log

_fatal_trace: IO[str] | None = None  # kept open for the process's life: faulthandler writes to its descriptor


def trace_fatal_signals() -> str | None:
    """Have a fatal signal write the Python stacks of every thread to the container's termination message.

    SIGSEGV, SIGBUS, SIGILL, SIGFPE (and SIGABRT until the trainer installs its own handler) run faulthandler's C
    handler, which needs no Python (none runs in a crashed process).

    A worker that dies so in its start-up (the accelerator's runtime, the coordination service) writes no exit
    report; its termination message says where it was, and classify-failure reads it. Returns the file used (None
    where there is none: a process outside a pod, nothing set).
    """
    global _fatal_trace
    path = termination_log()
    if path is None:
        return None
    try:
        _fatal_trace = open(path, "w")  # noqa: SIM115 - open for the process's life (faulthandler holds its fd)
    except OSError:
        return None
    faulthandler.enable(file=_fatal_trace, all_threads=True)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run the worker; the worker leaves by os._exit with a contract code."""
    trace_fatal_signals()
    from trainer.app import parse_args, run

    run(parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
