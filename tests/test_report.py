"""Incident building (one builder, over records and events), the report's table and picture, input errors."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxrec.adapters.incidents import AttemptFacts, incidents_from_facts
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import LocalTierConfig
from jaxrec.model.contract import FailureClass
from jaxrec.model.records import (
    EventKind,
    Incident,
    PreemptionSave,
    ProvisionRecord,
    RestoreRecord,
    SupervisionRecord,
    WorkerEvent,
    WorkerExitReport,
)
from workflows import local, report
from workflows.local import inject
from workflows.local.events import EventTail, read_events
from workflows.local.inject import Injector, parse_injections


def _ev(t, event, attempt, i, step=None, **kw):
    return WorkerEvent(t=t, event=event, attempt=attempt, process_index=i, step=step, **kw)


def _events():
    ev = []
    for i in range(2):
        ev += [_ev(100, "started", 0, i), _ev(105, "restored", 0, i, 0), _ev(110, "first_step", 0, i, 1)]
        ev += [_ev(110 + s, "step", 0, i, s) for s in range(1, 16)]
        ev += [
            _ev(130 + i, "started", 1, i),
            _ev(135 + i, "restored", 1, i, 10, restore_step=10),
            _ev(140 + i, "first_step", 1, i, 11),
        ]
        ev += [_ev(140 + s - 10, "step", 1, i, s) for s in range(11, 21)]
    return ev


def _facts(events, *, supervised=True):
    """Attempt 0 failed (the supervisor decided at 126.0, its gang gone at 126.5); attempt 1's slice was ready at
    128.0; each attempt's workers' ``events``."""
    sup = SupervisionRecord(
        attempt=0, jobset="r-a0", outcome="failed", reason="worker 1 exit 137", detected_at=126.0, stopped_at=126.5
    )
    return [
        AttemptFacts(
            0,
            supervision=sup if supervised else None,
            failure_class=FailureClass.INFRASTRUCTURE,
            events=tuple(e for e in events if e.attempt == 0),
        ),
        AttemptFacts(
            1,
            provision=ProvisionRecord(exit_code=0, message="", at=128.0),
            events=tuple(e for e in events if e.attempt == 1),
        ),
    ]


def test_incident_timings_from_the_records_and_the_workers_events():
    [t] = incidents_from_facts(_facts(_events()), {0: ("kill-worker", 125.8)})
    inc = t.incident
    assert (inc.pre_failure_step, inc.restored_step, inc.steps_lost) == (15, 10, 5)
    assert inc.scenario == "kill-worker" and inc.failure_class == FailureClass.INFRASTRUCTURE
    assert (inc.injected_at, inc.detected_at, inc.stopped_at, inc.slice_ready_at) == (125.8, 126.0, 126.5, 128.0)
    assert (inc.workers_started_at, inc.restored_at, inc.first_step_at) == (131, 136, 141)
    assert inc.recovered_at == 145 and not t.recovered_estimated  # first event at step 15 in attempt 1
    assert inc.recovery_seconds == pytest.approx(145 - 125.8)


def test_an_attempt_left_open_that_a_later_one_followed_is_an_incident_timed_by_its_last_sign_of_life():
    # Its Workflow was deleted: no verdict, no ledger entry; its workers' last event was step 15 at 125.
    [t] = incidents_from_facts(_facts(_events(), supervised=False), {0: ("delete-workflow", 124.0)})
    inc = t.incident
    assert (inc.detected_at, inc.stopped_at, inc.pre_failure_step, inc.steps_lost) == (125, 125, 15, 5)
    assert inc.recovered_at == 145
    # The last attempt left open (still running, nothing after it) is not one.
    assert incidents_from_facts(_facts(_events(), supervised=False)[:1]) == []


def test_no_lost_step_means_recovered_at_first_step():
    ev = [e for e in _events() if not (e.attempt == 0 and (e.step or 0) > 10)]
    [t] = incidents_from_facts(_facts(ev))
    assert t.incident.steps_lost == 0 and t.incident.recovered_at == t.incident.first_step_at


def test_a_failure_before_the_first_step_loses_nothing_beyond_its_start():
    # Attempt 0 restored (fresh: step 0) and died before any step; attempt 1 starts from step 0 again.
    ev = [e for e in _events() if e.attempt == 1 or e.event in (EventKind.STARTED, EventKind.RESTORED)]
    fresh = {"step": 0, "restore_step": -1}
    ev = [e.model_copy(update=fresh) if e.attempt == 1 and e.event == EventKind.RESTORED else e for e in ev]
    [t] = incidents_from_facts(_facts(ev))
    assert (t.incident.pre_failure_step, t.incident.restored_step, t.incident.steps_lost) == (0, 0, 0)
    assert t.incident.recovered_at == t.incident.first_step_at
    # Died before even restoring: what it had is unknown from its events, and nothing is claimed.
    ev = [e for e in ev if e.attempt == 1 or e.event == EventKind.STARTED]
    [t] = incidents_from_facts(_facts(ev))
    assert t.incident.pre_failure_step is None and t.incident.steps_lost is None


def test_event_files_read_as_typed_events_skipping_torn_and_foreign_lines(tmp_path):
    lines = [e.model_dump_json() for e in _events()[:3]]
    foreign = '{"t": 1, "event": "coffee", "attempt": 0, "process_index": 0}'
    (tmp_path / "worker-0.jsonl").write_text("\n".join([lines[0], foreign, lines[1], "not json", lines[2][:20]]))
    tail = EventTail(tmp_path)
    assert [(e.event, e.t) for e in tail.poll()] == [(EventKind.STARTED, 100), (EventKind.RESTORED, 105)]
    with open(tmp_path / "worker-0.jsonl", "a") as f:  # the torn line is completed by the next write
        f.write(lines[2][20:] + "\n")
    assert [e.event for e in tail.poll()] == [EventKind.FIRST_STEP]
    assert read_events(tmp_path) == _events()[:3]


def test_last_failure_without_a_next_attempt_has_no_recovery():
    [t] = incidents_from_facts(_facts(_events())[:1])
    assert t.incident.recovered_at is None and t.incident.restored_step is None


@pytest.mark.parametrize(
    ("specs", "problem"),
    [
        (["explode"], "unknown scenario 'explode'"),
        (["kill-worker@x"], "STEP must be a positive integer"),
    ],
)
def test_bad_injections_name_the_option(specs, problem):
    _, problems = parse_injections(specs, 10)
    assert len(problems) == 1 and problem in problems[0] and specs[0] in problems[0]


def test_each_fault_the_trainer_injects_is_one_of_the_trainers_kinds_and_sets_it_when_its_row_says():
    from trainer.decisions import FAULT_KINDS
    from workflows.faults import FAULTS

    acting = [f for f in FAULTS if f.trigger == "trainer"]
    assert acting and all(f.trainer_fault in FAULT_KINDS for f in acting), acting
    assert all(f.trainer_fault is None for f in FAULTS if f.trigger != "trainer")
    injections, _ = parse_injections(["app-bug@7", "silent-hang@9"], 5)
    injector = Injector(injections, EventTail(Path("/nonexistent")), lambda: None)
    first, second = injector.extra_env(0), injector.extra_env(1)
    assert first == {"TRAINER_FAULT": "app-bug@7,hang@9", "TRAINER_WATCHDOG": "off"}
    assert second == {"TRAINER_FAULT": "app-bug@7"}  # the hang: the first attempt only


def test_default_steps_and_corrupt_latest_brings_a_kill():
    inj, problems = parse_injections(["corrupt-latest", "kill-during-save", "preempt@7"], 10)
    assert not problems
    assert [(i.scenario, i.step) for i in inj] == [("corrupt-latest", 15), ("kill-during-save", 20), ("preempt", 7)]
    # A default step also waits for a committed checkpoint; an explicit @STEP fires at that step.
    assert [i.after_commit for i in inj] == [True, False, False]
    inj, _ = parse_injections(["corrupt-latest"], 10)
    assert [(i.scenario, i.step, i.after_commit) for i in inj] == [
        ("corrupt-latest", 15, True),
        ("kill-worker", 15, True),
    ]


class _Slice(SimpleNamespace):
    """The parts of a local slice the injector reads, and the signals it sends."""

    def __init__(self, hosts: int):
        super().__init__(attempt=0, first_failure_index=None, signals=[])
        self.workers = [SimpleNamespace(index=i, pid=100 + i, started_at=100.0) for i in range(hosts)]

    def signal_worker(self, index, sig):
        self.signals.append((index, sig))

    def kill_trainer(self, index):
        self.signal_worker(index, 9)
        return self.workers[index].pid


def test_a_host_faults_kill_waits_for_the_newest_local_step_on_every_host(tmp_path, monkeypatch):
    """swap-hosts@13 with local saves every 2 steps: the kill waits for step 12's own and peer parts on both hosts;
    one that never lands holds it only LOCAL_WAIT_S, and the run says what was missing."""
    injections, _ = parse_injections(["swap-hosts@13"], 5)
    assert [(i.scenario, i.after_local) for i in injections] == [("swap-hosts", False), ("kill-worker", True)]
    tail = EventTail(tmp_path / "events")
    said: list[str] = []
    injector = Injector(
        injections, tail, lambda: None, say=said.append, local_tier=LocalTierConfig(interval_steps=2, peers=1)
    )
    sl = _Slice(2)
    tail.events += [_ev(110 + s, "step", 0, i, s) for i in range(2) for s in range(1, 14)]
    tail.events += [_ev(123, "local_saved", 0, i, 12, reason="local") for i in range(2)]
    tail.events += [_ev(123, "local_saved", 0, 0, 12, reason="peer")]
    injector.on_tick(sl)
    assert sl.signals == []  # 3 of step 12's 4 parts: worker 0's copy on worker 1's host is still on its way
    monkeypatch.setattr(inject, "LOCAL_WAIT_S", 0.0)
    injector.on_tick(sl)
    assert [i for i, _ in sl.signals] == [1] and any("3 of 4 local and peer parts of step 12" in s for s in said)

    injections, _ = parse_injections(["corrupt-local@13"], 5)
    injector = Injector(injections, tail, lambda: None, say=said.append, local_tier=LocalTierConfig(interval_steps=2))
    tail.events.append(_ev(124, "local_saved", 0, 1, 12, reason="peer"))
    monkeypatch.setattr(inject, "LOCAL_WAIT_S", 1e9)
    sl = _Slice(2)
    injector.on_tick(sl)
    assert [i for i, _ in sl.signals] == [1]  # all four landed: no wait


def test_report_prints_table_and_writes_timeline(store_root, capsys):
    store = RunStore(store_root, "r1")
    store.write_json(RunLayout.CONFIG, {"config": {}, "hash": "x"})
    inc = Incident(
        attempt=0,
        scenario="kill-worker",
        failure_class=FailureClass.INFRASTRUCTURE,
        injected_at=125.8,
        detected_at=126.0,
        stopped_at=126.5,
        recovered_at=145,
        pre_failure_step=15,
        restored_step=10,
        steps_lost=5,
    )
    store.write_json(RunLayout.incident(0), inc.model_dump(mode="json"))
    store.write_bytes("local/events/worker-0.jsonl", "\n".join(e.model_dump_json() for e in _events()).encode() + b"\n")
    for i in range(2):  # attempt 1 was preempted and its save did not fit the window
        rep = WorkerExitReport(
            run_id="r1",
            attempt=1,
            process_index=i,
            process_count=2,
            exit_code=143,
            exit_name="PREEMPTED",
            last_step=17,
            preemption_save=PreemptionSave.SKIPPED,
            preemption_reason="the save does not fit: 21.00 s > 13.50 s left",
            preemption_budget_s=14.0,
            preemption_estimate_s=14.0,
        )
        store.write_record(RunLayout.worker_report(1, i), rep)
    lines: list[str] = []
    paths = report.run(store.url(), say=lines.append)
    text = "\n".join(lines)
    assert (
        "attempt 1: SIGTERM stop after step 17: skipped (budget 14.00 s, save estimate 14.00 s; the save does "
        "not fit: 21.00 s > 13.50 s left)"
    ) in lines
    assert not any(line.startswith("attempt 0: SIGTERM") for line in lines)
    assert "kill-worker" in text and "infrastructure" in text
    row = next(line for line in text.splitlines() if "kill-worker" in line).split()
    assert row[-4:] == ["15", "10", "-", "5"] and "19.2" in row
    assert store.read_bytes(report.TIMELINE)[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths[0] == store.url(report.TIMELINE)


def test_report_of_a_non_run_is_one_line(tmp_path, capsys):
    assert report.main([str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a run" in err


def test_local_bad_input_is_one_line_per_problem(tmp_path, capsys):
    assert local.main([str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the workflow" in capsys.readouterr().err
    assert local.main(["argo/local-cpu.yaml", "--inject", "nope", "--inject", "kill-worker@0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unknown scenario 'nope'" in err[0] and "kill-worker@0" in err[1]
    assert local.main(["argo/local-cpu.yaml", "--node-pools", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --node-pools 0: give 1 to 26 (1: no spare pool)"


def test_local_parameters_are_checked_and_applied(capsys):
    assert local.main(["argo/local-cpu.yaml", "-p", "accept-safe-changes"]) == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err
    assert local.main(["argo/local-cpu.yaml", "-p", "acept-safe-changes=true"]) == 2
    err = capsys.readouterr().err
    assert "acept-safe-changes: the workflow has no such parameter" in err and "accept-safe-changes" in err
    wf, _ = local.load_workflow(Path("argo/local-cpu.yaml"))
    params = local.with_parameters(wf, {"accept-safe-changes": "true"})["spec"]["arguments"]["parameters"]
    assert {"name": "accept-safe-changes", "value": "true"} in params
    assert {"name": "accept-safe-changes", "value": "false"} in wf["spec"]["arguments"]["parameters"]


def test_report_of_a_cluster_run_builds_its_incidents_from_the_attempts_records(store_root):
    # A run on GKE stores no incident records and no events: the supervision, provision and restore records and
    # the heartbeats each attempt left are what the report has.
    store = RunStore(store_root, "r2")
    store.write_json(RunLayout.CONFIG, {"config": {}, "hash": "x"})
    sup = SupervisionRecord(
        attempt=0,
        jobset="r2-a0",
        outcome="failed",
        reason="worker 1 exit 137",
        detected_at=200.0,
        stopped_at=202.5,
        last_step=31,
    )
    store.write_record(RunLayout.supervision(0), sup)
    store.write_record(RunLayout.provision_record(1), ProvisionRecord(exit_code=0, message="ok", at=230.0))
    store.write_record(
        RunLayout.restore_record(1),
        RestoreRecord(
            attempt=1, run_id="r2", config_hash="x", exit_code=0, restore_step=30, restore_path="", decided_at=225.0
        ),
    )
    lines: list[str] = []
    report.run(store.url(), say=lines.append)
    text = "\n".join(lines)
    row = next(line for line in text.splitlines() if line.split()[:1] == ["0"]).split()
    assert row[-4:] == ["31", "30", "-", "1"], text
    assert row[3:6] == ["0.0", "2.5", "30.0"], text  # detected, stopped, next slice ready: from the failure


def test_a_report_without_the_plotting_library_says_so_and_keeps_its_summary(store_root, monkeypatch):
    """The timeline needs matplotlib; without it the report still prints its summary and says what to install."""
    import sys

    store = RunStore(store_root, "r1")
    store.write_json(RunLayout.CONFIG, {"config": {}, "hash": "x"})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    lines: list[str] = []
    assert report.run(store.url(), say=lines.append) == []
    assert lines[-1].startswith("timeline: not drawn (") and lines[-1].endswith("; pip install matplotlib)"), lines
    assert any(line.startswith("run r1: ") for line in lines) and not (Path(store.url()) / "timeline.png").exists()
