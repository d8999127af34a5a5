"""Evidence of a failed attempt: plain records, and the adapters that gather them (Kubernetes, run store).

The records here are the input of the pure ``classify(evidence)``; the ``gather_*`` functions are the
only parts that talk to the cluster or the store. The Kubernetes adapter reads through the one client (adapters.kube)
layer (``adapters.kube.Kube``: raw API JSON, client-side timeouts) into the one snapshot model (``model.snapshot``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from jaxrec.adapters.documents import read_worker_reports
from jaxrec.adapters.kube import Kube
from jaxrec.adapters.store import DocumentError, RunLayout, RunStore, first_line, store_errors
from jaxrec.model.contract import Backend
from jaxrec.model.records import AgentState, AgentStateKind, SupervisionRecord, WorkerExitReport
from jaxrec.model.snapshot import (
    JobEvidence,
    JobSetEvidence,
    NodeEvidence,
    PodEvidence,
    PodPhase,
    job_from_api,
    jobset_from_api,
    node_from_api,
    pod_from_api,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


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
    step_exit_code: int | None = Field(
        default=None, description="Exit code of the step that failed before training started (provision-slice)."
    )
    supervision: SupervisionRecord | None = Field(
        default=None, description="How train-segment's supervisor saw the attempt end (stall kind, reason)."
    )
    agents: list[AgentState] = Field(
        default_factory=list,
        description="The workers' agents (level 0) that saw this attempt's trainer exit: its code where the pod, "
        "still running, has none.",
    )
    notes: list[str] = Field(default_factory=list, description="What an adapter could not read, and why.")
    from_snapshot: bool = Field(
        default=False, description="The pods and Jobs are the supervisor's snapshot: the API had no pod left."
    )

    def node(self, name: str | None) -> NodeEvidence | None:
        """The node called ``name``, if gathered."""
        return next((n for n in self.nodes if n.name == name), None)


# ---------------------------------------------------------------- Kubernetes


class EvidenceUnreadable(Exception):
    """A read the verdict depends on failed: the attempt cannot be classified now.

    A read that failed is never evidence of absence: a JobSet, Job, pod or node that cannot be read may be a gang
    that still runs, or the failure's cause. ``error`` is the client's own error (``adapters.kube.api_exit_code`` maps
    it to the step's exit code); only a 404 is absence, and the adapter never raises this for one.
    """

    def __init__(self, what: str, error: BaseException):
        from jaxrec.adapters.kube import api_error_line

        super().__init__(f"cannot read {what}: {api_error_line(error)}")
        self.what, self.error = what, error


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a Kubernetes read raises when the API refuses, cannot be reached, or answers a body that is not JSON."""
    from recovery_steps.step import api_failures

    return (*api_failures(), ValueError)


def gather_kubernetes(api_client: Any, namespace: str, jobset: str, evidence: Evidence) -> Evidence:
    """Fill ``evidence`` with the JobSet, Jobs, pods, their nodes, and the warning events of Jobs and unstarted pods.

    A 404 is absence (noted). Events only add detail: one list that cannot be read is noted and skipped.

    Raises:
        EvidenceUnreadable: The JobSet, its Jobs, its pods or a worker's node could not be read.
    """
    kube = Kube(api_client, namespace)
    evidence.jobset = _must(f"JobSet {namespace}/{jobset}", lambda: _jobset(kube, jobset))
    if not evidence.jobset.found:
        evidence.notes.append(f"JobSet {namespace}/{jobset} not found")
    evidence.jobs = _must(
        f"the Jobs of JobSet {jobset}", lambda: [job_from_api(j) for j in kube.items(kube.list_jobs, jobset)]
    )
    evidence.pods = _must(
        f"the pods of JobSet {jobset}", lambda: [pod_from_api(p) for p in kube.items(kube.list_pods, jobset)]
    )
    _add_warnings(kube, evidence)
    for name in sorted({p.node for p in evidence.pods if p.node}):
        evidence.nodes.append(_must(f"node {name}", lambda name=name: _node(kube, name)))
    return evidence


def gather_snapshot_events(api_client: Any, namespace: str, evidence: Evidence) -> Evidence:
    """Add the warning events of the Jobs and unstarted pods of the supervisor's snapshot, when it is the evidence.

    The supervisor's stop deleted them, but their events outlive them (the API server's ``--event-ttl``, an hour
    by default): a Job's FailedCreate is often the only word on why no pod ever ran. Unreadable ones are noted.
    """
    if evidence.from_snapshot:
        evidence.jobs = [j.model_copy(deep=True) for j in evidence.jobs]
        evidence.pods = [p.model_copy(deep=True) for p in evidence.pods]
        _add_warnings(Kube(api_client, namespace), evidence)
    return evidence


def _add_warnings(kube: Kube, evidence: Evidence) -> None:
    """The warning events of every Job and of every pod whose trainer never ran, where none are known yet."""
    for job in evidence.jobs:
        job.events = job.events or _warnings(evidence, f"Job {job.name}", kube.job_warnings, job.name)
    for pod in evidence.pods:
        if _unstarted(pod) and not pod.events:
            pod.events = _warnings(evidence, f"pod {pod.name}", kube.pod_warnings, pod.name)


def _jobset(kube: Kube, name: str) -> JobSetEvidence:
    js = kube.get_jobset(name)
    return jobset_from_api(js) if js else JobSetEvidence(name=name, found=False)


def _node(kube: Kube, name: str) -> NodeEvidence:
    n = kube.get_node(name)
    return node_from_api(n) if n else NodeEvidence(name=name, found=False)


def _must(what: str, read: Callable[[], T]) -> T:
    """One read the verdict depends on, with its parsing; its failure is ``EvidenceUnreadable``, never absence."""
    try:
        return read()
    except _read_errors() as e:
        raise EvidenceUnreadable(what, e) from e


def _warnings(evidence: Evidence, what: str, read: Callable[[str], list[str]], name: str) -> list[str]:
    """The warning events of one object; a list that cannot be read is noted (they only add detail)."""
    try:
        return read(name)
    except _read_errors() as e:
        from jaxrec.adapters.kube import api_error_line

        evidence.notes.append(f"the events of {what} are unreadable ({api_error_line(e)}); classified without them")
        log.warning("events of %s unreadable: %s", what, e)
        return []


def _unstarted(pod: PodEvidence) -> bool:
    """A pod whose trainer never ran: Pending, waiting, or torn down unstarted; its events may say why."""
    c = pod.trainer()
    never = c is None or (c.started_at is None and c.running_since is None)
    return pod.phase == PodPhase.PENDING or never or c.state == "waiting"


# ---------------------------------------------------------------- run store


def gather_reports(store: RunStore, attempt: int, evidence: Evidence) -> Evidence:
    """Add every worker's exit report of ``attempt`` (unreadable ones are noted, not fatal)."""
    reports, problems = read_worker_reports(store, attempt)
    evidence.reports.extend(reports)
    evidence.reports.sort(key=lambda r: r.process_index)
    evidence.notes.extend(f"unreadable worker report {p}" for p in problems)
    return evidence


def read_agents(store: RunStore, gang_attempt: int, hosts: int) -> list[AgentState]:
    """Every readable agent state of the gang (a read that fails leaves that worker out: it is no evidence)."""
    out = []
    for i in range(hosts):
        try:
            a = store.read_record(RunLayout.agent_state(gang_attempt, i), AgentState)
        except (DocumentError, *store_errors()) as e:
            log.warning("agent state of worker %d unreadable: %s", i, first_line(e))
            continue
        if a is not None:
            out.append(a)
    return out


def exited_agents(store: RunStore, gang_attempt: int, hosts: int, attempt: int) -> list[AgentState]:
    """The agents of gang ``gang_attempt`` (level 0) that saw attempt ``attempt``'s trainer exit."""
    states = read_agents(store, gang_attempt, hosts)
    return [a for a in states if a.state == AgentStateKind.EXITED and a.attempt == attempt]


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
    evidence.from_snapshot = True
    evidence.notes.append(
        f"no pod of the attempt left in the API: pods, Jobs and nodes as train-segment saw them before its stop "
        f"(at {snap.taken_at:.0f})"
    )
    return evidence
