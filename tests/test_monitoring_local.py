"""The local run-level metrics server, scraped over HTTP as Prometheus would."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxrec.model import records
from jaxrec.model.config import RetryConfig
from jaxrec.model.contract import Decision, FailureClass
from jaxrec.model.metrics import METRICS
from workflows.local.metrics import RunMetricsServer, run_samples

RUN = "local-cpu"
RUN_METRICS = {m.name for m in METRICS if m.scope == "run"}


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _failed(n: int, cls: FailureClass, reason: str, decision: Decision = Decision.RETRY) -> records.AttemptRecord:
    return records.AttemptRecord(
        attempt=n, outcome="failed", failure_class=cls, reason=reason, decision=decision, closed_at=100.0 + n
    )


def _ledger(*attempts: records.AttemptRecord) -> records.Ledger:
    return records.Ledger(run_id=RUN, attempts=list(attempts))


@pytest.fixture
def server():
    srv = RunMetricsServer(RUN, retry=RetryConfig(budgets={"application": 1, "preemption": 5}))
    yield srv
    srv.stop()


def test_scrape_follows_the_ledger(server):
    port = server.start(0)
    assert port > 0

    # Before the first update: nothing of ours is exported.
    assert not {k for k in _scrape(port) if k[0].startswith("jaxrec_")}

    server.update(_ledger(), "Running", [])
    got = _scrape(port)
    assert got[("jaxrec_attempts_total", (("run_id", RUN),))] == 1
    assert got[("jaxrec_run_status", (("run_id", RUN), ("status", "Running")))] == 1
    assert got[("jaxrec_run_status", (("run_id", RUN), ("status", "Failed")))] == 0
    for cls in FailureClass:
        assert got[("jaxrec_failures_total", (("class", cls.value), ("run_id", RUN)))] == 0
        assert got[("jaxrec_budget_exhausted", (("class", cls.value), ("run_id", RUN)))] == 0
    assert not [k for k in got if k[0] in {"jaxrec_last_failure_info", "jaxrec_recovery_duration_seconds"}]

    incident = records.Incident(
        attempt=0, failure_class=FailureClass.PREEMPTION, injected_at=1000.0, recovered_at=1012.5, steps_lost=0
    )
    ledger = _ledger(_failed(0, FailureClass.PREEMPTION, "node\npreempted by GCE"))
    server.update(ledger, "Running", [incident])
    got = _scrape(port)
    assert got[("jaxrec_attempts_total", (("run_id", RUN),))] == 2
    assert got[("jaxrec_failures_total", (("class", "preemption"), ("run_id", RUN)))] == 1
    info = {k: v for k, v in got.items() if k[0] == "jaxrec_last_failure_info"}
    assert info == {
        (
            "jaxrec_last_failure_info",
            (("class", "preemption"), ("reason", "node preempted by GCE"), ("run_id", RUN)),
        ): 1
    }
    assert got[("jaxrec_recovery_duration_seconds", (("run_id", RUN),))] == pytest.approx(12.5)
    assert got[("jaxrec_steps_lost_total", (("run_id", RUN),))] == 0

    # Two application failures against a budget of one: the run stops Failed, budget spent.
    second = records.Incident(attempt=1, detected_at=2000.0, recovered_at=2030.0, steps_lost=7)
    ledger = _ledger(
        _failed(0, FailureClass.PREEMPTION, "node preempted by GCE"),
        _failed(1, FailureClass.APPLICATION, "non-finite loss at step 40"),
        _failed(2, FailureClass.APPLICATION, "non-finite loss at step 40", Decision.STOP),
    )
    server.update(ledger, "Failed", [incident, second])
    got = _scrape(port)
    assert got[("jaxrec_attempts_total", (("run_id", RUN),))] == 3
    assert got[("jaxrec_failures_total", (("class", "application"), ("run_id", RUN)))] == 2
    assert got[("jaxrec_budget_exhausted", (("class", "application"), ("run_id", RUN)))] == 1
    assert got[("jaxrec_budget_exhausted", (("class", "preemption"), ("run_id", RUN)))] == 0
    assert got[("jaxrec_run_status", (("run_id", RUN), ("status", "Failed")))] == 1
    assert got[("jaxrec_run_status", (("run_id", RUN), ("status", "Running")))] == 0
    assert got[("jaxrec_recovery_duration_seconds", (("run_id", RUN),))] == pytest.approx(30.0)
    assert got[("jaxrec_steps_lost_total", (("run_id", RUN),))] == 7
    info = [k for k in got if k[0] == "jaxrec_last_failure_info"]
    assert info == [
        (
            "jaxrec_last_failure_info",
            (("class", "application"), ("reason", "non-finite loss at step 40"), ("run_id", RUN)),
        )
    ]
    exported = {k[0] for k in got if k[0].startswith("jaxrec_")}
    assert exported == RUN_METRICS


def test_exported_families_match_the_metric_table(server):
    port = server.start(0)
    server.update(
        _ledger(_failed(0, FailureClass.HANG, "watchdog")),
        "Running",
        [records.Incident(attempt=0, detected_at=1.0, recovered_at=2.0, steps_lost=3)],
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    for m in METRICS:
        if m.scope != "run":
            continue
        base = m.name.removesuffix("_total") if m.kind == "counter" else m.name
        assert base in families, m.name
        fam = families[base]
        assert fam.type == m.kind, m.name
        assert fam.documentation == m.help
        for s in fam.samples:
            if not s.name.endswith("_created"):
                assert s.name == m.name
                assert tuple(sorted(s.labels)) == tuple(sorted(m.labels)), m.name


def test_start_returns_the_requested_port_and_stop_frees_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    srv = RunMetricsServer(RUN)
    try:
        assert srv.start(free) == free
        with pytest.raises(RuntimeError):
            srv.start(0)
        srv.update(_ledger(), "Succeeded")
        assert _scrape(free)[("jaxrec_run_status", (("run_id", RUN), ("status", "Succeeded")))] == 1
    finally:
        srv.stop()
    srv.stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{free}/metrics", timeout=2)
    # The port can be bound again.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", free))


@pytest.mark.parametrize(
    ("attempts", "status", "expected"),
    [
        ([], "Running", 1),
        ([], "Succeeded", 0),
        ([0], "Running", 2),
        ([0, 1], "Failed", 2),
        ([0, 1, 2], "Succeeded", 3),
    ],
)
def test_attempt_count(attempts, status, expected):
    ledger = _ledger(*[_failed(n, FailureClass.PREEMPTION, "x") for n in attempts])
    assert run_samples(ledger, status).attempts == expected


def test_budget_is_spent_only_past_the_class_budget():
    retry = RetryConfig(budgets={"hang": 2})
    two = _ledger(*[_failed(n, FailureClass.HANG, "stuck") for n in range(2)])
    three = _ledger(*[_failed(n, FailureClass.HANG, "stuck") for n in range(3)])
    assert run_samples(two, "Running", retry=retry).budget_exhausted["hang"] == 0
    assert run_samples(three, "Failed", retry=retry).budget_exhausted["hang"] == 1
    # A budget of 0 (configuration by default) is spent by the first failure.
    one_cfg = _ledger(_failed(0, FailureClass.CONFIGURATION, "bad topology", Decision.STOP))
    assert run_samples(one_cfg, "Failed").budget_exhausted["configuration"] == 1


def test_long_reasons_are_one_bounded_line():
    ledger = _ledger(_failed(0, FailureClass.UNKNOWN, "line one\n" + "x" * 500))
    cls, reason = run_samples(ledger, "Running").last_failure
    assert cls == "unknown"
    assert "\n" not in reason and len(reason) == 200 and reason.endswith("...")
