"""Runs the leaf templates of a Workflow on this machine: containers as processes, the JobSet as N workers.

Container templates run the same command with ``python`` mapped to this interpreter and ``/tmp/outputs``,
``/tmp/inputs`` mapped to a folder per node. The train-segment step creates its JobSet in the executor's
``LocalCluster`` (``cluster``): ``parallelism`` worker processes with the environment a pod would get, under JobSet's
semantics: the first failed worker fails the set and the others are stopped (SIGTERM, the pod's
``terminationGracePeriodSeconds``, then SIGKILL, as the kubelet does when a pod is deleted: Kubernetes docs "Pod
Lifecycle", termination of pods).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import AttemptOutcome, ExitCode
from jaxrec.model.gang import Attachment
from jaxrec.model.records import SupervisionRecord, now
from jaxrec.model.snapshot import ClusterSnapshot
from recovery_steps.step import StepError, run_step
from workflows.local.cluster import (
    TICK,
    ClusterSetup,
    InvalidManifest,
    LocalCluster,
    SliceHooks,
    local_command,
    process_env,
    resolve_env,
    rewrite_arg,
)
from workflows.local.engine import ERROR, FAILED, SUCCEEDED, NodeInfo, NodeResult
from workflows.local.slices import LocalSlice

# What Argo's controller makes of a Pod node whose pod is gone (argo-workflows v4.0.5,
# workflow/controller/operator.go, podReconciliation, lines 1257-1292): within RECENTLY_STARTED_POD_DURATION (10 s)
# of the node's start it waits for the pod (the node runs on, and the pod is created again); later it marks the node
# Error "pod deleted", with no exit code, which a retryStrategy expression reads as -1 (buildRetryStrategyLocalScope,
# lines 2054-2065).
POD_DELETED = "pod deleted"
RECENTLY_STARTED_POD_S = 10.0
# The train-segment supervisor: run here as the local JobSet stand-in under the same decision.
SUPERVISOR_MODULE = "recovery_steps.train_segment"


def pod_deleted(started_at: float = 0.0, finished_at: float = 0.0) -> NodeResult:
    """The node Argo's controller ends when its pod vanished after the node's first ``RECENTLY_STARTED_POD_S``."""
    return NodeResult(ERROR, message=POD_DELETED, started_at=started_at, finished_at=finished_at)


class SupervisorLost(Exception):
    """The supervisor's own "pod" went away (rehearsal): the step ends as Argo sees a deleted pod, the gang runs on."""


class RunStopped(Exception):
    """The whole local run is being deleted: the gang dies with it."""


class LocalGang:
    """One attempt's JobSet as local worker processes: train-segment's port (``model.gang.Gang``) on this machine.

    It acts through the run's ``LocalCluster``: ``observe`` answers with the same ``ClusterSnapshot`` the Kubernetes
    adapter builds (``slice_snapshot``); ``delete`` does what deleting the JobSet does to its pods (SIGTERM, then
    SIGKILL after the pod's termination grace, as the kubelet does; a worker on a lost host gets nothing: its
    kubelet is gone); ``force_delete`` is SIGKILL. Between observations the runner's hooks tick (fault injection)
    every ``cluster.TICK`` seconds.
    """

    def __init__(
        self,
        cluster: LocalCluster,
        node: NodeInfo,
        manifest: Mapping[str, Any],
        *,
        clock: Callable[[], float] = time.time,
    ):
        self.cluster, self.node, self.manifest, self.clock = cluster, node, manifest, clock
        self.name = manifest["metadata"]["name"]
        self.sl: LocalSlice | None = None
        try:
            pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
            self.image = str(pod["containers"][0].get("image", ""))
        except (KeyError, IndexError, TypeError):
            self.image = ""

    def _attached(self, sl: LocalSlice | None) -> Attachment | None:
        if sl is None:
            return None
        self.sl = sl
        return Attachment(self.name, sl.created_at, str(sl.attempt))

    def find(self) -> Attachment | None:
        """The attempt's slice if its workers still run (a retried supervisor re-attaches to it)."""
        return self._attached(self.cluster.find(self.name))

    def create(self, manifest: Mapping[str, Any]) -> Attachment | None:
        """Start the workers of the JobSet ``manifest`` describes (those a hook withholds stay Pending)."""
        try:
            return self._attached(self.cluster.create(manifest, self.node))
        except InvalidManifest as e:
            raise StepError(ExitCode.CONFIGURATION, f"JobSet {self.name}: cannot read its manifest ({e})") from None

    def start(self) -> None:
        """Nothing to list: the processes are here."""

    def _check(self) -> None:
        if self.cluster.stopping:
            raise RunStopped()
        if self.sl.supervisor_lost.is_set():
            self.sl.supervisor_lost.clear()
            raise SupervisorLost()

    def observe(self) -> ClusterSnapshot:
        """The workers as pods and their hosts as nodes, now."""
        self._check()
        return self.cluster.snapshot(self.sl, self.clock(), self.image)

    def _state(self) -> tuple[Any, ...]:
        sl = self.sl
        return tuple((w.pid, w.returncode) for w in sl.workers), tuple(sorted(sl.lost)), tuple(sorted(sl.withheld))

    def wait(self, timeout: float) -> None:
        """Tick the hooks (or, once deleted, the kubelet's grace) until a worker changed or ``timeout`` passed."""
        sl, end, before = self.sl, self.clock() + timeout, self._state()
        while self.clock() < end:
            self.cluster.tick(sl, self.clock())
            time.sleep(TICK)
            self.cluster.poll(sl)
            if self._state() != before or self.cluster.stopping or sl.supervisor_lost.is_set():
                return

    def delete(self) -> None:
        """Delete the JobSet: SIGTERM every running worker whose host is not lost (its pods are deleted)."""
        self.cluster.delete(self.sl, self.clock())

    def force_delete(self, pod: str) -> None:
        """SIGKILL the worker of ``pod`` (its host is lost: nothing else would end it)."""
        self.cluster.force_delete(self.sl, pod)

    def close(self) -> None:
        """Nothing to stop watching."""

    def settle(self, detected: float, failed: bool, worker: int | None) -> None:
        """The slice's own state once the supervisor is done: when the end was seen, which worker failed first.

        The runner times its incidents from it and the injector's hooks see it; the classifier reads the pods.
        """
        self.cluster.settle(self.sl, detected, failed, worker)

    def kill(self) -> None:
        """The whole run is deleted: SIGKILL every worker, wait up to 10 s for them, settle the slice."""
        if self.sl is None:
            return
        self.cluster.kill(self.sl)
        self.settle(now(), True, None)


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
    ):
        self.repo_root = repo_root
        self.work_dir = work_dir
        self.base_env = dict(base_env or {})
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        setup = ClusterSetup(repo_root, work_dir, self.base_env, events_dir, grace_seconds)
        # The JobSets this executor's train-segment steps create: their workers, tracked with its own processes.
        self.cluster = LocalCluster(setup, hooks, track=self._track, stopping=self._stopping)

    @property
    def slices(self) -> list[LocalSlice]:
        """Every slice this executor's steps created, in order."""
        return self.cluster.slices

    @property
    def live(self) -> Mapping[str, LocalSlice]:
        """The JobSets whose workers still run, by name: a retried supervisor re-attaches to them."""
        return self.cluster.live

    def _env(self, extra: Mapping[str, str]) -> dict[str, str]:
        return process_env(self.repo_root, self.base_env, extra)

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
        """SIGKILL every process this executor started (the whole local run is deleted)."""
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
        if _is_module(command, SUPERVISOR_MODULE):
            return self.run_segment(node, template, local_command(command, node_dir), node_dir)
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
        with open(log_path, "wb") as log:
            p = subprocess.Popen(
                local_command(command, node_dir),
                env=env,
                cwd=self.repo_root,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._track(p)
            rc = p.wait()
        outputs, missing = self._read_outputs(template, node_dir)
        phase = SUCCEEDED if rc == 0 else FAILED
        message = "" if rc == 0 else f"exit code {rc}; log: {log_path}{_tail(log_path)}"
        if rc == 0 and missing:
            phase, message = ERROR, f"output parameter file(s) missing: {', '.join(missing)}; log: {log_path}"
        exit_code = 128 - rc if rc < 0 else rc
        return NodeResult(phase, outputs, exit_code, message, started, now())

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

    # -- train-segment: the step's own supervisor over the local JobSet stand-in ---------------------

    def run_segment(
        self, node: NodeInfo, template: Mapping[str, Any], command: list[str], node_dir: Path
    ) -> NodeResult:
        """Run ``python -m recovery_steps.train_segment`` here: the step's own program over a ``LocalGang``.

        The same supervisor, decision, record, stop and error mapping as on GKE (``train_segment.step`` under the
        steps' ``run_step``) run over the worker processes, with the JobSet the step renders from the run's pinned
        config (``model.jobset``, as on GKE); a JobSet of this attempt that is still running is
        re-attached, not started again.
        """
        from recovery_steps import train_segment

        started = now()
        log_path = self.work_dir / "logs" / f"{node.id}-{node.task}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        gangs: list[LocalGang] = []

        def gang(cfg: Any, manifest: Mapping[str, Any], clock: Callable[[], float], _say: Any) -> LocalGang:
            gangs.append(LocalGang(self.cluster, node, manifest, clock=clock))
            return gangs[-1]

        with open(log_path, "a") as log:

            def say(line: str) -> None:
                log.write(f"{time.strftime('%H:%M:%S')} train-segment {line}\n")
                log.flush()

            try:
                args = train_segment.parser().parse_args(command[command.index(SUPERVISOR_MODULE) + 1 :])
            except SystemExit as e:  # a refused argument: the parser's one line is on stderr
                return NodeResult(FAILED, exit_code=int(e.code or 2), message="train-segment: bad arguments")
            while True:
                try:
                    step = train_segment.step(gang=gang, progress_file=str(node_dir / "progress"), say=say)
                    code = run_step(step, args, out=say, err=say)
                    break
                except SupervisorLost:
                    # Its pod is gone, the gang is not. A pod lost in the node's first seconds is created again
                    # for the same node; later the node is Error "pod deleted" and the retryStrategy decides. Either
                    # way the next supervisor re-attaches to the running gang.
                    if now() - started <= RECENTLY_STARTED_POD_S:
                        say("supervisor lost (rehearsal) while its node is new: its pod is created again")
                        continue
                    say("supervisor lost (rehearsal): the workers keep running")
                    return pod_deleted(started, now())
                except RunStopped:
                    for g in gangs:
                        g.kill()
                    return NodeResult(ERROR, message="the local run was stopped")
        rec = self._settle(gangs, args)
        outputs, _ = self._read_outputs(template, node_dir)
        return self._segment_result(rec, gangs[-1].sl if gangs else None, code, outputs, log_path, started)

    @staticmethod
    def _settle(gangs: list[LocalGang], args: Any) -> SupervisionRecord | None:
        """The step's supervision record, read once it ended; the slice's own record and hooks settled from it."""
        store = RunStore(args.store_root, args.run_id)
        rec = store.read_record(RunLayout.supervision(args.attempt), SupervisionRecord)
        sl = gangs[-1].sl if gangs else None
        if sl is not None and rec is not None and rec.decided and rec.detected_at is not None:
            gangs[-1].settle(rec.detected_at, rec.outcome != AttemptOutcome.SUCCEEDED, rec.worker)
        elif sl is not None and sl.deleted_at is not None:  # stopped without a verdict (the lease was lost)
            gangs[-1].settle(sl.deleted_at, True, None)
        return rec

    @staticmethod
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


def _is_module(cmd: list[str], module: str) -> bool:
    return any(a == "-m" and b == module for a, b in zip(cmd, cmd[1:], strict=False))


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return ("\n    " + "\n    ".join(text)) if text else ""
