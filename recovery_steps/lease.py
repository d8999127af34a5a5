"""The run lease: at most one live workflow acts for a run id, so at most one gang writes the run's checkpoints.

Who takes, renews, passes and releases it, when another workflow may take it, and what it does not protect:
docs/DEPLOY.md, "One live workflow per run id". Every write carries a generation precondition, so two submissions
cannot both win. ``decide(...)`` is pure; ``acquire``, ``renew_if_due``, ``release`` and the Kubernetes reads are
the I/O.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxrec.adapters.store import (
    Contended,
    DocumentError,
    PreconditionFailed,
    RunLayout,
    RunStore,
    StoreUnavailable,
    first_line,
    store_errors,
)
from jaxrec.model.config import lease_renew_every
from jaxrec.model.contract import WORKFLOW_FINISHED
from jaxrec.model.records import RunLease, now

log = logging.getLogger(__name__)

IsAlive = Callable[[RunLease], bool | None]
"""Whether another holder's workflow still runs: True, False (gone or finished), None (unknown: the TTL decides)."""

# The supervisor renews the lease every ``lease_renew_every(ttl)`` (model.config: six times per TTL, at least every
# 10 minutes), so a lease read by someone else is never older than that while a segment runs; a failed renewal is
# tried again after RENEW_RETRY_S.
RENEW_RETRY_S = 60.0
KUBE_SYSTEM = "kube-system"


class LeaseHeld(Exception):
    """Another live workflow holds the run; ``str()`` is the one line a user reads."""


@dataclass(frozen=True)
class LeaseDecision:
    """May ``holder`` act for the run now, and why (or why not)."""

    ok: bool
    reason: str


@dataclass(frozen=True)
class Site:
    """Where a workflow runs: its namespace and its cluster's id (the kube-system namespace's uid); None: unknown."""

    namespace: str | None = None
    cluster: str | None = None


LOCAL = Site()
"""The local runner: no namespace, no cluster; another holder's liveness is never known and the TTL decides."""


@dataclass(frozen=True)
class Claimant:
    """A workflow that takes or renews the run lease: its uid (the lease's holder), its name, and where it runs."""

    uid: str
    name: str
    site: Site = LOCAL


def _stop_command(lease: RunLease) -> str:
    ns = f"-n {lease.namespace} " if lease.namespace else ""
    return f"argo stop {ns}{lease.holder_name}"


def _where(lease: RunLease) -> str:
    return f", namespace {lease.namespace}" if lease.namespace else ""


def decide(current: RunLease | None, holder: str, at: float, holder_alive: bool | None = None) -> LeaseDecision:
    """Whether ``holder`` may take or renew the lease at time ``at`` (pure).

    Free when there is none, it was released, it is already ``holder``'s, the holding workflow is known to be
    gone (``holder_alive`` False: deleted, or finished without its exit handler), or it expired and the holding
    workflow is not known to be alive. Never free while the holder is known alive, expired or not.
    """
    if current is None:
        return LeaseDecision(True, "no lease yet")
    if current.holder == holder:
        return LeaseDecision(True, "renewed")
    if current.released:
        return LeaseDecision(True, f"released by {current.holder_name}")
    if holder_alive is False:
        return LeaseDecision(True, f"holder workflow {current.holder_name} is gone")
    expires = current.renewed_at + current.ttl_s
    held = f"run {current.run_id!r} is held by workflow {current.holder_name} (uid {current.holder}{_where(current)}"
    if holder_alive is True and at >= expires:
        return LeaseDecision(
            False,
            f"{held}), which is still running although its lease expired {int(at - expires)} s ago: stop that workflow "
            f"({_stop_command(current)}) or wait for it to end; nothing was deleted",
        )
    if at >= expires:
        return LeaseDecision(True, f"expired {int(at - expires)} s ago (was {current.holder_name})")
    return LeaseDecision(
        False,
        f"{held}, renewed {int(at - current.renewed_at)} s ago, expires in {int(expires - at)} s): stop that workflow "
        f"({_stop_command(current)}) or wait for it to end; nothing was deleted",
    )


def acquire(
    store: RunStore,
    claimant: Claimant,
    ttl_s: float,
    *,
    is_alive: IsAlive | None = None,
    clock: Callable[[], float] = now,
    tries: int = 5,
) -> RunLease:
    """Take or renew the lease for ``claimant``; raise ``LeaseHeld`` when another live workflow holds it.

    Where ``claimant`` runs is written into the lease (a renewal keeps what it cannot read now); ``is_alive`` asks
    whether another holder's workflow still runs (None: unknown, the TTL decides); ``tries``: conditional writes.
    """
    holder, site = claimant.uid, claimant.site

    def take(current: RunLease | None) -> RunLease:
        t = clock()
        other = current is not None and current.holder != holder and not current.released
        alive = is_alive(current) if is_alive is not None and other else None
        verdict = decide(current, holder, t, alive)
        if not verdict.ok:
            raise LeaseHeld(verdict.reason)
        mine = current is not None and current.holder == holder and not current.released
        return RunLease(
            run_id=store.run_id,
            holder=holder,
            holder_name=claimant.name,
            ttl_s=ttl_s,
            acquired_at=current.acquired_at if mine else t,
            renewed_at=t,
            namespace=site.namespace or (current.namespace if mine else None),
            cluster=site.cluster or (current.cluster if mine else None),
            first_attempt=current.first_attempt if mine else None,
        )

    try:  # another submission that wrote first: decided on again from what it wrote
        return store.update_record(RunLayout.LEASE, RunLease, take, tries=tries)
    except Contended as e:
        raise LeaseHeld(str(e)) from None


class RenewStatus(enum.StrEnum):
    """What ``renew_if_due`` did."""

    NOT_DUE = "not-due"  # nothing read or written
    RENEWED = "renewed"
    LOST = "lost"  # another workflow holds the run now, or the lease was released or removed
    UNAVAILABLE = "unavailable"  # the store did not answer (or the write stayed contended): tried again later


@dataclass(frozen=True)
class Renewal:
    """The outcome of one ``renew_if_due`` call; pass ``next_at`` to the next call."""

    status: RenewStatus
    next_at: float
    line: str = ""
    lease: RunLease | None = None  # RENEWED: the lease as renewed; LOST: the lease as read (None: there is none)


def renew_if_due(
    store: RunStore, holder: str, ttl_s: float, at: float, *, next_at: float = 0.0, tries: int = 3
) -> Renewal:
    """Renew ``holder``'s lease when ``at`` reached ``next_at``; never raises for the store.

    Meant for a loop that runs every few seconds: before ``next_at`` it returns ``NOT_DUE`` at once, reading
    nothing. A renewal only extends the lease ``holder`` still has; it never takes one.

    ``ttl_s``: the lease's lifetime after this renewal (``retry.lease_ttl_s``); ``at``: epoch seconds now;
    ``next_at``: the previous call's (0: due now).

    Returns:
        The status, when the next call is due (``lease_renew_every(ttl_s)`` after a renewal or a loss,
        ``RENEW_RETRY_S`` after a store failure) and one line to log (empty when not due).
    """
    if at < next_at:
        return Renewal(RenewStatus.NOT_DUE, next_at)
    every = lease_renew_every(ttl_s)
    try:

        def extend(current: RunLease | None) -> RunLease | None:
            if not held_by(current, holder):
                return current  # lost: nothing written
            return current.model_copy(update={"renewed_at": at, "ttl_s": ttl_s})

        renewed = store.update_record(RunLayout.LEASE, RunLease, extend, tries=tries)
        if not held_by(renewed, holder):
            return Renewal(RenewStatus.LOST, at + every, lost_line(store.run_id, renewed), renewed)
        line = f"renewed the lease of run {store.run_id!r} for {ttl_s:.0f} s"
        return Renewal(RenewStatus.RENEWED, at + every, line, renewed)
    except Contended:
        problem = f"still contended after {tries} tries"
    except (DocumentError, StoreUnavailable, *store_errors()) as e:
        problem = f"{type(e).__name__}: {first_line(e)}"
    retry = min(RENEW_RETRY_S, every)
    return Renewal(
        RenewStatus.UNAVAILABLE,
        at + retry,
        f"could not renew the lease of run {store.run_id!r} ({problem}); trying again in {retry:.0f} s",
    )


def holder_elsewhere(current: RunLease | None, namespace: str | None, cluster: str | None) -> bool:
    """Whether another workflow holds the run from another namespace or cluster (pure).

    Positive evidence only: both sides named, and different.

    A supervisor that lost the lease deletes its gang only then: a holder elsewhere cannot see that gang, which
    would go on writing the run's checkpoints beside the holder's. A holder here adopts it or its provision-slice
    decides on it; a lease released, absent or naming no place is no evidence, and the gang is left alone.
    """
    if current is None or current.released:
        return False
    if current.namespace and namespace and current.namespace != namespace:
        return True
    return bool(current.cluster and cluster and current.cluster != cluster)


def lost_line(run_id: str, current: RunLease | None) -> str:
    """One line saying why a holder no longer has the run (pure)."""
    if current is None:
        return f"run {run_id!r} has no lease any more: this workflow no longer holds it"
    if current.released:
        return f"the lease of run {run_id!r} was released by {current.holder_name}: this workflow no longer holds it"
    return (
        f"run {run_id!r} is now held by workflow {current.holder_name} (uid {current.holder}{_where(current)}): "
        "this workflow no longer holds it"
    )


def confirm(store: RunStore, holder: str, first_attempt: int, *, tries: int = 5) -> RunLease:
    """Record in ``holder``'s lease the first attempt it acts for (validate-config, once the config is pinned).

    Until then the holder has only compared: its exit handler records nothing and deletes nothing.

    Raises:
        LeaseHeld: ``holder`` no longer holds the run (released, or another workflow took it).
        StoreUnavailable: the write stayed contended (transient: the step is retried and confirms again).
    """

    def first(current: RunLease | None) -> RunLease:
        if not held_by(current, holder):
            raise LeaseHeld(lost_line(store.run_id, current))
        if current.first_attempt == first_attempt:
            return current
        return current.model_copy(update={"first_attempt": first_attempt})

    try:
        return store.update_record(RunLayout.LEASE, RunLease, first, tries=tries)
    except Contended as e:
        raise StoreUnavailable(str(e)) from None


def release(store: RunStore, holder: str) -> bool:
    """Mark the lease released when ``holder`` has it; True when it did (never touches another's lease)."""
    current, gen = store.read_record_versioned(RunLayout.LEASE, RunLease)
    if current is None or current.holder != holder or current.released:
        return False
    try:
        store.write_record(RunLayout.LEASE, current.model_copy(update={"released": True}), if_generation_match=gen)
    except PreconditionFailed:
        return False
    return True


def held_by(current: RunLease | None, holder: str) -> bool:
    """True when ``current`` names ``holder`` and is not released (pure)."""
    return current is not None and current.holder == holder and not current.released


def ended_here(current: RunLease | None, holder: str) -> bool:
    """True when the Workflow ``holder`` released the lease itself (pure).

    Its exit handler ran, so the Workflow has ended once, and a step of it that runs now is Argo replaying it
    (``argo retry``).
    """
    return current is not None and current.holder == holder and current.released


def resubmit_line(workflow: str | None, namespace: str | None) -> str:
    """How to continue a run once its Workflow has ended: a new Workflow of the same run id."""
    where = f" -n {namespace}" if namespace else ""
    again = f"argo resubmit{where} {workflow}" if workflow else "argo resubmit"
    return f"to go on after a fix: {again} (docs/RUNBOOK.md section 4)"


REPLAYED = "this Workflow had already ended (argo retry replays it; its exit handler released the run): stopped it"


def stop_workflow(api_client: Any, namespace: str, name: str) -> None:
    """Stop the Workflow ``name`` as ``argo stop`` does (its exit handler runs).

    Raises:
        StepError: The API refused (configuration) or could not be reached (transient).
    """
    from jaxrec.adapters.kube import Kube
    from recovery_steps.step import api_error, api_failures

    try:
        Kube(api_client, namespace).stop_workflow(name)
    except api_failures() as e:
        raise api_error(e, doing=f"stop workflow {name} in {namespace}") from None


def refuse_replay(store: RunStore, holder: str, workflow: str, namespace: str, api_client: Callable[[], Any]) -> None:
    """End a step of a Workflow that has already ended once (``ended_here``) before it acts.

    Argo v4.0.5's retry resets a failed node whose descendants did not succeed and the nodes above it
    (``workflow/util/util.go``, ``FormulateRetryWorkflow``) and runs it again in the same Workflow, whose lease its
    own exit handler released. Acting then would take the run back with no confirmed first attempt, so nothing it
    did would be recorded. The Workflow is stopped (its exit handler runs and records nothing) and the line says to
    resubmit.

    Raises:
        StepError: Always when replayed: configuration, with the line a user reads (or the stop's own error).
    """
    from jaxrec.model.contract import ExitCode
    from recovery_steps.step import StepError

    if ended_here(store.read_record(RunLayout.LEASE, RunLease), holder):
        stop_workflow(api_client(), namespace, workflow)
        raise StepError(ExitCode.CONFIGURATION, f"{REPLAYED}; {resubmit_line(workflow, namespace)}")


GIVING_UP = "giving up: "
"""How give-up's line starts; give-up puts the line first in its Workflow's description."""


def description(wf: dict[str, Any] | None) -> str | None:
    """A Workflow's description annotation (shown under its name in the Argo UI's list), or None."""
    from jaxrec.model.names import DESCRIPTION_ANNOTATION

    return (((wf or {}).get("metadata") or {}).get("annotations") or {}).get(DESCRIPTION_ANNOTATION)


def clear_give_up_marks(kube: Any, workflow: str) -> bool:
    """Take a give-up's label and line off the Workflow ``workflow``; True when there were any.

    ``argo resubmit`` copied them from the Workflow that gave up. The caller decides what a refusal means.
    """
    from jaxrec.model.names import DESCRIPTION_ANNOTATION, FAILURE_CLASS_LABEL

    wf = kube.get_workflow(workflow) or {}
    labels = (wf.get("metadata") or {}).get("labels") or {}
    before = description(wf)
    line_first = (before or "").startswith(GIVING_UP)
    if FAILURE_CLASS_LABEL not in labels and not line_first:
        return False
    keep = ([*before.split("\n\n", 1)[1:], None][0] if before else None) if line_first else before
    kube.patch_workflow(
        workflow, {"metadata": {"labels": {FAILURE_CLASS_LABEL: None}, "annotations": {DESCRIPTION_ANNOTATION: keep}}}
    )
    return True


# --- GKE ------------------------------------------------------------------------------------------


def cluster_id(api_client: Any) -> str | None:
    """The cluster's id: the uid of its kube-system namespace (None when it cannot be read).

    kube-system exists in every cluster and keeps its uid for the cluster's life; two clusters never share one.
    Needs ``namespaces get`` (the ClusterRole in ``argo/rbac.yaml``).
    """
    from jaxrec.adapters.kube import Kube

    try:
        ns = Kube(api_client, KUBE_SYSTEM).get_namespace(KUBE_SYSTEM)
    except Exception as e:  # noqa: BLE001 - an unknown cluster: no 404 is trusted, the TTL decides
        log.warning("cannot read namespace %s for the cluster id (%s): the run lease's TTL decides", KUBE_SYSTEM, e)
        return None
    return ((ns or {}).get("metadata") or {}).get("uid") or None


def workflow_alive(api_client: Any, site: Site) -> IsAlive:
    """``is_alive`` on GKE: the holder's Workflow object exists with its uid and has not finished.

    Only a holder of this workflow's own cluster and namespace is read: there a 404 means the Workflow is gone
    (deleted: it never ran its exit handler, so its lease would otherwise block a resubmission until it expired).
    A holder elsewhere, or whose lease names no cluster, and any other API answer are "unknown": the TTL decides.
    """
    from jaxrec.adapters.kube import Kube

    kube = Kube(api_client, site.namespace or "")

    def alive(lease: RunLease) -> bool | None:
        if site.cluster is None or site.namespace is None:
            return None
        if lease.cluster != site.cluster or lease.namespace != site.namespace:
            return None
        try:
            wf = kube.get_workflow(lease.holder_name)
        except Exception:  # noqa: BLE001 - a refusal or an unreachable API: unknown, the TTL decides
            return None
        if wf is None:
            return False  # 404 in the holder's own namespace of this cluster: its Workflow is gone
        if wf.get("metadata", {}).get("uid") != lease.holder:
            return False  # another Workflow of the same name: the holder is gone
        return wf.get("status", {}).get("phase") not in WORKFLOW_FINISHED

    return alive


def on_gke(api_client: Any, namespace: str) -> tuple[Site, IsAlive]:
    """The site of a workflow in ``namespace`` (the cluster id read once, here) and its ``is_alive`` check."""
    site = Site(namespace=namespace, cluster=cluster_id(api_client))
    return site, workflow_alive(api_client, site)
