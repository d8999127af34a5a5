"""The exit handler (finalize) and give-up."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from ckpt_factory import restore_record

from recovery_steps import finalize, give_up
from recovery_steps.kernel.contract import Decision, FailureClass
from recovery_steps.kernel.records import AttemptRecord, Ledger
from recovery_steps.kernel.store import RunLayout, RunStore
from recovery_steps.retry import append_attempt

RUN = "fin-run"


def failed(n, cls, before, after, decision=Decision.RETRY, **extra):
    return AttemptRecord(attempt=n, outcome="failed", failure_class=cls, reason=f"{cls.value} on worker {n}",
                         decision=decision, backoff_seconds=4 * (n + 1), checkpoint_step_before=before,
                         checkpoint_step_after=after, closed_at=1.0, **extra)  # fmt: skip


def test_succeeded_after_recoveries(store_root, tmp_path, capsys):
    store = RunStore(store_root, RUN)
    append_attempt(store, failed(0, FailureClass.PREEMPTION, -1, 20))
    append_attempt(store, failed(1, FailureClass.INFRASTRUCTURE, 20, 40))
    restore_record(store, 2, 40)
    store.write_json(RunLayout.checkpoint_manifest(60), {"step": 60})
    code = finalize.main(["--store-root", store_root, "--run-id", RUN, "--status", "Succeeded",
                          "--failures", "null", "--output-dir", str(tmp_path / "o")])  # fmt: skip
    assert code == 0
    assert (tmp_path / "o" / "final-status").read_text() == "Succeeded"
    led = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert led.final_status == "Succeeded"
    assert led.final_reason.startswith("training completed in attempt 2 after recovering from 2 interruption(s)")
    assert "fail" not in led.final_reason.lower()
    done = led.attempts[-1]
    assert (done.attempt, done.outcome, done.checkpoint_step_before, done.checkpoint_step_after) == (
        2,
        "succeeded",
        40,
        60,
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"run {RUN}: Succeeded: {led.final_reason}"
    table = out.splitlines()[1:]
    assert table[0].split() == ["attempt", "class", "decision", "checkpoint", "backoff"]
    assert table[1].split() == ["0", "preemption", "retry", "-1", "->", "20", "4s"]
    assert table[3].split() == ["2", "succeeded", "-", "40", "->", "60", "-"]


def test_failed_after_budget_spent(tmp_path, capsys):
    root = str(tmp_path / "store")
    store = RunStore(root, RUN)
    append_attempt(store, failed(0, FailureClass.APPLICATION, -1, 10))
    append_attempt(store, failed(1, FailureClass.APPLICATION, 10, 10, Decision.STOP,
                                 decision_reason="application budget spent: 2 application failure(s)"))  # fmt: skip
    argo_failures = json.dumps([{"displayName": "give-up", "message": "Error (exit code 1)", "templateName": "give-up",
                                 "phase": "Failed", "podName": "p", "finishedAt": "2024-05-01T10:00:00Z"}])  # fmt: skip
    r = finalize.run(root, RUN, "Failed", argo_failures, tmp_path / "o")
    assert r.final_status == "Failed"
    assert r.final_reason.startswith("stopped after attempt 1: application budget spent")
    assert "completed" not in r.final_reason
    assert (tmp_path / "o" / "final-status").read_text() == "Failed"
    led = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert led.final_status == "Failed" and len(led.attempts) == 2


def test_failed_before_any_attempt_uses_argo_failures(tmp_path):
    root = str(tmp_path / "store")
    nodes = json.dumps([{"displayName": "validate-config", "message": "Error (exit code 2)", "phase": "Failed"}])
    r = finalize.run(root, RUN, "Error", nodes)
    assert (r.final_status, r.final_reason) == ("Failed", "validate-config failed: Error (exit code 2)")
    r2 = finalize.run(root, RUN, "Failed", "{{workflow.failures}}")
    assert r2.final_reason.startswith("the workflow ended before any attempt was classified")


def test_finalize_twice_is_idempotent(tmp_path):
    root = str(tmp_path / "store")
    store = RunStore(root, RUN)
    restore_record(store, 0, -1)
    finalize.run(root, RUN, "Succeeded")
    finalize.run(root, RUN, "Succeeded")
    led = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert [(a.attempt, a.outcome) for a in led.attempts] == [(0, "succeeded")]
    assert led.final_reason == "training completed in attempt 0"


def test_unreadable_ledger_exits_with_message(tmp_path, capsys):
    root = str(tmp_path / "store")
    RunStore(root, RUN).write_bytes(RunLayout.LEDGER, b"[1, 2")
    assert finalize.main(["--store-root", root, "--run-id", RUN, "--status", "Failed"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("finalize: ") and "unreadable ledger" in err


def test_give_up_fails_on_purpose_with_class_and_reason():
    err = io.StringIO()
    assert give_up.run("application", "application budget spent:\n 2 failures", err) == 1
    assert err.getvalue() == "giving up: class application: application budget spent: 2 failures\n"


def test_give_up_as_a_program():
    p = subprocess.run([sys.executable, "-m", "recovery_steps.give_up", "--failure-class", "hang", "--reason",
                        "hang budget spent"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 1
    assert p.stderr.strip() == "giving up: class hang: hang budget spent"
    assert p.stdout == ""
