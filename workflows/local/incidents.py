"""Incident records of a local run, built from the workers' events and the runner's own timings.

``read_events`` is the adapter (JSON lines files); ``build_incidents`` is a pure function over plain
records: the training segments the runner ran, the ``WorkerEvent``s, the provision-slice end times and the
injections.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxrec.model.contract import FailureClass
from jaxrec.model.records import EventKind, Incident, WorkerEvent, parse_event_line
from jaxrec.model.totals import steps_lost


@dataclass(frozen=True)
class Segment:
    """One train-segment the runner ran: its attempt number and wall-clock window."""

    attempt: int
    started_at: float
    ended_at: float
    failed: bool
    detected_at: float | None = None
    deleted: bool = False


@dataclass(frozen=True)
class Injected:
    """One injected fault: scenario, the attempt it hit, and when."""

    scenario: str
    attempt: int
    at: float


class EventTail:
    """Reads ``worker-<i>.jsonl`` files of a folder incrementally (the trainer appends to them)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self.events: list[WorkerEvent] = []

    def poll(self) -> list[WorkerEvent]:
        """New complete event lines since the last call (also appended to ``events``)."""
        new: list[WorkerEvent] = []
        if not self.directory.is_dir():
            return new
        for f in sorted(self.directory.glob("worker-*.jsonl")):
            off = self._offsets.get(f, 0)
            with open(f, "rb") as fh:
                fh.seek(off)
                data = fh.read()
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self._offsets[f] = off + end + 1
            for line in data[: end + 1].splitlines():
                event = parse_event_line(line)
                if event is not None:
                    new.append(event)
        self.events.extend(new)
        return new


def read_events(directory: Path) -> list[WorkerEvent]:
    """Every event of a run's events folder, sorted by time."""
    tail = EventTail(directory)
    tail.poll()
    return sorted(tail.events, key=lambda e: e.t)


def _window(events: Iterable[WorkerEvent], seg: Segment) -> list[WorkerEvent]:
    return [e for e in events if e.attempt == seg.attempt and seg.started_at - 1 <= e.t <= seg.ended_at + 1]


def _last_of_first(events: Sequence[WorkerEvent], kind: EventKind) -> float | None:
    """When every worker had emitted ``kind`` once (the latest of each worker's first such event)."""
    first: dict[int, float] = {}
    for e in events:
        if e.event == kind:
            first.setdefault(e.process_index, e.t)
    return max(first.values()) if first else None


def max_step(events: Iterable[WorkerEvent]) -> int | None:
    """The highest step any worker completed in ``events``."""
    return max((e.step for e in events if e.event == EventKind.STEP and e.step is not None), default=None)


def _restored_step(events: Iterable[WorkerEvent]) -> int | None:
    """The step the first ``restored`` event names (a fresh start is step 0), or None without one."""
    restored = next((e for e in events if e.event == EventKind.RESTORED), None)
    return None if restored is None else max(0, restored.step or 0)


def build_incidents(
    segments: Sequence[Segment],
    events: Sequence[WorkerEvent],
    provision_done: Sequence[float],
    injections: Sequence[Injected],
    classes: Mapping[int, FailureClass | None] | None = None,
) -> list[Incident]:
    """One incident per failed segment, timed from the events of that segment and of the next one.

    Args:
        segments: The training segments in the order they ran.
        events: Every worker event of the run (any order).
        provision_done: End times of the provision-slice nodes.
        injections: The faults injected (scenario, attempt, time).
        classes: The failure class of each failed attempt, when classify-failure recorded one.

    Returns:
        The incidents, oldest first.
    """
    events = sorted(events, key=lambda e: e.t)
    out = []
    for k, seg in enumerate(segments):
        if not seg.failed:
            continue
        mine = _window(events, seg)
        pre = max_step(mine)
        if pre is None:  # failed before its first step: the progress it had is the step it started from
            pre = _restored_step(mine)
        inj = [i for i in injections if i.attempt == seg.attempt and seg.started_at - 1 <= i.at <= seg.ended_at + 1]
        inc = Incident(
            attempt=seg.attempt,
            scenario="+".join(dict.fromkeys(i.scenario for i in inj)) or None,
            failure_class=(classes or {}).get(seg.attempt),
            injected_at=min((i.at for i in inj), default=None),
            detected_at=seg.detected_at,
            stopped_at=seg.ended_at,
            pre_failure_step=pre,
        )
        if k + 1 < len(segments):
            inc.slice_ready_at = min((t for t in provision_done if t >= seg.ended_at), default=None)
            _time_recovery(inc, _window(events, segments[k + 1]))
        out.append(inc)
    return out


def _time_recovery(inc: Incident, theirs: Sequence[WorkerEvent]) -> None:
    """Fill in how the next attempt (``theirs``: its events) came back from the incident."""
    inc.workers_started_at = _last_of_first(theirs, EventKind.STARTED)
    inc.restored_at = _last_of_first(theirs, EventKind.RESTORED)
    inc.first_step_at = _last_of_first(theirs, EventKind.FIRST_STEP)
    compiled = [e for e in theirs if e.event == EventKind.COMPILED]
    if compiled:  # the slowest worker's compilation, and how much of it ran beside its restore
        slowest = max(compiled, key=lambda e: e.compile_seconds or 0)
        inc.compile_seconds, inc.compile_overlap_seconds = slowest.compile_seconds, slowest.overlap_seconds
    inc.restored_step = _restored_step(theirs)
    inc.restore_tier = next((e.restore_tier for e in theirs if e.event == EventKind.RESTORED and e.restore_tier), None)
    pre = inc.pre_failure_step
    if pre is None or inc.restored_step is None:
        return
    inc.steps_lost = steps_lost(pre, inc.restored_step)
    if inc.restored_step >= pre:
        inc.recovered_at = inc.first_step_at or inc.restored_at
    else:
        back = [e.t for e in theirs if e.event == EventKind.STEP and (e.step or 0) >= pre]
        inc.recovered_at = min(back, default=None)
