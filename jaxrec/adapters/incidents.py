"""Incident records of a run on any cluster, built from what the run store keeps of each attempt.

The local runner times its incidents from the workers' event files; a run on GKE keeps no event stream, but
every attempt leaves its supervision record, its provision record, its restore record, the workers' exit
reports and heartbeats. ``read_attempt_facts`` is the adapter; ``incidents_from_facts`` is a pure function
over those records (one incident per failed attempt, timed from that attempt and the next one).

Where the records cannot say when the run was back at its pre-failure step (the restored step is older than
it), the time is estimated from the next attempt's first step and its steps per second, and the incident says
so (``recovered_estimated``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from jaxrec.adapters.documents import read_ledger, read_worker_reports
from jaxrec.adapters.store import DocumentError, RunLayout, RunStore
from jaxrec.model.contract import AttemptOutcome, FailureClass
from jaxrec.model.records import (
    AttemptRecord,
    Incident,
    Ledger,
    ProvisionRecord,
    RestoreRecord,
    SupervisionRecord,
    TierRecord,
    WorkerExitReport,
    WorkerHeartbeat,
)
from jaxrec.model.totals import steps_lost


@dataclass(frozen=True)
class AttemptFacts:
    """What the run store holds about one attempt (each part None or empty when it was never written)."""

    attempt: int
    supervision: SupervisionRecord | None = None
    provision: ProvisionRecord | None = None
    restore: RestoreRecord | None = None
    tiers: TierRecord | None = None  # the gang's choice among local, peer and GCS copies (local tiers on)
    reports: Sequence[WorkerExitReport] = field(default_factory=tuple)
    heartbeats: Sequence[WorkerHeartbeat] = field(default_factory=tuple)
    failure_class: FailureClass | None = None  # classify-failure's verdict, from the ledger
    record: AttemptRecord | None = None  # the ledger's entry of the attempt

    @property
    def failed(self) -> bool:
        """The supervisor's verdict was a failure or a stall, or (no verdict kept) the ledger closed it as failed.

        An attempt with neither (still running, or stopped) is not an incident.
        """
        if self.supervision is not None and self.supervision.decided:
            return self.supervision.outcome in (AttemptOutcome.FAILED, AttemptOutcome.STALLED)
        return self.record is not None and self.record.outcome == AttemptOutcome.FAILED

    @property
    def failed_at(self) -> float | None:
        """When the failure was seen: the supervisor's verdict, else the first worker to end badly, else the ledger."""
        if self.supervision is not None and self.supervision.decided:
            return self.supervision.detected_at
        bad = [r.ended_at for r in self.reports if r.exit_code != 0 and r.ended_at]
        if bad:
            return min(bad)
        return self.record.ended_at if self.record is not None else None

    @property
    def progress(self) -> int | None:
        """The newest step any source says this attempt completed."""
        steps = [r.last_step for r in self.reports] + [h.step for h in self.heartbeats]
        if self.supervision is not None:
            steps.append(self.supervision.last_step)
        known = [s for s in steps if s is not None]
        return max(known) if known else None


@dataclass(frozen=True)
class TimedIncident:
    """An incident and whether its ``recovered_at`` is an estimate."""

    incident: Incident
    recovered_estimated: bool = False


def _latest(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _restored_step(nxt: AttemptFacts) -> int | None:
    if nxt.tiers is not None:  # a local or peer step may be newer than restore-latest's
        return max(0, nxt.tiers.step)
    if nxt.restore is not None:
        return max(0, nxt.restore.restore_step)
    steps = [r.restore_step for r in nxt.reports if r.restore_step is not None]
    return max(0, steps[0]) if steps else None


def _recovery(nxt: AttemptFacts, pre: int | None, restored: int | None) -> tuple[float | None, bool]:
    """When the next attempt was back at ``pre``, and whether that is an estimate."""
    first = _latest([r.first_step_at for r in nxt.reports] + [h.first_step_at for h in nxt.heartbeats])
    if pre is None or restored is None or first is None:
        return None, False
    if restored >= pre:
        return first, False
    if (nxt.progress or 0) < pre:
        return None, False  # the next attempt never got back there
    rates = [r.steps_per_second for r in nxt.reports if r.steps_per_second]
    if not rates:
        return None, False
    # The first step after the restore is restored + 1; the rest run at the measured rate of the slowest worker.
    return first + max(0, pre - restored - 1) / min(rates), True


def incident_from_facts(
    failed: AttemptFacts,
    nxt: AttemptFacts | None,
    *,
    scenario: str | None = None,
    injected_at: float | None = None,
) -> TimedIncident:
    """The incident of one failed attempt, timed from its records and those of the attempt after it."""
    sup = failed.supervision
    pre = failed.progress
    inc = Incident(
        attempt=failed.attempt,
        scenario=scenario,
        failure_class=failed.failure_class,
        injected_at=injected_at,
        detected_at=failed.failed_at,
        stopped_at=sup.stopped_at if sup else None,
        pre_failure_step=pre,
    )
    if nxt is None:
        return TimedIncident(inc)
    if nxt.provision is not None and nxt.provision.exit_code == 0:
        inc.slice_ready_at = nxt.provision.at
    started = [w.started_at for w in nxt.supervision.workers] if nxt.supervision else []
    inc.workers_started_at = _latest([r.started_at for r in nxt.reports] + started)
    inc.restored_at = _latest([r.restored_at for r in nxt.reports])
    inc.first_step_at = _latest([r.first_step_at for r in nxt.reports] + [h.first_step_at for h in nxt.heartbeats])
    inc.compile_seconds = _latest([r.compile_seconds for r in nxt.reports])
    inc.restored_step = _restored_step(nxt)
    inc.restore_tier = nxt.tiers.tier if nxt.tiers is not None else None
    if pre is not None and inc.restored_step is not None:
        inc.steps_lost = steps_lost(pre, inc.restored_step)
    inc.recovered_at, estimated = _recovery(nxt, pre, inc.restored_step)
    return TimedIncident(inc, recovered_estimated=estimated)


def incidents_from_facts(
    facts: Sequence[AttemptFacts], injected: Mapping[int, tuple[str, float]] | None = None
) -> list[TimedIncident]:
    """One incident per failed attempt, oldest first.

    Args:
        facts: Every attempt of the run, in any order.
        injected: For attempts a fault was injected into: the scenario and when.
    """
    ordered = sorted(facts, key=lambda f: f.attempt)
    out = []
    for k, f in enumerate(ordered):
        if not f.failed:
            continue
        scenario, at = (injected or {}).get(f.attempt, (None, None))
        nxt = ordered[k + 1] if k + 1 < len(ordered) else None
        out.append(incident_from_facts(f, nxt, scenario=scenario, injected_at=at))
    return out


def _heartbeats(store: RunStore, attempt: int) -> list[WorkerHeartbeat]:
    out = []
    for name in store.children(RunLayout.attempt(attempt) + "/heartbeats"):
        if not name.endswith(".json"):
            continue
        try:
            hb = store.read_record(f"{RunLayout.attempt(attempt)}/heartbeats/{name}", WorkerHeartbeat)
        except DocumentError:
            continue  # a torn heartbeat: the others and the reports still say how far the attempt got
        if hb is not None:
            out.append(hb)
    return out


def read_attempt_facts(store: RunStore, ledger: Ledger | None = None) -> list[AttemptFacts]:
    """Every attempt's records, as the run store holds them now (``ledger``: the ledger as just written)."""
    ledger = ledger if ledger is not None else read_ledger(store)
    records = {r.attempt: r for r in (ledger.attempts if ledger else [])}
    out = []
    for a in sorted(set(store.attempts()) | set(records)):
        out.append(
            AttemptFacts(
                attempt=a,
                supervision=store.read_record(RunLayout.supervision(a), SupervisionRecord),
                provision=store.read_record(RunLayout.provision_record(a), ProvisionRecord),
                restore=store.read_record(RunLayout.restore_record(a), RestoreRecord),
                tiers=store.read_record(RunLayout.tier_record(a), TierRecord),
                reports=tuple(read_worker_reports(store, a)[0]),
                heartbeats=tuple(_heartbeats(store, a)),
                failure_class=records[a].failure_class if a in records else None,
                record=records.get(a),
            )
        )
    return out
