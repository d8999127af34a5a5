"""Argument types and the parser every step program uses: bad input is exit 2 with one line, at the door.

A step's arguments come from Argo parameters, an operator's shell or a test; whatever they hold, the
step must not write outside ``<root>/runs/<run-id>/`` and its own output directory, and must say in one
line what was wrong. The run-id syntax is the config's (``config.run_id_problem``), so a run id that a
step accepts is one a config could have named.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

from jaxrec.model.config import ATTEMPT_CEILING, StorageConfig, run_id_problem

ATTEMPT_MAX = ATTEMPT_CEILING
"""Highest attempt number accepted: the one validate-config checks the run id's pod names against."""
PATH_MAX = 1024
"""Longest store root or output directory accepted (Linux PATH_MAX is 4096; GCS object names 1024 bytes)."""
MESSAGE_MAX = 300
"""Longest error line a step prints about its arguments."""

_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def _short(value: str, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


class StepArgumentParser(argparse.ArgumentParser):
    """``argparse`` with a one-line error: ``<prog>: error: <what> `` and exit 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        """Print one bounded line naming the argument and exit with the configuration code (2)."""
        line = " ".join(message.split())
        if len(line) > MESSAGE_MAX:
            line = line[: MESSAGE_MAX - 3] + "..."
        self.exit(2, f"{self.prog}: error: {line} (see --help)\n")


def run_id(text: str) -> str:
    """A run id with the config's syntax (it names ``runs/<run-id>/``: no '/', '..' or upper case)."""
    problem = run_id_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def attempt(text: str) -> int:
    """An attempt number: a decimal integer from 0 to ``ATTEMPT_MAX``."""
    t = text.strip()
    if not t.isdigit() or not t.isascii() or len(t) > 6 or int(t) > ATTEMPT_MAX:
        raise argparse.ArgumentTypeError(f"{_short(text)} is not an attempt number; use 0 to {ATTEMPT_MAX}")
    return int(t)


def bounded_int(low: int, high: int, what: str):
    """An argument type for decimal integers in ``[low, high]`` (``what`` names them in the message)."""

    def parse(text: str) -> int:
        t = text.strip()
        body = t[1:] if t.startswith("-") else t
        if not body.isdigit() or not body.isascii() or len(body) > 12 or not low <= int(t) <= high:
            raise argparse.ArgumentTypeError(f"{_short(text)} is not {what}; use an integer from {low} to {high}")
        return int(t)

    return parse


def seconds(text: str) -> float:
    """A finite, non-negative duration of at most a day."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"{_short(text)} is not a duration; use seconds from 0 to 86400")
    return value


def k8s_name(text: str) -> str:
    """A Kubernetes object name usable as a label value (RFC 1123 label, at most 63 characters)."""
    if not _DNS_LABEL.match(text):
        raise argparse.ArgumentTypeError(
            f"{_short(text)} is not a Kubernetes name; use 1-63 lowercase letters, digits and '-'"
        )
    return text


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL (the Kubernetes API server)."""
    if not re.match(r"^https?://[^\s/]+(/\S*)?$", text) or len(text) > 2048:
        raise argparse.ArgumentTypeError(f"{_short(text)} is not an API server URL; use https://HOST[:PORT]")
    return text


def _local_path_problem(text: str) -> str | None:
    if not text:
        return "is empty"
    if len(text) > PATH_MAX:
        return f"is longer than {PATH_MAX} characters"
    if "\x00" in text:
        return "contains a NUL character"
    return None


def _existing_ancestor(p: Path) -> Path:
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def store_root(text: str) -> str:
    """A run-store root: ``gs://BUCKET[/PREFIX]`` as the config accepts it, or a local directory.

    A local root must be a directory if it exists, and its nearest existing ancestor must be a
    directory (otherwise nothing could be written under it).
    """
    if text.startswith("gs://") or "://" in text:
        try:
            return StorageConfig(root=text).root
        except ValueError as e:
            first = e.errors()[0]["msg"].removeprefix("Value error, ") if hasattr(e, "errors") else str(e)
            raise argparse.ArgumentTypeError(first) from None
    problem = _local_path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"store root {_short(text)} {problem}")
    p = Path(text)
    try:
        ancestor = _existing_ancestor(p)
        if os.path.lexists(p) and not p.is_dir():
            raise argparse.ArgumentTypeError(f"store root {_short(text)} is not a directory; give a directory")
        if not ancestor.is_dir():
            raise argparse.ArgumentTypeError(f"store root {_short(text)}: {_short(str(ancestor))} is not a directory")
        p.resolve(strict=False)
    except (OSError, RuntimeError) as e:  # a symlink loop, or a path the OS refuses
        raise argparse.ArgumentTypeError(f"store root {_short(text)} cannot be used ({e})") from None
    return text


def output_dir(text: str) -> Path:
    """The directory a step writes its output parameters to: a directory, or creatable as one."""
    problem = _local_path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"output directory {_short(text)} {problem}")
    p = Path(text)
    try:
        if os.path.lexists(p) and not p.is_dir():
            raise argparse.ArgumentTypeError(f"output directory {_short(text)} exists and is not a directory")
        ancestor = _existing_ancestor(p)
        if not ancestor.is_dir():
            raise argparse.ArgumentTypeError(
                f"output directory {_short(text)}: {_short(str(ancestor))} is not a directory"
            )
        if not os.access(ancestor, os.W_OK | os.X_OK):
            where = _short(str(ancestor))
            raise argparse.ArgumentTypeError(f"output directory {_short(text)}: {where} is not writable")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"output directory {_short(text)} cannot be used ({e})") from None
    return p


def ready_output_dir(parser: argparse.ArgumentParser, path: Path | None, names: Iterable[str]) -> None:
    """Create the output directory and every output file now, before the step acts; refuse in one line if it cannot.

    ``access()`` proves nothing: a pseudo file system (``/sys``) or a name over the file system's limit passes it and
    fails the write, and a step that found out after acting would have changed the store or the cluster, then
    crashed. What is created here is removed again (the tree is left as it was found): Argo reads a failed step's
    unwritten output as missing, not as empty, and a refused step leaves no directory behind.

    Args:
        parser: The step's parser (its ``error`` prints the line and exits 2).
        path: The ``--output-dir`` given (None: the step writes no outputs).
        names: The output parameter files the step will write (``StepOutputs.names()``).
    """
    if path is None:
        return
    made: list[Path] = []
    try:
        missing = [path, *path.parents]
        missing = missing[: next((i for i, p in enumerate(missing) if os.path.lexists(p)), len(missing))]
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        for name in names:
            f = path / name
            existed = os.path.lexists(f)
            with open(f, "a"):
                pass
            if not existed:
                f.unlink()
    except OSError as e:
        where = f" ({_short(e.filename, 80)})" if isinstance(e.filename, str) and e.filename != str(path) else ""
        parser.error(
            f"--output-dir: output directory {_short(str(path))} cannot be written{where}: {e.strerror or e}; "
            "give a writable directory"
        )
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                break


def bounded_text(limit: int, what: str):
    """An argument type for free text of at most ``limit`` characters."""

    def parse(text: str) -> str:
        if len(text) > limit or "\x00" in text:
            raise argparse.ArgumentTypeError(f"{what} is longer than {limit} characters or holds a NUL")
        return text

    return parse


def store_error_line(step: str, url: str, exc: BaseException) -> str:
    """One line for a run store that cannot be reached or used: which store, what happened, what to do."""
    name = type(exc).__name__
    detail = " ".join(str(exc).split()) or name
    if len(detail) > 160:
        detail = detail[:157] + "..."
    from jaxrec.adapters.store import is_transient

    if is_transient(exc):
        fix = "transient (the store, or the metadata server that gives its credentials, did not answer); retried"
    elif name in ("DefaultCredentialsError", "RefreshError", "TransportError") or "credentials" in detail.lower():
        fix = (
            "give the step Google credentials (Workload Identity on GKE, `gcloud auth application-default login` "
            "here) or point STORAGE_EMULATOR_HOST at an emulator"
        )
    elif name in ("Forbidden", "Unauthorized") or "403" in detail or "401" in detail:
        fix = "grant the service account roles/storage.objectUser on the bucket"
    elif name == "NotFound" or "404" in detail:
        fix = "check that the bucket exists"
    elif isinstance(exc, OSError):
        fix = "check that the store root is a writable directory"
    else:
        fix = "check that the store is reachable and retry"
    return f"{step}: run store {url} unreachable or unusable ({name}: {detail}); {fix}"


def fail(step: str, line: str, code: int) -> int:
    """Print one line for ``step`` on stderr and return ``code``, so that ``main`` can end with it."""
    print(line if line.startswith(f"{step}:") else f"{step}: {line}", file=sys.stderr)
    return code
