"""Evidence of a failed attempt: plain records, and the adapters that gather them (Kubernetes, run store, local slice).

The records here are the input of the pure ``classify(evidence)``; the ``gather_*`` functions are the
only parts that talk to the cluster or the store. The Kubernetes adapter reads raw API JSON (the
client's ``_preload_content=False``), so the fields it reads are exactly those the API returns.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from recovery_steps.kernel.documents import read_worker_reports
from recovery_steps.kernel.k8s import (
    JOBSET_GROUP,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    MAINTENANCE_LABELS,
    RECLAIM_TAINTS,
    SPOT_LABEL,
)
from recovery_steps.kernel.records import LocalSliceRecord, SupervisionRecord, WorkerExitReport
from recovery_steps.kernel.store import DocumentError, RunLayout, RunStore

log = logging.getLogger(__name__)

COMPLETION_INDEX_KEYS = ("batch.kubernetes.io/job-completion-index",)
TRAINER_CONTAINER = "trainer"

SPOT_LABELS = (SPOT_LABEL, "cloud.google.com/gke-preemptible")


class _Ev(BaseModel):
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


class PodEvidence(_Ev):
    """One worker pod."""

    name: str
    worker_index: int | None = None
    node: str | None = None
    phase: str | None = None
    reason: str | None = Field(default=None, description="Pod status reason (Evicted, NodeLost, ...).")
    message: str | None = None
    containers: list[ContainerState] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)
    events: list[str] = Field(default_factory=list, description="'Reason: message' of warning events.")

    def disruption(self) -> Condition | None:
        """The pod's DisruptionTarget condition, if Kubernetes set one."""
        for c in self.conditions:
            if c.type == "DisruptionTarget" and c.status == "True":
                return c
        return None

    def trainer(self) -> ContainerState | None:
        """The trainer container (or the only/first container)."""
        for c in self.containers:
            if c.name == TRAINER_CONTAINER:
                return c
        return self.containers[0] if self.containers else None


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


class JobEvidence(_Ev):
    """A child Job of the JobSet."""

    name: str
    failed: bool = False
    failure_reason: str | None = Field(default=None, description="PodFailurePolicy, BackoffLimitExceeded, ...")
    failure_message: str | None = None
    failed_at: float | None = None


class JobSetEvidence(_Ev):
    """The JobSet of the attempt."""

    name: str
    found: bool = True
    conditions: list[Condition] = Field(default_factory=list)
    terminal_state: str | None = None


class Evidence(_Ev):
    """Everything known about a failed attempt: the pure classifier's only input."""

    backend: str = Field(description="'gke' or 'local'.")
    attempt: int
    jobset: JobSetEvidence | None = None
    jobs: list[JobEvidence] = Field(default_factory=list)
    pods: list[PodEvidence] = Field(default_factory=list)
    nodes: list[NodeEvidence] = Field(default_factory=list)
    reports: list[WorkerExitReport] = Field(default_factory=list)
    local_slice: LocalSliceRecord | None = None
    step_exit_code: int | None = Field(
        default=None, description="Exit code of the step that failed before training started (provision-slice)."
    )
    supervision: SupervisionRecord | None = Field(
        default=None, description="How train-segment's supervisor saw the attempt end (stall kind, reason)."
    )
    notes: list[str] = Field(default_factory=list, description="What an adapter could not read, and why.")

    def node(self, name: str | None) -> NodeEvidence | None:
        """The node called ``name``, if gathered."""
        for n in self.nodes:
            if n.name == name:
                return n
        return None


# ---------------------------------------------------------------- Kubernetes (raw API JSON -> records)


def parse_time(value: str | None) -> float | None:
    """RFC 3339 time as the API writes it (``2024-05-01T10:00:12Z``) -> epoch seconds."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _conditions(obj: dict[str, Any]) -> list[Condition]:
    out = []
    for c in (obj.get("status") or {}).get("conditions") or []:
        out.append(
            Condition(
                type=str(c.get("type", "")),
                status=str(c.get("status", "")),
                reason=c.get("reason"),
                message=c.get("message"),
                at=parse_time(c.get("lastTransitionTime") or c.get("lastProbeTime")),
            )
        )
    return out


def jobset_from_api(obj: dict[str, Any]) -> JobSetEvidence:
    """A JobSet object (jobset.x-k8s.io/v1alpha2) -> JobSetEvidence."""
    status = obj.get("status") or {}
    return JobSetEvidence(
        name=(obj.get("metadata") or {}).get("name", ""),
        conditions=_conditions(obj),
        terminal_state=status.get("terminalState"),
    )


def job_from_api(obj: dict[str, Any]) -> JobEvidence:
    """A batch/v1 Job -> JobEvidence (its Failed condition, if any)."""
    failed = next((c for c in _conditions(obj) if c.type == "Failed" and c.status == "True"), None)
    return JobEvidence(
        name=(obj.get("metadata") or {}).get("name", ""),
        failed=failed is not None,
        failure_reason=failed.reason if failed else None,
        failure_message=failed.message if failed else None,
        failed_at=failed.at if failed else None,
    )


def _container(cs: dict[str, Any]) -> ContainerState:
    state = cs.get("state") or {}
    term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated")
    wait = state.get("waiting") or {}
    out = ContainerState(
        name=cs.get("name", ""), waiting_reason=wait.get("reason"), waiting_message=wait.get("message")
    )
    if term:
        out.exit_code = term.get("exitCode")
        out.signal = term.get("signal")
        out.reason = term.get("reason")
        out.message = term.get("message")
        out.started_at = parse_time(term.get("startedAt"))
        out.finished_at = parse_time(term.get("finishedAt"))
    return out


def _worker_index(meta: dict[str, Any]) -> int | None:
    for where in (meta.get("labels") or {}, meta.get("annotations") or {}):
        for k in COMPLETION_INDEX_KEYS:
            if k in where:
                try:
                    return int(where[k])
                except (TypeError, ValueError):
                    return None
    return None


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
        phase=status.get("phase"),
        reason=status.get("reason"),
        message=status.get("message"),
        containers=[_container(cs) for cs in statuses],
        conditions=_conditions(obj),
        events=list(events or []),
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
    return NodeEvidence(
        name=meta.get("name", ""),
        ready=None if ready is None or ready.status == "Unknown" else ready.status == "True",
        ready_reason=ready.reason if ready else None,
        ready_message=ready.message if ready else None,
        ready_since=ready.at if ready else None,
        taints=taints,
        labels=keep,
    )


class KubernetesReader:
    """Reads one attempt's JobSet, Jobs, pods, nodes and events through the kubernetes client."""

    def __init__(self, api_client: Any):
        from kubernetes import client

        self._custom = client.CustomObjectsApi(api_client)
        self._batch = client.BatchV1Api(api_client)
        self._core = client.CoreV1Api(api_client)

    @staticmethod
    def _json(resp: Any) -> dict[str, Any]:
        return json.loads(resp.data)

    def jobset(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The JobSet object, or None when it does not exist."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self._json(
                self._custom.get_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL, name, _preload_content=False
                )
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def jobs(self, namespace: str, jobset: str) -> list[dict[str, Any]]:
        """The JobSet's child Jobs."""
        sel = f"{JOBSET_NAME_LABEL}={jobset}"
        return self._json(self._batch.list_namespaced_job(namespace, label_selector=sel, _preload_content=False)).get(
            "items", []
        )

    def pods(self, namespace: str, jobset: str) -> list[dict[str, Any]]:
        """The JobSet's pods."""
        sel = f"{JOBSET_NAME_LABEL}={jobset}"
        return self._json(self._core.list_namespaced_pod(namespace, label_selector=sel, _preload_content=False)).get(
            "items", []
        )

    def node(self, name: str) -> dict[str, Any] | None:
        """The node, or None when it is gone."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self._json(self._core.read_node(name, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def events(self, namespace: str, pod: str) -> list[str]:
        """Warning events of a pod, as 'Reason: message'."""
        sel = f"involvedObject.name={pod},involvedObject.kind=Pod"
        items = self._json(self._core.list_namespaced_event(namespace, field_selector=sel, _preload_content=False)).get(
            "items", []
        )
        return [f"{e.get('reason')}: {e.get('message')}" for e in items if e.get("type", "Warning") == "Warning"]


def gather_kubernetes(api_client: Any, namespace: str, jobset: str, evidence: Evidence) -> Evidence:
    """Fill ``evidence`` with the JobSet, Jobs, pods, their nodes and Pending pods' events.

    What cannot be read is noted in ``evidence.notes`` (the classifier still sees the worker reports).
    """
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    reader = KubernetesReader(api_client)
    try:
        js = reader.jobset(namespace, jobset)
        evidence.jobset = jobset_from_api(js) if js else JobSetEvidence(name=jobset, found=False)
        if js is None:
            evidence.notes.append(f"JobSet {namespace}/{jobset} not found")
        evidence.jobs = [job_from_api(j) for j in reader.jobs(namespace, jobset)]
        pods = reader.pods(namespace, jobset)
        for p in pods:
            name = (p.get("metadata") or {}).get("name", "")
            pending = (p.get("status") or {}).get("phase") == "Pending"
            evidence.pods.append(pod_from_api(p, reader.events(namespace, name) if pending else None))
        for node_name in sorted({p.node for p in evidence.pods if p.node}):
            n = reader.node(node_name)
            evidence.nodes.append(node_from_api(n) if n else NodeEvidence(name=node_name, found=False))
    except (ApiException, HTTPError, OSError, ValueError) as e:
        # An unreachable or misbehaving API leaves the store's evidence; the classifier still runs.
        what = f"HTTP {e.status} {e.reason}" if isinstance(e, ApiException) else type(e).__name__
        evidence.notes.append(f"Kubernetes API not fully readable ({what}); classified from what was read")
        log.warning("kubernetes evidence incomplete: %s", e)
    return evidence


# ---------------------------------------------------------------- run store


def gather_reports(store: RunStore, attempt: int, evidence: Evidence) -> Evidence:
    """Add every worker's exit report of ``attempt`` (unreadable ones are noted, not fatal)."""
    reports, problems = read_worker_reports(store, attempt)
    evidence.reports.extend(reports)
    evidence.reports.sort(key=lambda r: r.process_index)
    evidence.notes.extend(f"unreadable worker report {p}" for p in problems)
    return evidence


def gather_supervision(store: RunStore, attempt: int, evidence: Evidence) -> Evidence:
    """Add the supervisor's record of the attempt (``attempts/<n>/supervision.json``), when it wrote one."""
    try:
        evidence.supervision = store.read_record(RunLayout.supervision(attempt), SupervisionRecord)
    except DocumentError as e:
        evidence.notes.append(f"unreadable supervision record {e}")
    return evidence


def gather_local_slice(store: RunStore, attempt: int, evidence: Evidence) -> Evidence:
    """Add the local runner's slice record of ``attempt``."""
    rel = RunLayout.local_slice(attempt)
    try:
        rec = store.read_record(rel, LocalSliceRecord)
    except DocumentError as e:
        evidence.notes.append(f"unreadable local slice record {e}")
        return evidence
    if rec is None:
        evidence.notes.append(f"no local slice record at {rel}")
        return evidence
    evidence.local_slice = rec
    return evidence
