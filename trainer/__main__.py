"""``python -m trainer``: run one worker of a training segment (see trainer.app.run)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from collections.abc import Sequence
from typing import IO

from jaxrec.model.names import STANDBY_COMM, STANDBY_ENV, termination_log

_fatal_trace: IO[str] | None = None  # kept open for the process's life: faulthandler writes to its descriptor


def trace_fatal_signals() -> str | None:
    """Have a fatal signal write the Python stacks of every thread to the container's termination message.

    SIGSEGV, SIGBUS, SIGILL, SIGFPE (and SIGABRT until the trainer installs its own handler) run faulthandler's C
    handler, which needs no Python (none runs in a crashed process); classify-failure reads the stacks
    (docs/TRAINER.md). Returns the file used (None where there is none: a process outside a pod, nothing set).
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


def warm_imports() -> None:
    """Import what every trainer imports before its first step (the libraries and the trainer's own modules).

    Importing JAX opens no device: the backend starts at the first use, after the standby's line came.
    """
    import flax  # noqa: F401
    import gcsfs  # noqa: F401 - orbax's gs:// paths, opened with the checkpointer (0.27 s on an idle machine)
    import google.cloud.storage  # noqa: F401 - the run store's client, read first for the config (0.25 s)
    import jax  # noqa: F401
    import optax  # noqa: F401
    import orbax.checkpoint  # noqa: F401

    from trainer import app, checkpointing, data, hooks, loop  # noqa: F401


def standby(argv: Sequence[str]) -> list[str] | None:
    """As a standby (``STANDBY_ENV``): the imports done ahead, then ``argv`` with the flags the agent sends.

    The agent sends them when the restart is ordered; None when it sends none (the restart was called off).
    """
    from trainer.agent import with_flag

    named = _rename(STANDBY_COMM)
    warm_imports()
    line = sys.stdin.readline()
    if not line.strip():
        return None
    _rename(named)
    out = list(argv)
    for flag, value in json.loads(line).items():
        out = with_flag(out, flag, str(value))
    return out


def _rename(name: str | None) -> str | None:
    """Set this process's name (``/proc/self/comm``, Linux); the name it had (None where there is none to set)."""
    if name is None:
        return None
    try:
        with open("/proc/self/comm", "r+") as f:
            before = f.read().strip()
            f.seek(0)
            f.write(name)
        return before
    except OSError:
        return None


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run the worker; the worker leaves by os._exit with a contract code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get(STANDBY_ENV):
        ready = standby(args)
        if ready is None:
            return
        args = ready
    trace_fatal_signals()
    from trainer.app import parse_args, run

    run(parse_args(args))


if __name__ == "__main__":
    main(sys.argv[1:])
