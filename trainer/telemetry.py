"""What a worker tells the outside: event lines, Prometheus metrics, and its exit report."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from jaxrec.model.metrics import METRICS
from jaxrec.model.records import EventKind, WorkerEvent, now

log = logging.getLogger(__name__)


class Events:
    """Appends JSON lines to ``<dir>/worker-<i>.jsonl`` (``TRAINER_EVENTS_DIR``); a no-op without a dir."""

    def __init__(self, directory: str | None, attempt: int, process_index: int):
        self.attempt = attempt
        self.process_index = process_index
        self._lock = threading.Lock()
        self._f = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._f = open(Path(directory) / f"worker-{process_index}.jsonl", "a", buffering=1)  # noqa: SIM115

    def emit(self, event: EventKind, step: int | None = None, **fields: Any) -> None:
        """Write one event line (flushed at once: the reader may be timing a kill)."""
        if self._f is None:
            return
        rec = WorkerEvent(
            t=now(), event=event, attempt=self.attempt, process_index=self.process_index, step=step, **fields
        )
        with self._lock:
            self._f.write(rec.model_dump_json(exclude_none=True) + "\n")
            self._f.flush()


class WorkerMetrics:
    """The per-worker gauges of ``jaxrec.model.metrics`` in a dedicated registry, labelled for this worker."""

    def __init__(self, run_id: str, attempt: int, process_index: int):
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()
        labels = {"run_id": run_id, "attempt": str(attempt), "process_index": str(process_index)}
        self._g = {
            s.name: Gauge(s.name, s.help, list(s.labels), registry=self.registry).labels(**labels)
            for s in METRICS
            if s.scope == "worker"
        }

    def set(self, name: str, value: float) -> None:
        """Set gauge ``name`` (a name from the metric table)."""
        self._g[name].set(value)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve /metrics on ``addr:port`` (port 0: do not serve). A busy port is logged, never fatal."""
        if port <= 0:
            return
        from prometheus_client import start_http_server

        try:
            start_http_server(port, addr=addr, registry=self.registry)
            log.info("metrics on %s:%d", addr, port)
        except OSError as e:
            log.warning("metrics server not started on %s:%d: %s", addr, port, e)

    def exposition(self) -> str:
        """The metrics in the text exposition format (what a scrape returns)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class Laps:
    """Seconds spent in each named part of a span, in order: each ``lap`` closes the part since the one before."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._t = now()

    def lap(self, name: str) -> None:
        """The time since the last lap (or the start) was spent in ``name`` (added to it when named again)."""
        t = now()
        self.parts[name] = round(self.parts.get(name, 0.0) + t - self._t, 3)
        self._t = t


def cpu_seconds() -> float:
    """CPU seconds of this process so far, every thread (the ``cpu_s`` of the start-up events)."""
    return round(time.process_time(), 3)
