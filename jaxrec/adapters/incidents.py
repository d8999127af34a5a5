"""Incident records of a run on any cluster, built in one place from what the run store keeps of each attempt.

``read_attempt_facts`` is the adapter; ``incidents_from_facts`` is a pure function over those facts (one incident per
failed attempt, timed from that attempt and the next one), called by finalize and by the local runner. Where the
facts cannot say when the run was back at its pre-failure step, the time is estimated from the next attempt's first
step and its steps per second, and the incident says so (``recovered_estimated``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from jaxrec.adapters.documents import read_ledger, read_records, read_worker_reports
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import AttemptOutcome, FailureClass
from jaxrec.model.records import (
    AttemptRecord,
    EventKind,
    Incident,
    Ledger,
    ProvisionRecord,
    RestoreRecord,
    SupervisionRecord,
    TierRecord,
    WorkerEvent,
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
    events: Sequence[WorkerEvent] = field(default_factory=tuple)  # the workers' event lines, where the run keeps them

    @property
    def failed(self) -> bool:
        """The supervisor's verdict was a failure or a stall, or (no verdict kept) the ledger closed it as failed.

        An attempt with neither (still running, or stopped) is not an incident.
        """
        if self.supervision is not None and self.supervision.decided:
            return self.supervision.outcome in (AttemptOutcome.FAILED, AttemptOutcome.STALLED)
        return self.record is not None and self.record.outcome == AttemptOutcome.FAILED

    @property
    def left_open(self) -> bool:
        """No supervisor decided the attempt and the ledger never closed it: its Workflow went away under it."""
        return not (self.supervision is not None and self.supervision.decided) and self.record is None

    @property
    def last_seen(self) -> float | None:
        """The attempt's last sign of life: a worker's exit report, heartbeat or event."""
        return _latest(
            [r.ended_at for r in self.reports] + [h.at for h in self.heartbeats] + [e.t for e in self.events]
        )

    @property
    def failed_at(self) -> float | None:
        """When the failure was seen.

        The supervisor's verdict, else the first worker to end badly, else the ledger, else (an attempt left open)
        its last sign of life.
        """
        if self.supervision is not None and self.supervision.decided:
            return self.supervision.detected_at
        bad = [r.ended_at for r in self.reports if r.exit_code != 0 and r.ended_at]
        if bad:
            return min(bad)
        return self.record.ended_at if self.record is not None else self.last_seen

    @property
    def progress(self) -> int | None:
        """The newest step any source says this attempt completed."""
        steps = [r.last_step for r in self.reports] + [h.step for h in self.heartbeats]
        steps += [e.step for e in self.events if e.event == EventKind.STEP]
        if not any(s is not None for s in steps):  # died before its first step: it had the state it restored
            steps = [max(0, r.restore_step) for r in self.reports if r.restore_step is not None]
            steps += [max(0, e.step or 0) for e in self.events if e.event == EventKind.RESTORED]
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
    steps += [e.step or 0 for e in nxt.events if e.event == EventKind.RESTORED]
    return max(0, steps[0]) if steps else None


def _when_every_worker(events: Sequence[WorkerEvent], kind: EventKind) -> float | None:
    """When every worker had emitted ``kind`` once (the latest of each worker's first such event)."""
    first: dict[int, float] = {}
    for e in sorted(events, key=lambda e: e.t):
        if e.event == kind:
            first.setdefault(e.process_index, e.t)
    return max(first.values()) if first else None


def _recovery(
    nxt: AttemptFacts, pre: int | None, restored: int | None, first: float | None
) -> tuple[float | None, bool]:
    """When the next attempt was back at ``pre``, and whether that is an estimate."""
    if pre is None or restored is None or first is None:
        return None, False
    if restored >= pre:
        return first, False
    if (nxt.progress or 0) < pre:
        return None, False  # the next attempt never got back there
    back = [e.t for e in nxt.events if e.event == EventKind.STEP and (e.step or 0) >= pre]
    if back:
        return min(back), False
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
        stopped_at=sup.stopped_at if sup else failed.last_seen,
        pre_failure_step=pre,
    )
    if nxt is None:
        return TimedIncident(inc)
    if nxt.provision is not None and nxt.provision.exit_code == 0:
        inc.slice_ready_at = nxt.provision.at
    # The workers' events where the run keeps them (each phase as every worker reached it), else their records.
    ev = nxt.events
    started = [w.started_at for w in nxt.supervision.workers] if nxt.supervision else []
    inc.workers_started_at = _when_every_worker(ev, EventKind.STARTED) or _latest(
        [r.started_at for r in nxt.reports] + started
    )
    inc.restored_at = _when_every_worker(ev, EventKind.RESTORED) or _latest([r.restored_at for r in nxt.reports])
    inc.first_step_at = _when_every_worker(ev, EventKind.FIRST_STEP) or _latest(
        [r.first_step_at for r in nxt.reports] + [h.first_step_at for h in nxt.heartbeats]
    )
    compiled = [e for e in ev if e.event == EventKind.COMPILED]
    if compiled:  # the slowest worker's compilation, and how much of it ran beside its restore
        slowest = max(compiled, key=lambda e: e.compile_seconds or 0)
        inc.compile_seconds, inc.compile_overlap_seconds = slowest.compile_seconds, slowest.overlap_seconds
    else:
        inc.compile_seconds = _latest([r.compile_seconds for r in nxt.reports])
    inc.restored_step = _restored_step(nxt)
    inc.restore_tier = nxt.tiers.tier if nxt.tiers is not None else None
    if pre is not None and inc.restored_step is not None:
        inc.steps_lost = steps_lost(pre, inc.restored_step)
    inc.recovered_at, estimated = _recovery(nxt, pre, inc.restored_step, inc.first_step_at)
    return TimedIncident(inc, recovered_estimated=estimated)


def incidents_from_facts(
    facts: Sequence[AttemptFacts], injected: Mapping[int, tuple[str, float]] | None = None
) -> list[TimedIncident]:
    """One incident per failed attempt, and per attempt left open that ran and a later one followed, oldest first.

    Args:
        facts: Every attempt of the run, in any order.
        injected: For attempts a fault was injected into: the scenario and when.
    """
    ordered = sorted(facts, key=lambda f: f.attempt)
    out = []
    for k, f in enumerate(ordered):
        nxt = ordered[k + 1] if k + 1 < len(ordered) else None
        # An attempt left open that ran (a sign of life) and that a later one followed: its Workflow went away.
        if not (f.failed or (f.left_open and nxt is not None and f.last_seen is not None)):
            continue
        scenario, at = (injected or {}).get(f.attempt, (None, None))
        out.append(incident_from_facts(f, nxt, scenario=scenario, injected_at=at))
    return out


def read_attempt_facts(
    store: RunStore, ledger: Ledger | None = None, events: Sequence[WorkerEvent] = ()
) -> list[AttemptFacts]:
    """Every attempt's records, as the run store holds them now.

    ``ledger``: the ledger as just written; ``events``: the workers' event lines of the run, where it keeps them.
    """
    ledger = ledger if ledger is not None else read_ledger(store)
    by_attempt: dict[int, list[WorkerEvent]] = {}
    for e in events:
        by_attempt.setdefault(e.attempt, []).append(e)
    records = {r.attempt: r for r in (ledger.attempts if ledger else [])}
    return [
        AttemptFacts(
            attempt=a,
            supervision=store.read_record(RunLayout.supervision(a), SupervisionRecord),
            provision=store.read_record(RunLayout.provision_record(a), ProvisionRecord),
            restore=store.read_record(RunLayout.restore_record(a), RestoreRecord),
            tiers=store.read_record(RunLayout.tier_record(a), TierRecord),
            reports=tuple(read_worker_reports(store, a)[0]),
            # A torn heartbeat is left out: the others and the reports still say how far the attempt got.
            heartbeats=tuple(read_records(store, RunLayout.heartbeats(a), WorkerHeartbeat)[0]),
            failure_class=records[a].failure_class if a in records else None,
            record=records.get(a),
            events=tuple(by_attempt.get(a, ())),
        )
        for a in sorted(set(store.attempts()) | set(records) | set(by_attempt))
    ]
