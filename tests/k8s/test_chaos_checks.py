"""The chaos runs' invariant checks on hand-made runs (no cluster): each check passes a clean run and names what is
wrong with a run that breaks it, so a chaos run that passes has passed checks that can fail."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import chaos
import pytest

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import AttemptRecord, Ledger, SupervisionRecord, WorkerExitReport

NS, RUN, WF = "default", "chaos9-abc123", "local-cpu-x1"
STEPS = f"system:serviceaccount:{NS}:jaxrec-steps"


@dataclass
class _Run:
    store: RunStore
    ns: str = NS
    run_id: str = RUN
    name: str = WF


@dataclass
class _Sampler:
    most: tuple[int, list[str]] = (1, [f"{RUN}-a0"])


def _audit(path: Path, *events: tuple[str, str, str, str]) -> Path:
    """Audit events as the API server writes them (audit.k8s.io/v1 Event, one JSON object per line)."""
    with path.open("w") as f:
        for resource, name, user, at in events:
            f.write(
                json.dumps(
                    {
                        "kind": "Event",
                        "apiVersion": "audit.k8s.io/v1",
                        "level": "Metadata",
                        "stage": "ResponseComplete",
                        "verb": "delete",
                        "user": {"username": user},
                        "objectRef": {"resource": resource, "namespace": NS, "name": name},
                        "responseStatus": {"metadata": {}, "code": 200},
                        "requestReceivedTimestamp": at,
                        "stageTimestamp": at,
                    }
                )
                + "\n"
            )
    return path


def _attempt(store: RunStore, n: int, outcome: str, cls: str | None, decided_at: float, digest: str) -> AttemptRecord:
    sup = "succeeded" if outcome == "succeeded" else "failed"
    store.write_record(
        RunLayout.supervision(n),
        SupervisionRecord(attempt=n, jobset=f"{RUN}-a{n}", outcome=sup, reason="r", detected_at=decided_at),
    )
    for i in range(2):
        rep = WorkerExitReport(
            run_id=RUN,
            attempt=n,
            process_index=i,
            process_count=2,
            exit_code=0,
            exit_name="OK",
            restore_step=10 if n else None,
            params_digest=digest,
        )
        store.write_record(RunLayout.worker_report(n, i), rep)
    return AttemptRecord(attempt=n, outcome=outcome, failure_class=cls, closed_at=decided_at + 1)


def _observed(tmp_path: Path, attempts: list[tuple[str, str | None]], audit: list[Any], **kw: Any) -> chaos.Observed:
    store = RunStore(str(tmp_path / "store"), RUN)
    recs = [_attempt(store, n, o, c, 1796280000.0 + 100 * n, "d1") for n, (o, c) in enumerate(attempts)]
    store.write_record(RunLayout.LEDGER, Ledger(run_id=RUN, attempts=recs, final_status="Succeeded"))
    log = _audit(tmp_path / "audit.jsonl", *audit)
    wf = {"status": {"phase": "Succeeded"}}
    ref, kills, sampler = kw.pop("reference", "d1"), kw.pop("kills", []), kw.pop("sampler", _Sampler())
    return chaos.Observed(_Run(store), wf, ref, kills, sampler, (tmp_path / "pods",), log, **kw)


def test_a_clean_run_passes(tmp_path):
    # The exit handler's delete of the succeeded attempt's JobSet, after the supervisor's verdict.
    o = _observed(tmp_path, [("succeeded", None)], [("jobsets", f"{RUN}-a0", STEPS, "2026-12-03T06:41:00Z")])
    assert chaos.check(o) == []


@pytest.mark.parametrize(
    "attempts, audit, kw, expected",
    [
        # A transient charged as a failure (no real worker failure injected).
        ([("failed", "infrastructure"), ("succeeded", None)], [], {}, "1 failed attempt(s) for 0 real"),
        # A step deleted the gang before any supervisor decided (decided at 06:40:00).
        ([("succeeded", None)], [("jobsets", f"{RUN}-a0", STEPS, "2026-12-03T06:39:00Z")], {}, "before a verdict"),
        # A step deleted a pod.
        ([("succeeded", None)], [("pods", f"{RUN}-a0-w-0", STEPS, "2026-12-03T06:41:00Z")], {}, "deleted pod"),
        # Two gangs live at once.
        ([("succeeded", None)], [], {"sampler": _Sampler((2, ["a0", "a1"]))}, "2 live gangs"),
        # Not the undisturbed run's parameters.
        ([("succeeded", None)], [], {"reference": "d0"}, "differ from the undisturbed"),
        # A kill that lost a committed checkpoint (restored 10, committed 20 before the kill).
        (
            [("failed", "infrastructure"), ("succeeded", None)],
            [],
            {"kills": [{"attempt": 0, "committed": 20, "at": 25}]},
            "older than the checkpoint",
        ),
    ],
)
def test_each_check_names_what_broke_it(tmp_path, attempts, audit, kw, expected):
    found = chaos.check(_observed(tmp_path, attempts, audit, **kw))
    assert len(found) == 1 and expected in found[0], found


def test_a_delete_after_the_operator_stopped_the_run_is_allowed(tmp_path):
    audit = [("jobsets", f"{RUN}-a0", STEPS, "2026-12-03T06:39:00Z")]
    o = _observed(tmp_path, [("succeeded", None)], audit, operator=("stop", 1796280000.0 - 120))
    assert chaos.check(o) == []


def test_a_step_traceback_is_found(tmp_path):
    d = tmp_path / "pods" / f"{NS}_{WF}-classify-failure-1_abcd1234"
    d.mkdir(parents=True)
    (d / "main.log").write_text("Traceback (most recent call last):\n  ...\nKeyError: 'x'\n")
    found = chaos.check(_observed(tmp_path, [("succeeded", None)], []))
    assert len(found) == 1 and "traceback" in found[0] and "classify-failure" in found[0], found


def test_a_schedule_is_its_seed():
    assert chaos.schedule(7, 60) == chaos.schedule(7, 60) != chaos.schedule(8, 60)
    faults, _ = chaos.schedule(7, 60)
    assert all(2 <= f.at <= 60 for f in faults)
    assert [f.at for f in faults] == sorted(f.at for f in faults)
    others = [f for f in faults if f.kind in chaos.KINDS]
    metadata = [f for f in faults if f.kind in chaos.METADATA_KINDS]
    aimed = [f for f in faults if f.kind in chaos.AIMED_KINDS]
    stall = [f for f in faults if f.kind in chaos.STALL_KINDS]
    assert len(others) == 6 and 1 <= len(metadata) <= 2 and len(aimed) == 1 and len(stall) == 1
    assert len(others) + len(metadata) + len(aimed) + len(stall) == len(faults)


@pytest.mark.parametrize(
    ("stream", "kinds"),
    [("_metadata_faults", "METADATA_KINDS"), ("_aimed_faults", "AIMED_KINDS"), ("_stall_faults", "STALL_KINDS")],
)
def test_the_faults_of_a_stream_of_their_own_leave_a_seeds_other_faults_as_they_were(monkeypatch, stream, kinds):
    assert {f.kind for seed in range(1, 40) for f in getattr(chaos, stream)(seed, 60)} == set(getattr(chaos, kinds))
    with_them, kill = chaos.schedule(7, 60)
    monkeypatch.setattr(chaos, stream, lambda seed, window_s: [])
    without, kill_before = chaos.schedule(7, 60)
    assert [f for f in with_them if f.kind not in getattr(chaos, kinds)] == without and kill == kill_before


def test_the_soak_totals_count_runs_faults_violations_and_name_each_failing_seed(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos_soak", Path(__file__).parents[2] / "tools" / "chaos_soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    results = tmp_path / "soak.jsonl"
    rows = [
        {"test": "t", "seed": 101, "outcome": "passed", "seconds": 80.0, "faults": {"gcs-error": 2}, "violations": 0},
        {"test": "t", "seed": 102, "outcome": "failed: boom", "seconds": 200.0, "faults": {"gcs-error": 1,
         "apiserver-restart": 1}, "violations": 2},
    ]  # fmt: skip
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = soak.totals(results)
    assert out.splitlines()[0] == (
        "chaos soak: 2 run(s), 1 passed, 2 invariant violation(s), 4 fault(s) (apiserver-restart 1, gcs-error 3)"
    )
    assert "max 200" in out and "t[seed102]: failed: boom" in out
    assert soak.totals(tmp_path / "none.jsonl").startswith("chaos soak: 0 run(s)")
