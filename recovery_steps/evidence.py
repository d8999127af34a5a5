"""Evidence of a failed attempt: plain records, and the adapters that gather them (Kubernetes, run store, local slice).

The records here are the input of the pure ``classify(evidence)``; the ``gather_*`` functions are the
only parts that talk to the cluster or the store. The Kubernetes adapter reads through the kernel's one client
layer (``kernel.k8s.Kube``: raw API JSON, client-side timeouts) into the one snapshot model (``kernel.snapshot``).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from recovery_steps.kernel.contract import Backend
from recovery_steps.kernel.documents import read_worker_reports
from recovery_steps.kernel.k8s import Kube
from recovery_steps.kernel.records import LocalSliceRecord, SupervisionRecord, WorkerExitReport
from recovery_steps.kernel.snapshot import (
    Condition,
    ContainerState,
    JobEvidence,
    JobSetEvidence,
    NodeEvidence,
    PodEvidence,
    job_from_api,
    jobset_from_api,
    node_from_api,
    parse_time,
    pod_from_api,
)
from recovery_steps.kernel.store import DocumentError, RunLayout, RunStore

log = logging.getLogger(__name__)

__all__ = [  # the snapshot records are the evidence's own; importers of this module keep their names
    "Condition",
    "ContainerState",
    "Evidence",
    "JobEvidence",
    "JobSetEvidence",
    "NodeEvidence",
    "PodEvidence",
    "gather_kubernetes",
    "gather_local_slice",
    "gather_reports",
    "gather_supervision",
    "job_from_api",
    "jobset_from_api",
    "node_from_api",
    "parse_time",
    "pod_from_api",
    "use_supervisor_snapshot",
]


class Evidence(BaseModel):
    """Everything known about a failed attempt: the pure classifier's only input."""

    model_config = ConfigDict(extra="forbid")

    backend: Backend = Field(description="Where the attempt's gang ran.")
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


# ---------------------------------------------------------------- Kubernetes


def gather_kubernetes(api_client: Any, namespace: str, jobset: str, evidence: Evidence) -> Evidence:
    """Fill ``evidence`` with the JobSet, Jobs, pods, their nodes and Pending pods' events.

    What cannot be read is noted in ``evidence.notes`` (the classifier still sees the worker reports).
    """
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    kube = Kube(api_client, namespace)
    try:
        js = kube.get_jobset(jobset)
        evidence.jobset = jobset_from_api(js) if js else JobSetEvidence(name=jobset, found=False)
        if js is None:
            evidence.notes.append(f"JobSet {namespace}/{jobset} not found")
        evidence.jobs = [job_from_api(j) for j in kube.items(kube.list_jobs, jobset)]
        for p in kube.items(kube.list_pods, jobset):
            name = (p.get("metadata") or {}).get("name", "")
            pending = (p.get("status") or {}).get("phase") == "Pending"
            evidence.pods.append(pod_from_api(p, kube.pod_warnings(name) if pending else None))
        for node_name in sorted({p.node for p in evidence.pods if p.node}):
            n = kube.get_node(node_name)
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


def use_supervisor_snapshot(evidence: Evidence) -> Evidence:
    """Fill in the supervisor's snapshot when the API has no pod of the attempt left.

    The supervisor's stop deleted the JobSet, its Jobs and pods; the exit codes, reasons and conditions it saw
    before the stop are the evidence.
    """
    snap = evidence.supervision.snapshot if evidence.supervision else None
    if snap is None or evidence.pods:
        return evidence
    if evidence.jobset is None or not evidence.jobset.found:
        evidence.jobset = snap.jobset or evidence.jobset
    evidence.jobs = evidence.jobs or list(snap.jobs)
    evidence.pods = list(snap.pods)
    read = {n.name for n in evidence.nodes if n.found}
    evidence.nodes = [n for n in evidence.nodes if n.found] + [n for n in snap.nodes if n.name not in read]
    evidence.notes.append(
        f"no pod of the attempt left in the API: pods, Jobs and nodes as train-segment saw them before its stop "
        f"(at {snap.taken_at:.0f})"
    )
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
