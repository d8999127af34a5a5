"""Closing a failed attempt: its evidence gathered, classified once, and its record in the ledger.

classify-failure closes every attempt the full path ends; the segment's supervisor closes one it restarts in place
(level 0). Both gather the same evidence and close through the same ledger update, so an attempt is classified one
way whichever step closes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxrec.adapters.store import AttemptRef, RunLayout, RunStore
from jaxrec.model.config import JobConfig
from jaxrec.model.contract import AttemptOutcome, Backend, Decision, ExitCode
from jaxrec.model.records import AttemptRecord, Ledger, ProvisionRecord, RestoreRecord
from recovery_steps.attempts import checkpoint_step_before, newest_checkpoint_step
from recovery_steps.classify import Verdict
from recovery_steps.evidence import (
    Evidence,
    EvidenceUnreadable,
    exited_agents,
    gather_kubernetes,
    gather_reports,
    gather_snapshot_events,
    gather_supervision,
    use_supervisor_snapshot,
)
from recovery_steps.retry import RetryDecision, backoff_wait, decide, update_ledger, with_attempt
from recovery_steps.step import api_error


@dataclass(frozen=True)
class ClosingAttempt:
    """The attempt classify-failure closes: which one, its JobSet (or local slice) name, and its Workflow.

    ``workflow``: the Workflow running the attempt (None: not known); its attempts are counted for the hand-over.
    """

    ref: AttemptRef
    jobset: str
    workflow: str | None = None


def _timings(ev: Evidence) -> tuple[float | None, float | None]:
    containers = [c for p in ev.pods for c in p.containers]
    starts = [t for t in [*(r.started_at for r in ev.reports), *(c.started_at for c in containers)] if t]
    ends = [t for t in [*(r.ended_at for r in ev.reports), *(c.finished_at for c in containers)] if t]
    return min(starts, default=None), max(ends, default=None)


def gather(
    store: RunStore,
    cfg: JobConfig,
    attempt: int,
    jobset: str,
    *,
    api_client: Any,
    step_exit_code: int | None = None,
    unread_hint: str = "",
    gang_attempt: int | None = None,
) -> Evidence:
    """Every piece of evidence of the attempt: its gang as the Kubernetes API shows it, the worker reports.

    ``gang_attempt`` is the attempt that created the gang (``attempt`` where none was restarted in place): its
    agents' states say which trainers exited in pods that ran on, whatever the API shows once the gang is deleted.

    Raises:
        StepError: The cluster's evidence cannot be read: transient (69, Argo retries the step) when the API is out
            of reach or answers 429/5xx, configuration (2) when it refuses; nothing is decided on a failed read.
    """
    if step_exit_code is None:
        # provision-slice records its last try; a failed one means the attempt ended before training.
        prov = store.read_record(RunLayout.provision_record(attempt), ProvisionRecord)
        if prov is not None and prov.exit_code != 0:
            step_exit_code = prov.exit_code

    ev = Evidence(backend=Backend.of(cfg.slice), attempt=attempt, step_exit_code=step_exit_code)
    gather_reports(store, attempt, ev)
    gather_supervision(store, attempt, ev)
    gang = attempt if gang_attempt is None else gang_attempt
    ev.agents = exited_agents(store, gang, cfg.slice.num_hosts, attempt)
    try:
        gather_kubernetes(api_client, cfg.namespace, jobset, ev)
    except EvidenceUnreadable as e:
        raise api_error(e.error, doing=f"cannot read {e.what}", transient_hint=unread_hint) from None
    gather_snapshot_events(api_client, cfg.namespace, use_supervisor_snapshot(ev))
    return _restore_never_decided(store, ev)


def _restore_never_decided(store: RunStore, ev: Evidence) -> Evidence:
    """An attempt that ended before its gang ran and without a step decided: restore-latest spent its retries.

    restore-latest records every decision, and provision-slice every failure: with neither, no gang, no worker
    report and no supervision record, the run store was out of reach through restore-latest's retries (a
    transient cause, exit 69); nothing trained.
    """
    gang = ev.pods or ev.reports or ev.supervision or (ev.jobset is not None and ev.jobset.found)
    if ev.step_exit_code is not None or gang:
        return ev
    if store.read_record(RunLayout.restore_record(ev.attempt), RestoreRecord) is None:
        ev.step_exit_code = int(ExitCode.TRANSIENT)
        ev.notes.append("restore-latest decided no step and no gang ran: its retries were spent (transient)")
    return ev


def close_attempt(
    store: RunStore,
    cfg: JobConfig,
    closing: ClosingAttempt,
    ev: Evidence,
    verdict: Verdict,
    clock: Callable[[], float],
    resupervised: int = 0,
    level: int | None = None,
) -> tuple[RetryDecision, AttemptRecord, Ledger]:
    """Close the attempt in the ledger with its class and the retry decision; write its own record too.

    ``resupervised``: supervisors re-attached in the attempt's Workflow (the hand-over counts their nesting).
    ``level``: 0 when the segment's supervisor restarts the gang in place (``AttemptRecord.level``).
    """
    attempt = closing.ref.attempt
    started, ended = _timings(ev)
    base = AttemptRecord(
        attempt=attempt,
        outcome=AttemptOutcome.FAILED,
        failure_class=verdict.failure_class,
        reason=verdict.reason,
        evidence=verdict.evidence,
        checkpoint_step_before=checkpoint_step_before(store, attempt),
        checkpoint_step_after=newest_checkpoint_step(store),
        started_at=started,
        ended_at=ended,
        backend=ev.backend,
        jobset=closing.jobset,
        first_worker=verdict.first_worker,
        cause_worker=verdict.cause_worker,
        workflow=closing.workflow,
        level=level,
    )
    holder: dict[str, Any] = {}

    def close(led: Ledger) -> Ledger:
        d = decide(led.attempts, base, cfg.retry, resupervised=resupervised)
        closed = clock()
        wait = backoff_wait(d.backoff_seconds, base.ended_at, closed) if d.decision != Decision.STOP else 0.0
        rec = base.model_copy(
            update={
                "decision": d.decision,
                "backoff_seconds": d.backoff_seconds,
                "backoff_wait_seconds": round(wait, 3),
                "decision_reason": d.reason,
                "closed_at": closed,
            }
        )
        holder["decision"], holder["record"] = d, rec
        return with_attempt(led, rec)

    ledger = update_ledger(store, close)
    store.write_record(RunLayout.attempt_record(attempt), holder["record"])
    return holder["decision"], holder["record"], ledger
