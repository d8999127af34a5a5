"""What failures cost a run: steps lost and recovery time, computed in one place.

The exit handler (``finalize``), the local runner's incident records and metrics, and the report all
count with these functions, so a figure in the Argo UI, on the dashboard and in the report is one figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxrec.model.records import EventKind, Incident, WorkerEvent


def steps_lost(pre_failure_step: int, restored_step: int) -> int:
    """Steps computed again after a failure: from the restored step (-1, a fresh start, is step 0) to the last."""
    return max(0, pre_failure_step - max(0, restored_step))


@dataclass(frozen=True)
class RunTotals:
    """The run's recovery figures: what ``jaxrec_steps_lost_total`` and ``jaxrec_recovery_duration_seconds`` say."""

    steps_lost: int
    recovery_seconds: float | None
    incidents: int


def run_totals(incidents: Sequence[Incident]) -> RunTotals:
    """Totals over a run's incidents (pure).

    Args:
        incidents: One per failure; an incident whose steps lost is unknown (no next attempt) is not counted.

    Returns:
        The steps lost summed over the counted incidents, the failure-to-recovered seconds of the newest
        incident that recovered (None when none did), and the number of incidents counted.
    """
    counted = [i for i in incidents if i.steps_lost is not None]
    recovered = [i for i in incidents if i.recovery_seconds is not None]
    newest = max(recovered, key=lambda i: i.attempt) if recovered else None
    return RunTotals(
        steps_lost=sum(i.steps_lost or 0 for i in counted),
        recovery_seconds=newest.recovery_seconds if newest else None,
        incidents=len(counted),
    )


# Where time goes, in the categories ml-goodput-measurement reports badput in (AI-Hypercomputer/
# ml-goodput-measurement, goodput_utils.BadputType): accelerator init and program startup, checkpoint restore,
# training preparation (here: compiling the step), wasted progress from disruption (recomputed steps),
# unproductive checkpoint save, data loading, infrastructure recovery from disruption (waiting for resources).
CATEGORIES = (
    "startup",
    "restore",
    "compilation",
    "recomputed",
    "checkpoint_save",
    "data_loading",
    "waiting_for_resources",
    "other",
)
"""Badput categories, in the order a timeline meets them."""

CATEGORY_HELP = {
    "startup": "process start to the gang's distributed runtime ready (program startup, accelerator init)",
    "restore": "runtime ready to state restored (checkpoint read, or a fresh state built)",
    "compilation": "state restored to the first step done (tracing, compiling, the first step itself)",
    "recomputed": "steps computed again because a failure lost them (wasted progress)",
    "checkpoint_save": "time a save held the training loop",
    "data_loading": "time the loop waited on input (not measured apart: inside step time here)",
    "waiting_for_resources": "last progress of a failed attempt to the next attempt's processes up "
    "(detection, teardown, provisioning, backoff)",
    "other": "the rest (exits, the gap before the first attempt)",
}


@dataclass(frozen=True)
class Goodput:
    """A run's wall time split into productive time and badput categories (seconds, one clock)."""

    wall_seconds: float
    productive_seconds: float
    badput: dict[str, float]
    steps_computed: int
    steps_kept: int

    @property
    def time_goodput(self) -> float:
        """Productive time / wall time."""
        return self.productive_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def step_goodput(self) -> float:
        """Steps kept / steps computed."""
        return self.steps_kept / self.steps_computed if self.steps_computed else 0.0


def _phase_end(events: Sequence[WorkerEvent], kind: EventKind) -> float | None:
    return max((e.t for e in events if e.event == kind), default=None)


def _first(events: Sequence[WorkerEvent], kind: EventKind, default: float) -> float:
    return min((e.t for e in events if e.event == kind), default=default)


def goodput(events: Sequence[WorkerEvent], *, start: float | None = None, end: float | None = None) -> Goodput:
    """Split a run's time into productive time and badput categories (pure).

    Args:
        events: Every worker's ``WorkerEvent`` of the run (``records.parse_event_line``).
        start: When the run started (default: its first event).
        end: When it ended (default: its last event).

    Returns:
        The breakdown. Gang phases end when the last worker reaches them; steps are timed on process 0. A step
        of a failed attempt that the next attempt restores from before is recomputed; the time from the next
        attempt's restore point to the failed attempt's last step is ``recomputed``.
    """
    if not events:
        return Goodput(0.0, 0.0, dict.fromkeys(CATEGORIES, 0.0), 0, 0)
    t0 = min(e.t for e in events) if start is None else start
    t1 = max(e.t for e in events) if end is None else end
    by_attempt: dict[int, list[WorkerEvent]] = {}
    for e in events:
        by_attempt.setdefault(e.attempt, []).append(e)
    attempts = sorted(by_attempt)
    bad = dict.fromkeys(CATEGORIES, 0.0)
    computed = kept = 0
    training = 0.0  # first step done to last step, over every attempt
    for k, a in enumerate(attempts):
        evs = by_attempt[a]
        started = _first(evs, EventKind.STARTED, default=min(e.t for e in evs))
        initialized, restored, first = (
            _phase_end(evs, x) for x in (EventKind.INITIALIZED, EventKind.RESTORED, EventKind.FIRST_STEP)
        )
        marks = [started] + [m for m in (initialized, restored, first) if m is not None]
        for cat, lo, hi in zip(("startup", "restore", "compilation"), marks, marks[1:], strict=False):
            bad[cat] += max(0.0, hi - lo)
        steps = sorted((e.t, e.step or 0) for e in evs if e.event == EventKind.STEP and e.process_index == 0)
        computed += len(steps)
        if first is not None and steps:
            training += max(0.0, steps[-1][0] - first)
        nxt = by_attempt[attempts[k + 1]] if k + 1 < len(attempts) else None
        keep_upto = None
        if nxt is not None:
            rs = [e.step if e.restore_step is None else e.restore_step for e in nxt if e.event == EventKind.RESTORED]
            keep_upto = max(0, max((r for r in rs if r is not None), default=0))
        kept_steps = [(t, s) for t, s in steps if keep_upto is None or s <= keep_upto]
        kept += len(kept_steps)
        if nxt is not None and steps:
            # Progress after the point the next attempt restores from is lost; so is the wait until it starts.
            lost_from = kept_steps[-1][0] if kept_steps else (first or started)
            bad["recomputed"] += max(0.0, steps[-1][0] - lost_from)
            nxt_start = _first(nxt, EventKind.STARTED, default=steps[-1][0])
            bad["waiting_for_resources"] += max(0.0, nxt_start - steps[-1][0])
        elif nxt is not None:
            nxt_start = _first(nxt, EventKind.STARTED, default=max(e.t for e in evs))
            bad["waiting_for_resources"] += max(0.0, nxt_start - max(marks))
        # What saves held the loop between its first and last step (a save's blocking counts the loop's wait for
        # its commit: the end's wait for the last save lies after the last step, outside the training time).
        last = steps[-1][0] if steps else None
        bad["checkpoint_save"] += sum(
            e.blocking_seconds or 0.0
            for e in evs
            if e.event == EventKind.SAVE_COST and e.process_index == 0 and (last is None or e.t <= last)
        )
    productive = max(0.0, training - bad["recomputed"] - bad["checkpoint_save"])
    wall = max(0.0, t1 - t0)
    bad["other"] = max(0.0, wall - productive - sum(v for c, v in bad.items() if c != "other"))
    return Goodput(wall, productive, bad, computed, kept)


def incident_badput(inc: Incident) -> dict[str, float | None]:
    """One incident's lost time by category, from its record's timestamps (None where a timestamp is missing)."""

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else max(0.0, b - a)

    failed = inc.injected_at or inc.detected_at
    return {
        "detection": span(failed, inc.detected_at),
        "waiting_for_resources": span(inc.detected_at, inc.workers_started_at),
        "startup_and_restore": span(inc.workers_started_at, inc.restored_at),
        "compilation": span(inc.restored_at, inc.first_step_at),
        "recomputed": span(inc.first_step_at, inc.recovered_at),
        "total": span(failed, inc.recovered_at),
    }
