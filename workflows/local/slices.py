"""The local slices: one attempt's worker processes (``LocalSlice``), and how the Kubernetes API would show them.

``slice_objects`` turns the worker processes of a ``LocalSlice`` into the pods, nodes, Job and JobSet the API
returns (docs/LOCAL.md), read by the same adapter (``jaxrec.model.snapshot``) as on a cluster, so that one
supervisor, one decision, one record and one classifier serve both worlds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from jaxrec.model.names import (
    JOBSET_NAME_LABEL,
    NODEPOOL_LABEL,
    STANDBY_COMM,
    TERMINATION_LOG_ENV,
    UNREACHABLE_TAINT,
)
from jaxrec.model.records import now
from jaxrec.model.snapshot import (
    COMPLETION_INDEX_KEYS,
    TRAINER_CONTAINER,
    Condition,
    PodEvidence,
    PodPhase,
    pod_from_api,
)
from workflows.local.engine import NodePhase

FIRST_POOL = "local-a"
"""The local cluster's node pool (its nodes ``local-0`` ...); a spare pool's nodes are named by it (``local-b-0``)."""


MAX_NODE_POOLS = 26
"""The most node pools a local cluster has (named by one letter each)."""


def node_pools(count: int) -> tuple[str, ...]:
    """The names of a local cluster's ``count`` node pools (each a slice's worth of hosts): local-a, local-b, ..."""
    if not 1 <= count <= MAX_NODE_POOLS:
        raise ValueError(f"node pools: {count} (1 to {MAX_NODE_POOLS})")
    return tuple(f"local-{chr(ord('a') + i)}" for i in range(count))


TERMINATION_MESSAGE_MAX = 4096
"""How much of it the kubelet keeps, from its end (kubernetes v1.36.3 ``MaxContainerTerminationMessageLength``)."""


@dataclass
class WorkerProc:
    """One worker process of a local JobSet."""

    index: int
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    pid: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    # When the process ended, stamped by a thread that waits on it (the kubelet's PLEG sees a container end as it
    # ends): workers found ended in one poll keep the order they ended in, the peers after the one they lost.
    exited_at: float | None = None
    returncode: int | None = None
    first_failure: bool = False
    stopped_by_jobset: bool = False
    restarts: int = 0
    # Its pod deleted through the API (SIGTERM sent): when, and when its kubelet SIGKILLs it (the grace is over).
    deleted_at: float | None = None
    kill_at: float | None = None
    disruption: dict[str, Any] | None = None  # the DisruptionTarget condition an eviction stamped on its pod

    def termination_message(self) -> str | None:
        """The container's termination message as the kubelet reads it, None when empty or absent.

        The last 4096 bytes of the file the worker was given (``TRAINER_TERMINATION_LOG``, its
        terminationMessagePath): kubelet v1.36.3 reads it with ``tail.ReadAtMost`` (kuberuntime_container.go).
        """
        path = self.env.get(TERMINATION_LOG_ENV)
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - TERMINATION_MESSAGE_MAX))
                data = f.read(TERMINATION_MESSAGE_MAX)
        except OSError:
            return None
        return data.decode(errors="replace") or None

    @property
    def exit_code(self) -> int | None:
        """The exit code as Kubernetes reports it (128 + signal for a signalled process)."""
        rc = self.returncode
        if rc is None:
            return None
        return 128 - rc if rc < 0 else rc


@dataclass
class LocalSlice:
    """The worker processes of one train-segment attempt (what the injector acts on)."""

    jobset: str
    attempt: int
    command: list[str]
    cwd: str
    log_dir: Path
    # SIGTERM to SIGKILL when the slice is stopped: the pod spec's terminationGracePeriodSeconds.
    grace_seconds: float = 30.0
    pool: str = FIRST_POOL  # the node pool its workers run on
    workers: list[WorkerProc] = field(default_factory=list)
    first_failure_index: int | None = None
    ended_at: float | None = None
    # Workers whose next exit is expected (restarted on purpose): not counted as the set's failure.
    expected_exit: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    created_at: float = field(default_factory=time.time)
    # Workers never started, and why ("Unschedulable": no room; "ImagePullBackOff": the image never comes).
    withheld: dict[int, str] = field(default_factory=dict)
    # Workers whose host was lost (frozen, its pod Terminating from the slice's point of view): since when.
    lost: dict[int, float] = field(default_factory=dict)
    # Set to make the supervisor's own "pod" go away while the workers keep running (it re-attaches).
    supervisor_lost: threading.Event = field(default_factory=threading.Event)
    detected_at: float | None = None
    phase: NodePhase | None = None  # the supervisor's node's, once the slice ended
    # When the supervisor deleted the JobSet (its stop): the workers got SIGTERM, the grace counts from here.
    deleted_at: float | None = None
    # The workers' Job as the manifest gives it: what the Job controller decides a failure from.
    failure_policy: list[dict[str, Any]] = field(default_factory=list)
    backoff_limit: int = 6  # the Job API's default
    namespace: str = "default"
    pod_labels: dict[str, str] = field(default_factory=dict)  # the pod template's, as the Job's pods carry them
    image: str = ""  # the trainer container's
    # What its kubelets last put in the API: "pods/<name>" or "nodes/<name>" -> the object's JSON.
    published: dict[str, str] = field(default_factory=dict)

    def mark_stopped(self, detected: float) -> None:
        """Stamp the slice stopped: its last worker's exit, never before the supervisor ``detected`` the end.

        As train_segment's stop_attempt stamps it: a gang that exited within one poll must not read as stopped before.
        """
        self.ended_at = max([detected, *(w.ended_at or detected for w in self.workers)])

    def spawn(self, w: WorkerProc) -> None:
        """Start (or start again) worker ``w``, appending to its log file."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"worker-{w.index}.log", "ab")  # noqa: SIM115 - handed to the child
        w.proc = subprocess.Popen(
            self.command, env=w.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        w.pid = w.proc.pid
        w.started_at = w.started_at or now()
        w.returncode = None
        w.ended_at = w.exited_at = None
        threading.Thread(target=_stamp_exit, args=(w, w.proc), name=f"exit-{w.index}", daemon=True).start()

    def signal_worker(self, index: int, sig: int) -> None:
        """Send ``sig`` to worker ``index`` (its whole process group)."""
        w = self.workers[index]
        if w.proc is not None and w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, sig)

    def trainer_pid(self, index: int) -> int | None:
        """The pid of worker ``index``'s trainer (None: it runs none).

        Its container's process, or that process's ``-m trainer`` child where an agent (``trainer.agent``) runs it.
        """
        w = self.workers[index]
        if w.proc is None or w.proc.poll() is not None:
            return None
        try:
            top = psutil.Process(w.proc.pid)
            for p in [top, *top.children(recursive=True)]:
                argv = p.cmdline()
                trainer = "-m" in argv and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == ["trainer"]
                if trainer and p.name() != STANDBY_COMM:  # a standby waiting to be the next one is not it
                    return p.pid
        except psutil.Error:
            return None
        return None

    def kill_trainer(self, index: int) -> int | None:
        """SIGKILL worker ``index``'s trainer, as an exec of ``kill -9`` in its container does; its pid (None: none).

        Without an agent the trainer is the container's process, and its whole process group goes with it.
        """
        pid = self.trainer_pid(index)
        w = self.workers[index]
        if pid is not None and w.proc is not None and pid == w.proc.pid:
            self.signal_worker(index, signal.SIGKILL)
        elif pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pid

    def worker_of(self, pod: str) -> WorkerProc | None:
        """The worker whose pod is called ``pod``, if it is one of this slice's."""
        return next((w for w in self.workers if pod_name(self.jobset, w.index) == pod), None)

    def restart(self, index: int) -> None:
        """Kill worker ``index`` and start it again alone with the same environment (a container restart)."""
        w = self.workers[index]
        with self.lock:
            self.expected_exit.add(index)
            self.signal_worker(index, signal.SIGKILL)
            if w.proc is not None:
                w.proc.wait(timeout=30)  # SIGKILLed: only an uninterruptible sleep holds it this long
            w.restarts += 1
            self.spawn(w)
            self.expected_exit.discard(index)


UNSCHEDULABLE = "Unschedulable"
IMAGE_PULL = "ImagePullBackOff"


def node_name(index: int, pool: str = FIRST_POOL) -> str:
    """The stand-in node of worker ``index`` in node pool ``pool`` (one host per worker, as on a TPU slice)."""
    return f"local-{index}" if pool == FIRST_POOL else f"{pool}-{index}"


def pod_name(jobset: str, index: int) -> str:
    """The pod name JobSet would give worker ``index`` (without the random suffix)."""
    return f"{jobset}-workers-0-{index}"


def stamp(t: float) -> str:
    """Epoch seconds as an RFC 3339 timestamp, to the microsecond (``snapshot.first_failed`` breaks ties with it)."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _condition(type_: str, at: float | None, *, status: str = "True", reason: str = "", message: str = "") -> dict:
    c: dict[str, Any] = {"type": type_, "status": status}
    if reason:
        c["reason"] = reason
    if message:
        c["message"] = message
    if at is not None:
        c["lastTransitionTime"] = stamp(at)
    return c


def _container(w: WorkerProc, image: str, held: str | None) -> dict[str, Any] | None:
    """The trainer container's status as the kubelet reports it (None: it has none yet).

    With the fields the kubelet always sets (``image``, ``imageID``, ``ready``, ``restartCount``), which a typed
    client requires.
    """
    status = {"name": TRAINER_CONTAINER, "image": image, "imageID": "", "ready": False, "restartCount": w.restarts}
    if held == IMAGE_PULL:
        # The message as kubelet >= 1.32 writes it: the back-off repeats the pull's error (kubernetes#127918).
        pulled = f'Back-off pulling image "{image}": ErrImagePull: failed to resolve reference "{image}": not found'
        return {**status, "state": {"waiting": {"reason": IMAGE_PULL, "message": f"{pulled} (rehearsal)"}}}
    if w.proc is None:
        return None
    if w.returncode is None:
        running = {"running": {"startedAt": stamp(w.started_at or now())}}
        return {**status, "imageID": f"local://{image}", "ready": True, "state": running}
    # As the kubelet reports a container's end: 128 + the signal for a signalled process, reason Error (the
    # runtime's, for any non-zero exit: OOMKilled only for the kernel's OOM kill, which nothing here rehearses).
    ended: dict[str, Any] = {"exitCode": w.exit_code, "reason": "Completed" if w.returncode == 0 else "Error"}
    if (message := w.termination_message()) is not None:
        ended["message"] = message
    if w.started_at is not None:
        ended["startedAt"] = stamp(w.started_at)
    if w.ended_at is not None:
        ended["finishedAt"] = stamp(w.ended_at)
    return {**status, "imageID": f"local://{image}", "state": {"terminated": ended}}


def _phase(w: WorkerProc, held: str | None) -> PodPhase:
    if held is not None or w.proc is None:
        return PodPhase.PENDING
    if w.returncode is None:
        return PodPhase.RUNNING
    return PodPhase.SUCCEEDED if w.returncode == 0 else PodPhase.FAILED


def pod_object(sl: LocalSlice, w: WorkerProc) -> dict[str, Any] | None:
    """Worker ``w`` as the API returns its pod (None: gone with its deleted JobSet, its worker exited or never ran)."""
    held = sl.withheld.get(w.index)
    ran = held is None and w.proc is not None
    if sl.deleted_at is not None and not (ran and w.returncode is None):
        return None  # a deleted JobSet takes its pods with it, but for those whose container still runs
    name = pod_name(sl.jobset, w.index)
    index = str(w.index)
    meta: dict[str, Any] = {
        "name": name,
        "namespace": sl.namespace,
        "creationTimestamp": stamp(sl.created_at),
        "labels": {**sl.pod_labels, JOBSET_NAME_LABEL: sl.jobset, COMPLETION_INDEX_KEYS[0]: index},
        "annotations": {COMPLETION_INDEX_KEYS[0]: index},
    }
    deleted = sl.lost.get(w.index, w.deleted_at or sl.deleted_at)
    if ran and w.returncode is None and deleted is not None:
        meta["deletionTimestamp"] = stamp(deleted)
    spec: dict[str, Any] = {"containers": [{"name": TRAINER_CONTAINER, "image": sl.image}]}
    spec["terminationGracePeriodSeconds"] = sl.grace_seconds
    st: dict[str, Any] = {"phase": _phase(w, held).value}
    if held == UNSCHEDULABLE:
        room = f"0/{len(sl.workers)} local hosts have room for this worker (rehearsal)"
        st["conditions"] = [
            _condition("PodScheduled", sl.created_at, status="False", reason=UNSCHEDULABLE, message=room)
        ]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": st}
    if held is not None or w.proc is not None:
        spec["nodeName"] = node_name(w.index, sl.pool)
        st["conditions"] = [_condition("PodScheduled", w.started_at or sl.created_at)]
        st["conditions"] += [w.disruption] if w.disruption else []
    container = _container(w, sl.image, held)
    if container is not None:
        st["containerStatuses"] = [container]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": st}


def node_object(sl: LocalSlice, index: int) -> dict[str, Any]:
    """The stand-in node of worker ``index`` as the API returns it."""
    meta = {"name": node_name(index, sl.pool), "labels": {NODEPOOL_LABEL: sl.pool}}
    spec, ready = {}, _condition("Ready", None, reason="KubeletReady")
    if index in sl.lost:
        # As the node lifecycle controller leaves a node whose kubelet went silent: Ready Unknown, tainted.
        ready = _condition("Ready", sl.lost[index], status="Unknown", reason="NodeStatusUnknown")
        spec = {"taints": [{"key": UNREACHABLE_TAINT, "effect": "NoExecute"}]}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec, "status": {"conditions": [ready]}}


def _matches(rule: Mapping[str, Any], pod: PodEvidence) -> bool:
    """A podFailurePolicy rule's match on a failed pod (pkg/controller/job/pod_failure_policy.go, v1.36.3)."""
    on_codes = rule.get("onExitCodes")
    if on_codes is not None:
        name, op, values = on_codes.get("containerName"), on_codes.get("operator"), set(on_codes.get("values", []))
        for c in pod.containers:
            if c.state != "terminated" or c.exit_code in (None, 0) or (name and c.name != name):
                continue
            if (op == "In" and c.exit_code in values) or (op == "NotIn" and c.exit_code not in values):
                return True
        return False
    wanted = rule.get("onPodConditions") or []
    return any(c.type == w.get("type") and c.status == w.get("status", "True") for w in wanted for c in pod.conditions)


def _stamp_exit(w: WorkerProc, proc: subprocess.Popen) -> None:
    """Stamp when ``proc`` ended on ``w``, unless ``w`` was started again meanwhile."""
    proc.wait()
    if w.proc is proc:
        w.exited_at = now()


def job_failure(
    policy: Sequence[Mapping[str, Any]], backoff_limit: int, failed: Sequence[PodEvidence], namespace: str
) -> Condition | None:
    """The Job controller's verdict on the Job's failed pods, the first to end first.

    The first podFailurePolicy rule a failed pod matches decides: FailJob sets ``FailureTarget`` (reason
    PodFailurePolicy, the controller's message naming the pod and its exit code), Ignore does not count the pod,
    Count counts it; a pod no rule matches counts too, and more counted failures than ``backoffLimit`` set
    ``FailureTarget`` BackoffLimitExceeded (pkg/controller/job/job_controller.go, v1.36.3).
    """

    def ended(pod: PodEvidence) -> float | None:
        c = pod.trainer()
        return c.finished_at if c is not None else None

    counted = 0
    for pod in sorted(failed, key=lambda p: ended(p) or float("inf")):
        index, rule = next(((i, r) for i, r in enumerate(policy) if _matches(r, pod)), (None, {"action": "Count"}))
        if rule["action"] == "FailJob":
            c = pod.trainer()
            if rule.get("onExitCodes") is not None and c is not None:
                what = f"Container {c.name} for pod {namespace}/{pod.name} failed with exit code {c.exit_code}"
            else:
                wanted = {w.get("type") for w in rule["onPodConditions"]}
                cond = next(x.type for x in pod.conditions if x.type in wanted)
                what = f"Pod {namespace}/{pod.name} has condition {cond}"
            message = f"{what} matching FailJob rule at index {index}"
            return Condition(type="FailureTarget", reason="PodFailurePolicy", message=message, at=ended(pod))
        counted += rule["action"] != "Ignore"
        if counted > backoff_limit:
            message = "Job has reached the specified backoff limit"
            return Condition(type="FailureTarget", reason="BackoffLimitExceeded", message=message, at=ended(pod))
    return None


def job_object(sl: LocalSlice, pods: Sequence[PodEvidence]) -> dict[str, Any]:
    """The workers' Job as the API returns it, its conditions as the Job controller sets them from ``pods``.

    ``FailureTarget`` once it decides the Job fails (``job_failure``), ``Failed`` beside it once no pod of it runs
    any more; ``Complete`` once every pod succeeded (pkg/controller/job/job_controller.go, v1.36.3).
    """
    failed = [p for p in pods if p.phase == PodPhase.FAILED]
    cond = job_failure(sl.failure_policy, sl.backoff_limit, failed, sl.namespace)
    conditions = []
    last = max((p.finished_at for p in pods if p.finished_at is not None), default=None)
    if cond is not None:
        conditions.append(_condition(cond.type, cond.at, reason=cond.reason or "", message=cond.message or ""))
        if not any(p.phase in (PodPhase.RUNNING, PodPhase.PENDING) for p in pods):
            conditions.append(_condition("Failed", last, reason=cond.reason or "", message=cond.message or ""))
    elif len(pods) == len(sl.workers) and all(p.phase == PodPhase.SUCCEEDED for p in pods):
        conditions.append(_condition("Complete", last))
    meta = {"name": f"{sl.jobset}-workers-0", "namespace": sl.namespace, "labels": {JOBSET_NAME_LABEL: sl.jobset}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "status": {"conditions": conditions}}


# The Job's condition -> the JobSet's terminal condition: its type, reason and message (kubernetes-sigs/jobset
# ``pkg/constants/constants.go``: FailedJobsReason/Message, AllJobsCompletedReason/Message).
_JOBSET_ENDS = {
    "Failed": ("Failed", "FailedJobs", "jobset failed due to one or more job failures"),
    "Complete": ("Completed", "AllJobsCompleted", "jobset completed successfully"),
}


def jobset_status(job: Mapping[str, Any]) -> dict[str, Any]:
    """The JobSet's status as its controller sets it from its one Job: Failed or Completed once the Job is.

    JobSet reacts to a Job's ``Failed`` (not ``FailureTarget``): with no restarts allowed the JobSet fails; all its
    Jobs ``Complete``: it is Completed (``jobset_controller.go``).
    """
    types = {c["type"] for c in (job.get("status") or {}).get("conditions") or []}
    for job_type, (type_, reason, message) in _JOBSET_ENDS.items():
        if job_type in types:
            cond = {"type": type_, "status": "True", "reason": reason, "message": message}
            return {"conditions": [cond], "terminalState": type_}
    return {}


def slice_objects(sl: LocalSlice) -> dict[str, list[dict[str, Any]]]:
    """The local slice's JobSet, its Job, its pods and their nodes now, as the Kubernetes API returns them."""
    objs = {w.index: p for w in sl.workers if (p := pod_object(sl, w)) is not None}
    # A pod deleted through the API goes once its container has exited; the Job controller counted its end first.
    counted = [objs[i] for i in sorted(objs)]
    pods = [p for i, p in objs.items() if sl.workers[i].deleted_at is None or sl.workers[i].returncode is None]
    pods.sort(key=lambda p: p["metadata"]["name"])
    nodes = [node_object(sl, w.index) for w in sl.workers if sl.withheld.get(w.index) != UNSCHEDULABLE]
    # Foreground deletion: the JobSet stays until its pods are gone.
    meta = {"name": sl.jobset, "namespace": sl.namespace, "creationTimestamp": stamp(sl.created_at)}
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta}
    return {
        "jobsets": [jobset],
        "jobs": [job_object(sl, [pod_from_api(p) for p in counted])],
        "pods": pods,
        "nodes": nodes,
    }
