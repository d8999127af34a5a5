"""What every step program shares: its one error type, how it loads the run's config and its Kubernetes client.

A step raises ``StepError(code, line)`` for anything that ends it early; one ``main`` (``Step``, ``main``,
``run_step``) parses its arguments, proves its outputs writable, configures logging, and maps every failure to one
line and its exit code (``model.contract.ExitCode``), leaving the step's failure record. No step imports another
step: what two steps share lives here, beside them, or in ``jaxrec``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrec.adapters.store import DocumentError, RunStore
from jaxrec.model.config import ConfigError, JobConfig
from jaxrec.model.contract import ExitCode
from jaxrec.model.names import termination_log


class StepError(Exception):
    """A step cannot go on; ``code`` is its exit code and the message is its one line.

    ``record``: False when the step's failure record must not be written (a supervisor stopped after its verdict
    leaves the verdict in place).
    """

    def __init__(self, code: ExitCode | int, message: str, *, record: bool = True):
        super().__init__(message)
        self.code = code
        self.record = record


REFUSED_HINT = ": check argo/rbac.yaml is applied and the JobSet CRD is installed"


def api_error(
    e: BaseException, *, doing: str = "", transient_hint: str = "", refused_hint: str = REFUSED_HINT
) -> StepError:
    """A failed Kubernetes API call as the step's error: the one mapping (``adapters.kube.api_exit_code``), one line.

    429, 5xx and a connection that fails are transient (69, retried); any other refusal is configuration (2).
    """
    from jaxrec.adapters.kube import api_error_line, api_exit_code

    code = ExitCode(api_exit_code(e))
    line = f"{doing}: {api_error_line(e)}" if doing else api_error_line(e)
    return StepError(code, line + (transient_hint if code == ExitCode.TRANSIENT else refused_hint))


def api_failures() -> tuple[type[BaseException], ...]:
    """What a Kubernetes API call raises when the API refuses or cannot be reached (``api_error`` maps them)."""
    import urllib3
    from kubernetes.client import ApiException

    return (ApiException, urllib3.exceptions.HTTPError, OSError)


PIN_FIX = "pin a valid one with validate-config, by resubmitting the run's Workflow"


def load_run_config(store_root: str, run_id: str, *, check_ledger: bool = True) -> JobConfig:
    """The run's validated config from its store (pinned by validate-config).

    ``check_ledger``: a damaged ledger is refused as well, before the step deletes or creates anything. A read of
    the store that fails (unreachable, refused) is not an absent config: its error propagates (``run_step`` maps
    it to the step's store exit code, transient).

    Raises:
        StepError: Configuration (exit 2), one line naming the fix, when the config is absent or unusable, or the
            ledger is damaged.
    """
    from jaxrec.adapters.documents import read_ledger, read_run_config

    store = RunStore(store_root, run_id)
    try:
        cfg = read_run_config(store)
    except ConfigError as e:
        shown = "; ".join(e.problems[:3]) + (f"; and {len(e.problems) - 3} more" if len(e.problems) > 3 else "")
        raise StepError(ExitCode.CONFIGURATION, f"invalid pinned config {e.source}: {shown}; {PIN_FIX}") from None
    except DocumentError as e:
        fix = "" if "validate-config" in str(e) else f", or {PIN_FIX}"  # an absent config names its fix already
        raise StepError(ExitCode.CONFIGURATION, f"{e} (check --store-root and --run-id{fix})") from None
    if check_ledger:
        try:
            read_ledger(store)
        except DocumentError as e:
            raise StepError(ExitCode.CONFIGURATION, f"{e} (check --store-root and --run-id)") from None
    return cfg


def k8s_client(host: str | None, *, fix: str = "run in the cluster or give --k8s-host") -> Any:
    """The steps' one Kubernetes client factory (``adapters.kube.make_api_client``).

    A missing config is one line ending in ``fix``, exit 2.

    Raises:
        StepError: No in-cluster config, no kubeconfig and no ``host``.
    """
    from kubernetes.config.config_exception import ConfigException  # no in-cluster config and no kubeconfig

    from jaxrec.adapters.kube import make_api_client

    try:
        return make_api_client(host)
    except ConfigException as e:
        detail = " ".join(str(e).split())[:200]
        raise StepError(ExitCode.CONFIGURATION, f"no Kubernetes API: {type(e).__name__}: {detail}; {fix}") from None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def say_why(line: str, path: Path | None = None) -> None:
    """Leave a failed step's one line where the kubelet reads the container's termination message.

    Only where the kubelet made the file (a process outside a pod has none); at most the kubelet's 4096 bytes
    (pkg/kubelet/container/runtime.go, v1.36.3). Reporting why must never change how the step ends.
    """
    path = path or termination_log()
    try:
        if path is not None and path.is_file():
            path.write_bytes(line.encode()[:4096].decode(errors="ignore").encode())  # whole characters
    except OSError:
        pass


@dataclass(frozen=True)
class Step:
    """One step program: its name, its arguments, what it does, and what it leaves when it fails.

    ``act(args)`` does the step's work and returns its exit code and the line it prints on success (its outputs);
    it raises ``StepError`` to end early. ``on_error(args, error)`` leaves the failure where the next step reads it
    (train-segment's supervision record, provision-slice's outcome). ``outputs``: the step's declared outputs; their
    directory is proven writable before the step acts. ``store_code``: the exit code when the run store cannot be
    reached (transient, unless the step's retry policy says otherwise).
    """

    name: str
    parser: Callable[[], argparse.ArgumentParser]
    act: Callable[[argparse.Namespace], tuple[int, str]]
    outputs: Any = None
    on_error: Callable[[argparse.Namespace, StepError], None] | None = None
    store_code: int = int(ExitCode.TRANSIENT)

    def main(self, argv: Sequence[str] | None = None) -> int:
        """The step program's entry point (``python -m recovery_steps.<module>``): ``main`` below."""
        return main(self, argv)


def run_step(
    step: Step, args: argparse.Namespace, *, out: Callable[[str], None] = print, err: Callable[[str], None] = _stderr
) -> int:
    """The step after its arguments: act, print its outputs, and map every failure to one line and its exit code."""
    from jaxrec.adapters.cli import store_error_line
    from jaxrec.adapters.store import StoreUnavailable, is_transient, store_errors

    def failed(line: str, code: int) -> int:
        err(line)
        say_why(line)
        return code

    try:
        code, line = step.act(args)
    except StepError as e:
        err(f"{step.name}: {e}")
        if step.on_error is not None and e.record:
            step.on_error(args, e)
        say_why(f"{step.name}: {e}")
        return int(e.code)
    except StoreUnavailable as e:
        return failed(f"{step.name}: {e}; transient, Argo retries this step", int(ExitCode.TRANSIENT))
    except store_errors() as e:
        line = store_error_line(step.name, RunStore(args.store_root, args.run_id).url(), e)
        # A transient answer that no part of the step wrapped is still transient: Argo's retry, charged to no class.
        code = int(ExitCode.TRANSIENT) if is_transient(e) else step.store_code
        return failed(line if line.startswith(f"{step.name}:") else f"{step.name}: {line}", code)
    if line:
        out(line)
        if code != 0:
            say_why(f"{step.name}: {line}")
    return code


def main(step: Step, argv: Sequence[str] | None = None) -> int:
    """A step's ``main``: parse (a bad argument is one line, exit 2), prove the outputs writable, log, run."""
    from jaxrec.adapters import cli

    ap = step.parser()
    args = ap.parse_args(argv)
    if step.outputs is not None and getattr(args, "output_dir", None) is not None:
        cli.ready_output_dir(ap, args.output_dir, step.outputs.names())  # before the step acts
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {step.name} %(levelname)s %(message)s")
    return run_step(step, args)
