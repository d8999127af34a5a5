"""What a local run keeps of its workers and its faults: their event lines and the faults injected.

The event lines are read as the workers write them; the incidents are built from them and the run store's records
by the one builder (``adapters.incidents``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from jaxrec.model.records import EventKind, WorkerEvent, parse_event_line


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
            new += [e for line in data[: end + 1].splitlines() if (e := parse_event_line(line)) is not None]
        self.events.extend(new)
        return new


def read_events(directory: Path) -> list[WorkerEvent]:
    """Every event of a run's events folder, sorted by time."""
    tail = EventTail(directory)
    tail.poll()
    return sorted(tail.events, key=lambda e: e.t)


def max_step(events: Iterable[WorkerEvent]) -> int | None:
    """The highest step any worker completed in ``events``."""
    return max((e.step for e in events if e.event == EventKind.STEP and e.step is not None), default=None)
