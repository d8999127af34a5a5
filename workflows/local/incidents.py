"""Incident records of a local run, built from the workers' events and the runner's own timings.

``read_events`` is the adapter (JSON lines files); ``build_incidents`` is a pure function over plain
records: the training segments the runner ran, the events, the provision-slice end times and the
injections.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recovery_steps.kernel.contract import FailureClass
from recovery_steps.kernel.records import Incident, parse_event_line
from recovery_steps.kernel.totals import steps_lost


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
        self.events: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        """New complete event lines since the last call (also appended to ``events``)."""
        new: list[dict[str, Any]] = []
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


def read_events(directory: Path) -> list[dict[str, Any]]:
    """Every event of a run's events folder, sorted by time."""
    tail = EventTail(directory)
    tail.poll()
    return sorted(tail.events, key=lambda e: e.get("t", 0))


def _window(events: Iterable[Mapping[str, Any]], seg: Segment) -> list[Mapping[str, Any]]:
    return [e for e in events if e.get("attempt") == seg.attempt and seg.started_at - 1 <= e["t"] <= seg.ended_at + 1]


def _last_of_first(events: Sequence[Mapping[str, Any]], kind: str) -> float | None:
    """When every worker had emitted ``kind`` once (the latest of each worker's first such event)."""
    first: dict[int, float] = {}
    for e in events:
        if e.get("event") == kind:
            first.setdefault(e.get("process_index", 0), e["t"])
    return max(first.values()) if first else None


def max_step(events: Iterable[Mapping[str, Any]]) -> int | None:
    """The highest step any worker completed in ``events``."""
    steps = [e["step"] for e in events if e.get("event") == "step" and e.get("step") is not None]
    return max(steps) if steps else None


def build_incidents(
    segments: Sequence[Segment],
    events: Sequence[Mapping[str, Any]],
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
    events = sorted(events, key=lambda e: e.get("t", 0))
    out = []
    for k, seg in enumerate(segments):
        if not seg.failed:
            continue
        mine = _window(events, seg)
        pre = max_step(mine)
        if pre is None:  # failed before its first step: the progress it had is the step it started from
            start = [e for e in mine if e.get("event") == "restored"]
            pre = max(0, int(start[0].get("step") or 0)) if start else None
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
        nxt = segments[k + 1] if k + 1 < len(segments) else None
        if nxt is not None:
            theirs = _window(events, nxt)
            inc.slice_ready_at = min((t for t in provision_done if t >= seg.ended_at), default=None)
            inc.workers_started_at = _last_of_first(theirs, "started")
            inc.restored_at = _last_of_first(theirs, "restored")
            inc.first_step_at = _last_of_first(theirs, "first_step")
            compiled = [e for e in theirs if e.get("event") == "compiled"]
            if compiled:  # the slowest worker's compilation, and how much of it ran beside its restore
                slowest = max(compiled, key=lambda e: e.get("compile_seconds") or 0)
                inc.compile_seconds = slowest.get("compile_seconds")
                inc.compile_overlap_seconds = slowest.get("overlap_seconds")
            restored = [e for e in theirs if e.get("event") == "restored"]
            if restored:
                inc.restored_step = max(0, int(restored[0].get("step") or 0))
            if pre is not None and inc.restored_step is not None:
                inc.steps_lost = steps_lost(pre, inc.restored_step)
                if inc.restored_step >= pre:
                    inc.recovered_at = inc.first_step_at or inc.restored_at
                else:
                    back = [e["t"] for e in theirs if e.get("event") == "step" and (e.get("step") or 0) >= pre]
                    inc.recovered_at = min(back, default=None)
        out.append(inc)
    return out
