"""What the Kubernetes API said about an attempt: its JobSet, Jobs, pods and nodes, as plain records.

Built from raw API JSON (the client's ``_preload_content=False``), so the fields read are exactly those the API
returns. classify-failure reads them from the API; train-segment records them before it stops the attempt (the stop
deletes the objects), so the evidence survives the stop.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from jaxrec.model.names import (
    MAINTENANCE_LABELS,
    NODEPOOL_LABEL,
    RECLAIM_TAINTS,
    SPOT_LABEL,
    TPU_RESOURCE,
    UNREACHABLE_TAINT,
)

COMPLETION_INDEX_KEYS = ("batch.kubernetes.io/job-completion-index",)
TRAINER_CONTAINER = "trainer"

SPOT_LABELS = (SPOT_LABEL, "cloud.google.com/gke-preemptible")


class _Ev(BaseModel):  # noqa: D101
    model_config = ConfigDict(extra="forbid")


class Condition(_Ev):
    """A Kubernetes status condition (JobSet, Job, pod or node)."""

    type: str
    status: str = "True"
    reason: str | None = None
    message: str | None = None
    at: float | None = Field(default=None, description="lastTransitionTime, epoch seconds.")


class ContainerState(_Ev):
    """One container of a pod: how it ended, or why it is waiting."""

    name: str
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = Field(default=None, description="Terminated reason (OOMKilled, Error, ...).")
    message: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    waiting_reason: str | None = Field(default=None, description="ErrImagePull, ImagePullBackOff, ...")
    waiting_message: str | None = None
    state: str | None = Field(default=None, description="The current state: waiting, running or terminated.")
    running_since: float | None = Field(default=None, description="startedAt of the current (running) state.")


class PodEvidence(_Ev):
    """One worker pod."""

    name: str
    worker_index: int | None = None
    node: str | None = None
    phase: PodPhase | None = None
    reason: str | None = Field(default=None, description="Pod status reason (Evicted, NodeLost, ...).")
    message: str | None = None
    containers: list[ContainerState] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)
    events: list[str] = Field(default_factory=list, description="'Reason: message' of warning events.")
    created_at: float | None = Field(default=None, description="creationTimestamp, epoch seconds.")
    deleted_at: float | None = Field(default=None, description="deletionTimestamp: set once the pod is being deleted.")
    grace_s: float | None = Field(default=None, description="spec.terminationGracePeriodSeconds.")

    def condition(self, type_: str) -> Condition | None:
        """The condition of ``type_``, if the pod has it."""
        return next((c for c in self.conditions if c.type == type_), None)

    def disruption(self) -> Condition | None:
        """The pod's DisruptionTarget condition, if Kubernetes set one."""
        return next((c for c in self.conditions if c.type == "DisruptionTarget" and c.status == "True"), None)

    def trainer(self) -> ContainerState | None:
        """The trainer container (or the only/first container)."""
        named = next((c for c in self.containers if c.name == TRAINER_CONTAINER), None)
        return named or (self.containers[0] if self.containers else None)

    # What follows is derived from the trainer container's state, as the supervisor and classify-failure read it.

    @property
    def index(self) -> int | None:
        """The worker index (the Job completion index)."""
        return self.worker_index

    @property
    def label(self) -> str:
        """``worker <i>`` (or the pod name when the index is unknown)."""
        return f"worker {self.worker_index}" if self.worker_index is not None else f"pod {self.name}"

    def _ended(self) -> ContainerState | None:
        c = self.trainer()
        return c if c is not None and c.state == "terminated" else None

    @property
    def exit_code(self) -> int | None:
        """The trainer container's exit code, once it has ended."""
        c = self._ended()
        return c.exit_code if c else None

    @property
    def terminated_reason(self) -> str | None:
        """Why the trainer container ended (Completed, Error, OOMKilled, ...), once it has."""
        c = self._ended()
        return c.reason if c else None

    @property
    def finished_at(self) -> float | None:
        """The trainer container's finishedAt, once it has ended."""
        c = self._ended()
        return c.finished_at if c else None

    @property
    def running_since(self) -> float | None:
        """The trainer container's startedAt (running, or ended)."""
        c = self.trainer()
        if c is None:
            return None
        return c.running_since or (c.started_at if c.state == "terminated" else None)

    @property
    def waiting_reason(self) -> str | None:
        """The trainer container's waiting reason (ErrImagePull, ContainerCreating, ...)."""
        c = self.trainer()
        return c.waiting_reason if c else None

    @property
    def waiting_message(self) -> str | None:
        """The trainer container's waiting message."""
        c = self.trainer()
        return c.waiting_message if c else None

    @property
    def ended(self) -> bool:
        """Succeeded or Failed: every container has ended for good."""
        return self.phase is not None and self.phase.ended


class NodeEvidence(_Ev):
    """A node a worker ran on."""

    name: str
    ready: bool | None = Field(default=None, description="Ready condition (None: unknown or node gone).")
    ready_reason: str | None = None
    ready_message: str | None = None
    ready_since: float | None = None
    taints: list[str] = Field(default_factory=list, description="'key=value:effect'.")
    labels: dict[str, str] = Field(default_factory=dict, description="Maintenance and spot labels only.")
    found: bool = True
    pool: str | None = Field(default=None, description=f"Its GKE node pool (the {NODEPOOL_LABEL} label).")
    unschedulable: bool = Field(default=False, description="spec.unschedulable: cordoned.")
    allocatable_tpu: int | None = Field(
        default=None, description=f"status.allocatable {TPU_RESOURCE} (None: the node reports no allocatable)."
    )

    @property
    def taint_effects(self) -> list[tuple[str, str]]:
        """Each taint's key and effect."""
        split = (t.rpartition(":") for t in self.taints)
        return [(head.split("=", 1)[0], effect) for head, _, effect in split]

    @property
    def unreachable(self) -> bool:
        """Tainted unreachable: the node lifecycle controller lost its kubelet."""
        return any(t.split("=", 1)[0].split(":", 1)[0] == UNREACHABLE_TAINT for t in self.taints)

    @property
    def spot(self) -> bool:
        """True on a Spot or preemptible VM."""
        return any(self.labels.get(k) == "true" for k in SPOT_LABELS)

    def maintenance(self) -> str | None:
        """A label or taint that says the node is under maintenance or being reclaimed, or None."""
        for t in self.taints:
            if t.split("=", 1)[0].split(":", 1)[0] in RECLAIM_TAINTS:
                return f"taint {t}"
        for k in MAINTENANCE_LABELS:
            if k in self.labels:
                return f"label {k}={self.labels[k]}"
        return None

    @property
    def lost(self) -> bool:
        """True when the node cannot run (or confirm the end of) its pods: gone, unreachable or not Ready."""
        return not self.found or self.unreachable or self.ready is not True

    @property
    def shutting_down(self) -> bool:
        """True when the kubelet reports a graceful node shutdown (pkg/kubelet/nodeshutdown ``ShutdownStatus``)."""
        text = f"{self.ready_reason or ''} {self.ready_message or ''}".lower()
        return "shutting down" in text or "shutdown" in text

    def lost_since(self, now: float, seen_lost_at: float | None = None) -> float:
        """When the node was lost: its Ready transition, else when it was first seen lost, else ``now``."""
        if self.found and self.ready is not True and self.ready_since is not None:
            return self.ready_since
        return seen_lost_at if seen_lost_at is not None else now

    @property
    def state(self) -> str:
        """``gone``, ``unreachable``, ``NotReady`` or ``Ready``, then what the node says about it."""
        state = "gone" if not self.found else ("unreachable" if self.unreachable else "NotReady")
        if not self.lost:
            state = "Ready"
        facts = [f"{self.ready_reason or '-'}: {self.ready_message}" if self.ready_message else self.ready_reason]
        facts += ["Spot" if self.spot else None, self.maintenance()]
        told = ", ".join(f for f in facts if f and self.found)
        return f"{state} ({told})" if told else state


class JobEvidence(_Ev):
    """A child Job of the JobSet."""

    name: str
    created_at: float | None = Field(default=None, description="creationTimestamp, epoch seconds.")
    failed: bool = False
    failure_reason: str | None = Field(default=None, description="PodFailurePolicy, BackoffLimitExceeded, ...")
    failure_message: str | None = None
    failed_at: float | None = None
    conditions: list[Condition] = Field(default_factory=list)
    events: list[str] = Field(
        default_factory=list, description="'Reason: message' of the Job's warning events (FailedCreate, ...)."
    )

    def has(self, type_: str) -> Condition | None:
        """The True condition of ``type_``, if any."""
        return next((c for c in self.conditions if c.type == type_ and c.status == "True"), None)

    def failure(self) -> Condition | None:
        """The Job's failure: its Failed condition, else the FailureTarget that precedes it, else the record's own.

        The Job controller sets FailureTarget as soon as it decides the Job fails (a podFailurePolicy FailJob rule,
        the backoff limit) and Failed only once every pod is terminal: either is the failure, with its reason.
        """
        found = self.has("Failed") or self.has("FailureTarget")
        if found is None and self.failed:
            found = Condition(
                type="Failed", reason=self.failure_reason, message=self.failure_message, at=self.failed_at
            )
        return found


class JobSetEvidence(_Ev):
    """The JobSet of the attempt."""

    name: str
    found: bool = True
    conditions: list[Condition] = Field(default_factory=list)
    terminal_state: str | None = None
    created_at: float | None = Field(default=None, description="creationTimestamp, epoch seconds.")

    @property
    def finished(self) -> bool:
        """The JobSet ended: its terminalState, or a Completed or Failed condition."""
        return bool(self.terminal_state) or any(
            c.type in ("Completed", "Failed") and c.status == "True" for c in self.conditions
        )


class ClusterSnapshot(_Ev):
    """The attempt's objects as one observer saw them at one time."""

    taken_at: float = Field(description="Epoch seconds.")
    jobset: JobSetEvidence | None = None
    jobs: list[JobEvidence] = Field(default_factory=list)
    pods: list[PodEvidence] = Field(default_factory=list)
    nodes: list[NodeEvidence] = Field(default_factory=list)
    unreadable: str | None = Field(
        default=None,
        description="Why part of this view is not current (a watch or a node read failing now; the parts kept are "
        "the last ones read); None when every read behind it succeeded.",
    )

    @property
    def live_jobset(self) -> JobSetEvidence | None:
        """The attempt's JobSet when it exists (None: never seen, or gone)."""
        return self.jobset if self.jobset is not None and self.jobset.found else None


def gang_pool(snap: ClusterSnapshot | None) -> tuple[str | None, bool | None]:
    """The one node pool every worker of ``snap`` ran on, and whether their nodes were healthy.

    The pool is None where the nodes whose pool is known are on several, where none is, or where there is no
    snapshot. Healthy: True when each worker's node was found, Ready and reachable, schedulable (not cordoned) and
    under no maintenance or reclaim notice; False when one was seen otherwise; None when that is not known (a node
    never read, no snapshot). A pool the gang left healthy is where the next gang of the run finds its hosts'
    local parts and caches.
    """
    if snap is None:
        return None, None
    nodes = {n.name: n for n in snap.nodes}
    used = [nodes.get(p.node) for p in snap.pods if p.node]
    known = [n for n in used if n is not None]
    pools = {n.pool for n in known if n.pool}
    pool = next(iter(pools)) if len(pools) == 1 else None
    if any(n.lost or n.unschedulable or n.maintenance() for n in known):
        return pool, False
    return pool, (True if used and len(known) == len(used) else None)


# ---------------------------------------------------------------- raw API JSON -> records


def parse_time(value: str | None) -> float | None:
    """RFC 3339 time as the API writes it (``2024-05-01T10:00:12Z``) -> epoch seconds."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _conditions(obj: dict[str, Any]) -> list[Condition]:
    return [
        Condition(
            type=str(c.get("type", "")),
            status=str(c.get("status", "")),
            reason=c.get("reason"),
            message=c.get("message"),
            at=parse_time(c.get("lastTransitionTime") or c.get("lastProbeTime")),
        )
        for c in (obj.get("status") or {}).get("conditions") or []
    ]


def jobset_from_api(obj: dict[str, Any]) -> JobSetEvidence:
    """A JobSet object (jobset.x-k8s.io/v1alpha2) -> JobSetEvidence."""
    meta = obj.get("metadata") or {}
    return JobSetEvidence(
        name=meta.get("name", ""),
        conditions=_conditions(obj),
        terminal_state=(obj.get("status") or {}).get("terminalState"),
        created_at=parse_time(meta.get("creationTimestamp")),
    )


def job_from_api(obj: dict[str, Any]) -> JobEvidence:
    """A batch/v1 Job -> JobEvidence (its Failed condition, or the FailureTarget that precedes it).

    Since Kubernetes 1.31 the Job controller sets FailureTarget when a podFailurePolicy rule matches and adds
    Failed only once every pod is terminal (kubernetes ``pkg/controller/job/job_controller.go``); a Job seen
    between the two, or deleted before Failed, has already failed for the same reason and message.
    """
    meta = obj.get("metadata") or {}
    job = JobEvidence(
        name=meta.get("name", ""), created_at=parse_time(meta.get("creationTimestamp")), conditions=_conditions(obj)
    )
    failed = job.failure()
    if failed is not None:
        job.failed, job.failure_reason = True, failed.reason
        job.failure_message, job.failed_at = failed.message, failed.at
    return job


def _container(cs: dict[str, Any]) -> ContainerState:
    state = cs.get("state") or {}
    term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
    wait = state.get("waiting") or {}
    return ContainerState(
        name=cs.get("name", ""),
        exit_code=term.get("exitCode"),
        signal=term.get("signal"),
        reason=term.get("reason"),
        message=term.get("message"),
        started_at=parse_time(term.get("startedAt")),
        finished_at=parse_time(term.get("finishedAt")),
        waiting_reason=wait.get("reason"),
        waiting_message=wait.get("message"),
        state=next((k for k in ("terminated", "running", "waiting") if state.get(k) is not None), None),
        running_since=parse_time((state.get("running") or {}).get("startedAt")),
    )


def _worker_index(meta: dict[str, Any]) -> int | None:
    for where in (meta.get("labels") or {}, meta.get("annotations") or {}):
        for k in COMPLETION_INDEX_KEYS:
            if k in where:
                try:
                    return int(where[k])
                except (TypeError, ValueError):
                    return None
    return None


F = TypeVar("F")


def first_failed(
    failures: Sequence[F],
    *,
    ended: Callable[[F], float | None],
    index: Callable[[F], int | None],
    rank: Callable[[F], int] = lambda _: 0,
    named: Callable[[F], bool] = lambda _: False,
) -> F:
    """The failure an attempt's end is named after, the supervisor's and classify-failure's one rule.

    The first to end, by the second (a container's ``finishedAt`` has one-second steps: ends within one second
    are a tie, whatever finer clock a record has), an end not known last; in a tie the cause before what follows
    from it (``rank``: 0 a cause, higher a consequence, such as a worker's exit on losing its peer, which comes a
    heartbeat timeout after the failure it reports), then the one its Job's failure names (``named``), then the
    earlier by the finer clock, then the lowest index.
    """

    def key(f: F) -> tuple:
        t, i = ended(f), index(f)
        return (t is None, int(t) if t is not None else 0, rank(f), not named(f), t or 0.0, i is None, i or 0)

    return min(failures, key=key)


class PodPhase(enum.StrEnum):
    """A pod's ``status.phase`` (k8s.io/api v0.36.3, ``core/v1/types.go`` ``PodPhase``): a closed set."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"

    @classmethod
    def of(cls, value: str | None) -> PodPhase | None:
        """The phase an API object reports (``None`` when it reports none; a value outside the set, Unknown)."""
        if value is None:
            return None
        return cls(value) if value in cls._value2member_map_ else cls.UNKNOWN

    @property
    def ended(self) -> bool:
        """Succeeded or Failed: every container has ended for good."""
        return self in (PodPhase.SUCCEEDED, PodPhase.FAILED)


def pod_from_api(obj: dict[str, Any], events: list[str] | None = None) -> PodEvidence:
    """A core/v1 Pod -> PodEvidence (worker index from the Job completion index)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    return PodEvidence(
        name=meta.get("name", ""),
        worker_index=_worker_index(meta),
        node=spec.get("nodeName"),
        phase=PodPhase.of(status.get("phase")),
        reason=status.get("reason"),
        message=status.get("message"),
        containers=[_container(cs) for cs in statuses],
        conditions=_conditions(obj),
        events=list(events or []),
        created_at=parse_time(meta.get("creationTimestamp")),
        deleted_at=parse_time(meta.get("deletionTimestamp")),
        grace_s=spec.get("terminationGracePeriodSeconds"),
    )


def node_from_api(obj: dict[str, Any]) -> NodeEvidence:
    """A core/v1 Node -> NodeEvidence (Ready condition, taints, maintenance and spot labels)."""
    meta = obj.get("metadata") or {}
    ready = next((c for c in _conditions(obj) if c.type == "Ready"), None)
    labels = meta.get("labels") or {}
    keep = {k: str(v) for k, v in labels.items() if k in MAINTENANCE_LABELS or k in SPOT_LABELS}
    taints = []
    for t in (obj.get("spec") or {}).get("taints") or []:
        value = f"={t['value']}" if t.get("value") else ""
        taints.append(f"{t.get('key', '')}{value}:{t.get('effect', '')}")
    spec, allocatable = obj.get("spec") or {}, (obj.get("status") or {}).get("allocatable")
    return NodeEvidence(
        name=meta.get("name", ""),
        ready=None if ready is None or ready.status == "Unknown" else ready.status == "True",
        ready_reason=ready.reason if ready else None,
        ready_message=ready.message if ready else None,
        ready_since=ready.at if ready else None,
        taints=taints,
        labels=keep,
        pool=labels.get(NODEPOOL_LABEL),
        unschedulable=bool(spec.get("unschedulable")),
        allocatable_tpu=None if allocatable is None else _whole(allocatable.get(TPU_RESOURCE, "0")),
    )


def _whole(quantity: Any) -> int:
    """A whole-count resource quantity (``google.com/tpu``: ``"4"``); 0 when it is not one."""
    try:
        return int(str(quantity))
    except ValueError:
        return 0
