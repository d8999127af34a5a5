"""Runs the leaf templates of a Workflow on this machine: every container as a process.

A step reaches the local cluster only through its Kubernetes API (``controllers.LocalControllers``), as a pod
reaches its cluster's; the train-segment node's message comes from the supervision record it writes, and its slice
is settled from it (when the end was seen, which worker failed first).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxrec.adapters.kube import K8S_HOST_ENV
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import AttemptOutcome
from jaxrec.model.records import SupervisionRecord, now
from workflows.local.cluster import (
    TICK,
    ClusterSetup,
    LocalCluster,
    SliceHooks,
    arg_value,
    local_command,
    process_env,
    resolve_env,
    rewrite_arg,
)
from workflows.local.controllers import LocalControllers
from workflows.local.engine import ERROR, FAILED, SUCCEEDED, NodeInfo, NodeResult
from workflows.local.slices import LocalSlice

# What Argo's controller makes of a Pod node whose pod is gone (argo-workflows v4.0.5,
# workflow/controller/operator.go, podReconciliation, lines 1257-1292): within RECENTLY_STARTED_POD_DURATION (10 s)
# of the node's start it waits for the pod (the node runs on, and the pod is created again); later it marks the node
# Error "pod deleted", with no exit code, which a retryStrategy expression reads as -1 (buildRetryStrategyLocalScope,
# lines 2054-2065).
POD_DELETED = "pod deleted"
RECENTLY_STARTED_POD_S = 10.0
# The train-segment step: a process like every step; its node's message and its slice's settling come from the
# supervision record it writes.
SUPERVISOR_MODULE = "recovery_steps.train_segment"


def pod_deleted(started_at: float = 0.0, finished_at: float = 0.0) -> NodeResult:
    """The node Argo's controller ends when its pod vanished after the node's first ``RECENTLY_STARTED_POD_S``."""
    return NodeResult(ERROR, message=POD_DELETED, started_at=started_at, finished_at=finished_at)


class LocalExecutor:
    """The executor of ``WorkflowRun`` on this machine."""

    def __init__(
        self,
        *,
        repo_root: Path,
        work_dir: Path,
        base_env: Mapping[str, str] | None = None,
        hooks: SliceHooks | None = None,
        events_dir: Path | None = None,
        grace_seconds: float | None = None,
        controllers: LocalControllers | None = None,
    ):
        self.repo_root = repo_root
        self.work_dir = work_dir
        self.base_env = dict(base_env or {})
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        if controllers is None:  # a cluster of its own (a run gives every Workflow's executor the run's one)
            setup = ClusterSetup(repo_root, work_dir, self.base_env, events_dir, grace_seconds)
            controllers = LocalControllers(LocalCluster(setup, hooks), "default")
        self.controllers = controllers
        self.cluster = controllers.cluster

    @property
    def slices(self) -> list[LocalSlice]:
        """Every slice this executor's steps created, in order."""
        return self.cluster.slices

    @property
    def live(self) -> Mapping[str, LocalSlice]:
        """The JobSets whose workers still run, by name: a retried supervisor re-attaches to them."""
        return self.cluster.live

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        # Every step reaches the cluster through its API alone, as a pod reaches its own.
        return process_env(self.repo_root, {**self.base_env, K8S_HOST_ENV: self.controllers.url}, extra)

    def _track(self, p: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(p)
        if self._stopping.is_set():
            self._kill(p)

    @staticmethod
    def _kill(p: subprocess.Popen) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGKILL)

    def stop_all(self) -> None:
        """SIGKILL every process this executor started: the Workflow is deleted.

        As Argo's deletion of a Workflow deletes its pods and runs no exit handler, and leaves its JobSet, which
        the Workflow does not own, training: the Workflow submitted again re-attaches to it.
        """
        self._stopping.set()
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            self._kill(p)

    # -- containers --------------------------------------------------------------------------------

    def run_container(self, node: NodeInfo, template: Mapping[str, Any]) -> NodeResult:
        """Run a container template as a local process; read its output parameters."""
        node_dir = self.work_dir / "nodes" / f"{node.id}-{node.task}"
        (node_dir / "outputs").mkdir(parents=True, exist_ok=True)
        (node_dir / "inputs").mkdir(parents=True, exist_ok=True)
        for art in template.get("inputs", {}).get("artifacts", []):
            raw = art.get("raw")
            if raw is None:
                return NodeResult(ERROR, message=f"input artifact {art.get('name')!r}: only raw artifacts run locally")
            dest = Path(rewrite_arg(art["path"], node_dir))
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(raw.get("data", ""))
        c = template["container"]
        command = [*c.get("command", []), *c.get("args", [])]
        if not command:
            return NodeResult(ERROR, message="container has no command (images' entrypoints do not run locally)")
        segment = _is_module(command, SUPERVISOR_MODULE)
        fields = {
            "metadata.name": f"{node.task}-{node.id}",
            "metadata.namespace": "default",
            "status.podIP": "127.0.0.1",
            "spec.nodeName": "localhost",
        }
        env = self._env(resolve_env(c.get("env", []), fields))
        log_path = self.work_dir / "logs" / f"{node.id}-{node.task}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        started = now()
        local = local_command(command, node_dir)
        attempt = arg_value(local, "--attempt") if segment else None
        while True:
            rc = self._run_process(local, env, log_path, attempt)
            if rc is not None:
                break
            # The supervisor's pod is gone, its gang is not. A pod lost in the node's first seconds is created
            # again for the same node; later the node is Error "pod deleted" and the retryStrategy decides. Either
            # way the next supervisor re-attaches to the running gang.
            if now() - started > RECENTLY_STARTED_POD_S:
                _note(log_path, "supervisor lost (rehearsal): the workers keep running")
                return pod_deleted(started, now())
            _note(log_path, "supervisor lost (rehearsal) while its node is new: its pod is created again")
        outputs, missing = self._read_outputs(template, node_dir)
        exit_code = 128 - rc if rc < 0 else rc
        if segment:
            rec, sl = self._settle(local)
            return _segment_result(rec, sl, exit_code, outputs, log_path, started)
        phase = SUCCEEDED if rc == 0 else FAILED
        message = "" if rc == 0 else f"exit code {rc}; log: {log_path}{_tail(log_path)}"
        if rc == 0 and missing:
            phase, message = ERROR, f"output parameter file(s) missing: {', '.join(missing)}; log: {log_path}"
        return NodeResult(phase, outputs, exit_code, message, started, now())

    def _run_process(
        self, command: list[str], env: Mapping[str, str], log_path: Path, attempt: str | None
    ) -> int | None:
        """Run one step's process to its end: its return code.

        None when the supervisor of ``attempt`` lost its pod (rehearsal: the process is SIGKILLed, as its pod's
        deletion kills it).
        """
        with open(log_path, "ab") as log:
            p = subprocess.Popen(
                command, env=env, cwd=self.repo_root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            self._track(p)
            while True:
                try:
                    return p.wait(timeout=TICK)
                except subprocess.TimeoutExpired:
                    pass
                if attempt is not None and self.cluster.supervisor_lost(int(attempt)):
                    self._kill(p)
                    p.wait()
                    return None

    def _settle(self, command: list[str]) -> tuple[SupervisionRecord | None, LocalSlice | None]:
        """The step's supervision record, read once it ended; the slice's own record and hooks settled from it."""
        store = RunStore(arg_value(command, "--store-root") or "", arg_value(command, "--run-id") or "")
        attempt = int(arg_value(command, "--attempt") or 0)
        rec = store.read_record(RunLayout.supervision(attempt), SupervisionRecord)
        sl = self.cluster.latest(attempt)
        if sl is not None and sl.phase is None:
            if rec is not None and rec.decided and rec.detected_at is not None:
                self.cluster.settle(sl, rec.detected_at, rec.outcome != AttemptOutcome.SUCCEEDED, rec.worker)
            elif sl.deleted_at is not None:  # stopped without a verdict (the lease was lost)
                self.cluster.settle(sl, sl.deleted_at, True, None)
        return rec, sl

    @staticmethod
    def _read_outputs(template: Mapping[str, Any], node_dir: Path) -> tuple[dict[str, str], list[str]]:
        outputs, missing = {}, []
        for p in template.get("outputs", {}).get("parameters", []):
            vf = p.get("valueFrom", {})
            if "path" not in vf:
                continue
            f = Path(rewrite_arg(vf["path"], node_dir))
            if f.is_file():
                outputs[p["name"]] = f.read_text().strip()
            else:
                missing.append(p["name"])
        return outputs, missing


def _segment_result(
    rec: SupervisionRecord | None,
    sl: LocalSlice | None,
    code: int,
    outputs: dict[str, str],
    log_path: Path,
    started: float,
) -> NodeResult:
    """The node's result from the step's exit code and record, with the outputs it wrote."""
    if code == 0:
        return NodeResult(SUCCEEDED, outputs, 0, "", started, now())
    if rec is not None and rec.decided:
        msg = f"JobSet {rec.jobset} {rec.outcome}: {rec.reason}; logs: {sl.log_dir if sl else log_path}"
    else:
        msg = f"exit code {code}; log: {log_path}{_tail(log_path)}"
    return NodeResult(FAILED, outputs, code, msg, started, now())


def _note(log_path: Path, line: str) -> None:
    with open(log_path, "a") as log:
        log.write(f"{time.strftime('%H:%M:%S')} train-segment {line}\n")


def _is_module(cmd: list[str], module: str) -> bool:
    return any(a == "-m" and b == module for a, b in zip(cmd, cmd[1:], strict=False))


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return ("\n    " + "\n    ".join(text)) if text else ""
