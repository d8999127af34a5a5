"""The run lease: at most one live workflow acts for a run id.

Argo's ``synchronization`` mutex (keyed by run id) makes a second submission wait in the same controller; the
lease in the run store (``RunLease`` at ``RunLayout.LEASE``) also holds across controllers, namespaces and the
local runner. The holder is the workflow's uid. validate-config acquires it, provision-slice renews it before it
deletes anything (a second submission never deletes a live gang), classify-failure renews it, the exit handler
releases it. Every write carries a generation precondition, so two submissions cannot both win.

``decide(...)`` is pure; ``acquire(...)`` and ``release(...)`` are the I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recovery_steps.kernel.records import RunLease, now
from recovery_steps.kernel.store import PreconditionFailed, RunLayout, RunStore


class LeaseHeld(Exception):
    """Another live workflow holds the run; ``str()`` is the one line a user reads."""


@dataclass(frozen=True)
class LeaseDecision:
    """May ``holder`` act for the run now, and why (or why not)."""

    ok: bool
    reason: str


def decide(current: RunLease | None, holder: str, at: float, holder_alive: bool | None = None) -> LeaseDecision:
    """Whether ``holder`` may take or renew the lease at time ``at`` (pure).

    Free when there is none, it was released, it expired, it is already ``holder``'s, or the holding workflow is
    known to be gone (``holder_alive`` False: deleted, or finished without its exit handler).
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
    if at >= expires:
        return LeaseDecision(True, f"expired {int(at - expires)} s ago (was {current.holder_name})")
    return LeaseDecision(
        False,
        f"run {current.run_id!r} is held by workflow {current.holder_name} (uid {current.holder}, renewed "
        f"{int(at - current.renewed_at)} s ago, expires in {int(expires - at)} s): stop that workflow "
        f"(argo stop {current.holder_name}) or wait for it to end; nothing was deleted",
    )


def acquire(
    store: RunStore,
    holder: str,
    holder_name: str,
    ttl_s: float,
    *,
    is_alive: Callable[[RunLease], bool | None] | None = None,
    clock: Callable[[], float] = now,
    tries: int = 5,
) -> RunLease:
    """Take or renew the lease for ``holder``; raise ``LeaseHeld`` when another live workflow holds it.

    Args:
        store: The run store.
        holder: This workflow's uid.
        holder_name: This workflow's name.
        ttl_s: Lease lifetime after this renewal.
        is_alive: Asks whether another holder's workflow still exists (None: unknown, the TTL decides).
        clock: Epoch seconds.
        tries: Conditional-write attempts.
    """
    for _ in range(tries):
        current, gen = store.read_record_versioned(RunLayout.LEASE, RunLease)
        t = clock()
        alive = is_alive(current) if is_alive and current is not None and current.holder != holder else None
        verdict = decide(current, holder, t, alive)
        if not verdict.ok:
            raise LeaseHeld(verdict.reason)
        mine = current is not None and current.holder == holder and not current.released
        lease = RunLease(
            run_id=store.run_id, holder=holder, holder_name=holder_name, ttl_s=ttl_s,
            acquired_at=current.acquired_at if mine else t, renewed_at=t,
        )  # fmt: skip
        try:
            store.write_record(RunLayout.LEASE, lease, if_generation_match=gen)
            return lease
        except PreconditionFailed:
            continue  # another submission wrote first: decide again on what it wrote
    raise LeaseHeld(f"{store.url(RunLayout.LEASE)}: still contended after {tries} tries")


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


def holds(store: RunStore, holder: str) -> bool:
    """True when ``holder`` has the lease now (unreleased), or nobody ever took one."""
    current = store.read_record(RunLayout.LEASE, RunLease)
    return current is None or (current.holder == holder and not current.released)


def workflow_alive(api_client: Any, namespace: str) -> Callable[[RunLease], bool | None]:
    """``is_alive`` on GKE: the holder's Workflow object exists with its uid and has not finished.

    A deleted Workflow never runs its exit handler, so its lease would otherwise block a resubmission until it
    expired. Any other API answer is "unknown" (the TTL decides).
    """
    from kubernetes import client

    custom = client.CustomObjectsApi(api_client)

    def alive(lease: RunLease) -> bool | None:
        try:
            wf = custom.get_namespaced_custom_object("argoproj.io", "v1alpha1", namespace, "workflows",
                                                     lease.holder_name)  # fmt: skip
        except client.ApiException as e:
            return False if e.status == 404 else None
        except Exception:  # noqa: BLE001 - unreachable API: unknown, the TTL decides
            return None
        if wf.get("metadata", {}).get("uid") != lease.holder:
            return False
        return wf.get("status", {}).get("phase") not in ("Succeeded", "Failed", "Error")

    return alive
