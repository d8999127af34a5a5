"""Run-level metrics server of the local runner: what Argo template metrics are on GKE.

Values are computed by the pure ``run_samples`` from the ledger and incident records; ``RunMetricsServer`` only
exposes the latest computation (in its own ``CollectorRegistry``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxrec.model import records
from jaxrec.model.config import RetryConfig
from jaxrec.model.contract import FailureClass
from jaxrec.model.metrics import spec
from jaxrec.model.totals import run_totals

RUN_STATUSES = ("Running", "Succeeded", "Failed")
REASON_MAX_CHARS = 200


@dataclass(frozen=True)
class RunSamples:
    """Values of the run-scope metrics at one moment (labels without ``run_id``)."""

    attempts: int
    failures_by_class: dict[str, int]
    last_failure: tuple[str, str] | None
    budget_exhausted: dict[str, int]
    recovery_seconds: float | None
    steps_lost: int
    status: dict[str, int] = field(default_factory=dict)


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= REASON_MAX_CHARS else line[: REASON_MAX_CHARS - 3] + "..."


def run_samples(
    ledger: records.Ledger,
    status: str,
    incidents: Iterable[records.Incident] | None = None,
    retry: RetryConfig | None = None,
) -> RunSamples:
    """The run-scope metric values for a ledger, a run status and the incidents so far.

    Args:
        ledger: The run's attempt ledger (closed attempts).
        status: The run's status: ``Running``, ``Succeeded`` or ``Failed``.
        incidents: Incident records of the run (for recovery time and steps lost).
        retry: The run's retry policy (budgets per class); defaults apply when None.

    Returns:
        The values; ``attempts`` counts the closed attempts plus the one under way while
        ``status`` is ``Running``.
    """
    retry = retry or RetryConfig()
    closed = {a.attempt for a in ledger.attempts}
    attempts = len(closed) + (1 if status == "Running" else 0)
    by_class = ledger.by_class()
    failed = [a for a in ledger.attempts if a.failure_class is not None]
    last = max(failed, key=lambda a: a.attempt) if failed else None
    last_failure = (last.failure_class.value, _one_line(last.reason)) if last and last.failure_class else None
    exhausted = {c.value: int(by_class[c.value] > retry.budget(c)) for c in FailureClass}
    totals = run_totals(list(incidents or []))
    recovery, steps_lost = totals.recovery_seconds, totals.steps_lost
    statuses = {s: int(s == status) for s in (*RUN_STATUSES, status)}
    return RunSamples(attempts, by_class, last_failure, exhausted, recovery, steps_lost, statuses)


def _family(name: str, labels: tuple[str, ...]) -> CounterMetricFamily | GaugeMetricFamily:
    m = spec(name)
    assert m.labels == labels, f"{name}: labels {labels} differ from the metric table {m.labels}"
    if m.kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), m.help, labels=labels)
    return GaugeMetricFamily(name, m.help, labels=labels)


def families(run_id: str, s: RunSamples) -> list[Metric]:
    """The Prometheus metric families of ``s``, named and labelled as the metric table says."""
    attempts = _family("jaxrec_attempts_total", ("run_id",))
    attempts.add_metric([run_id], s.attempts)
    failures = _family("jaxrec_failures_total", ("run_id", "class"))
    for cls, n in s.failures_by_class.items():
        failures.add_metric([run_id, cls], n)
    last = _family("jaxrec_last_failure_info", ("run_id", "class", "reason"))
    if s.last_failure is not None:
        last.add_metric([run_id, *s.last_failure], 1)
    exhausted = _family("jaxrec_budget_exhausted", ("run_id", "class"))
    for cls, v in s.budget_exhausted.items():
        exhausted.add_metric([run_id, cls], v)
    recovery = _family("jaxrec_recovery_duration_seconds", ("run_id",))
    if s.recovery_seconds is not None:
        recovery.add_metric([run_id], s.recovery_seconds)
    lost = _family("jaxrec_steps_lost_total", ("run_id",))
    lost.add_metric([run_id], s.steps_lost)
    status = _family("jaxrec_run_status", ("run_id", "status"))
    for st, v in s.status.items():
        status.add_metric([run_id, st], v)
    return [attempts, failures, last, exhausted, recovery, lost, status]


class _LatestCollector(Collector):
    def __init__(self, run_id: str):
        self.run_id = run_id
        self.samples: RunSamples | None = None
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            samples = self.samples
        if samples is not None:
            yield from families(self.run_id, samples)


class RunMetricsServer:
    """Serves one run's run-scope metrics on ``http://<addr>:<port>/metrics``."""

    def __init__(self, run_id: str, retry: RetryConfig | None = None, addr: str = "127.0.0.1"):
        """Prepare the server (nothing listens until ``start``).

        Args:
            run_id: The run's id (the ``run_id`` label of every sample).
            retry: The run's retry policy, to tell when a class budget is spent.
            addr: Address to listen on.
        """
        self.run_id = run_id
        self.retry = retry
        self.addr = addr
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _LatestCollector(run_id)
        self.registry.register(self._collector)
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self, port: int = 0) -> int:
        """Listen on ``port`` (0: any free port) and return the port actually bound."""
        if self._server is not None:
            raise RuntimeError("metrics server already started")
        self._server, self._thread = start_http_server(port, addr=self.addr, registry=self.registry)
        return int(self._server.server_address[1])

    def update(
        self, ledger: records.Ledger, status: str, incidents: list[records.Incident] | None = None
    ) -> RunSamples:
        """Replace the exposed values with those of ``ledger``, ``status`` and ``incidents``."""
        samples = run_samples(ledger, status, incidents, self.retry)
        with self._collector.lock:
            self._collector.samples = samples
        return samples

    def stop(self) -> None:
        """Stop listening (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> RunMetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
