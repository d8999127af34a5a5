"""Per-run metric values the step programs output for Argo: steps lost, recovery time, budget exhausted."""

from __future__ import annotations

from dataclasses import replace

import pytest

from jaxrec.adapters.incidents import AttemptFacts, incidents_from_facts
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import RetryConfig
from jaxrec.model.contract import Decision, FailureClass
from jaxrec.model.records import AttemptRecord, SupervisionRecord, WorkerExitReport
from jaxrec.model.totals import run_totals
from recovery_steps import finalize
from recovery_steps.classify_failure import budget_exhausted
from recovery_steps.retry import RetryDecision, append_attempt

RUN = "totals-run"


def _sup(n, outcome, at, last):
    return SupervisionRecord(attempt=n, jobset=f"js-{n}", outcome=outcome, reason="r", detected_at=at, last_step=last)


def _worker(n, **kw):
    fields = {"run_id": RUN, "attempt": n, "process_index": 0, "process_count": 1, "exit_code": 0, "exit_name": "OK"}
    return WorkerExitReport(**{**fields, **kw})


def fail(n, last, at, restore=-1):
    """Attempt ``n`` failed after step ``last``, seen at ``at``, having restored ``restore``."""
    return AttemptFacts(attempt=n, supervision=_sup(n, "failed", at, last), reports=(_worker(n, restore_step=restore),))


def ok(n, restore, first_at, last, end_at):
    """Attempt ``n`` restored ``restore``, ran its first step at ``first_at`` and the rest steadily to ``last``."""
    rate = (last - max(restore, 0) - 1) / (end_at - first_at)
    report = _worker(n, restore_step=restore, last_step=last, first_step_at=first_at, steps_per_second=rate)
    return AttemptFacts(attempt=n, supervision=_sup(n, "succeeded", end_at, last), reports=(report,))


def recovery_totals(facts):
    return run_totals([t.incident for t in incidents_from_facts(facts)])


# (each attempt's records, steps lost, recovery seconds, incidents): finalize's totals over the incidents the
# report and the drill build.
CASES = {
    "no failure": ([ok(0, -1, 10.0, 20, 30.0)], 0, None, 0),
    # killed at step 8, restored 5: steps 6..20 at 1 step/s from t=110, back at step 8 at t=112.
    "one crash": ([fail(0, 8, 100.0), ok(1, 5, 110.0, 20, 124.0)], 3, 12.0, 1),
    # a fresh restart (-1) restores step 0: every step is lost.
    "crash before the first checkpoint": ([fail(0, 4, 50.0), ok(1, -1, 60.0, 20, 79.0)], 4, 13.0, 1),
    # preemption saved the current step: nothing lost, back when the first step ran.
    "preemption saved its step": ([fail(0, 10, 100.0), ok(1, 10, 107.5, 20, 117.5)], 0, 7.5, 1),
    "two incidents sum, last recovery wins": (
        [fail(0, 8, 100.0), fail(1, 17, 200.0, restore=5), ok(2, 15, 210.0, 20, 214.0)],
        3 + 2,
        11.0,
        2,
    ),
    # attempt 1 failed before reaching step 18: both losses count; the recovery is incident 1's.
    "next attempt never got back": (
        [fail(0, 18, 100.0), fail(1, 12, 150.0, restore=10), ok(2, 10, 160.0, 20, 169.0)],
        8 + 2,
        11.0,
        2,
    ),
    # the final attempt failed (run stopped): no next attempt, not an incident.
    "run ends failed": ([fail(0, 8, 100.0), fail(1, 9, 150.0, restore=5)], 3, None, 1),
    "unordered input": ([ok(1, 5, 110.0, 20, 124.0), fail(0, 8, 100.0)], 3, 12.0, 1),
    "failed attempt without reports": (
        [AttemptFacts(attempt=0, supervision=_sup(0, "failed", 100.0, None)), ok(1, 5, 110.0, 20, 124.0)],
        0,
        None,
        0,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_recovery_totals(name):
    facts, lost, seconds, incidents = CASES[name]
    t = recovery_totals(facts)
    assert t.steps_lost == lost
    assert t.incidents == incidents
    if seconds is None:
        assert t.recovery_seconds is None
    else:
        assert t.recovery_seconds == pytest.approx(seconds)


def test_an_attempt_its_supervisor_could_not_decide_is_failed_by_the_ledger_and_timed_by_its_workers():
    """A supervisor that could not supervise (outcome error) decided nothing: the ledger's ``failed`` makes the attempt
    an incident, timed from the first worker that ended badly."""
    sup = SupervisionRecord(attempt=0, jobset="js-0", outcome="error", exit_code=69, reason="r", detected_at=90.0)
    record = AttemptRecord(attempt=0, outcome="failed", decision=Decision.RETRY, ended_at=101.0, closed_at=102.0)
    worker = _worker(0, exit_code=20, exit_name="PEER_LOST", restore_step=-1, last_step=8, ended_at=100.5)
    failed = AttemptFacts(attempt=0, supervision=sup, record=record, reports=(worker,))
    t = recovery_totals([failed, ok(1, 5, 110.0, 20, 124.0)])
    assert (t.steps_lost, t.incidents) == (3, 1)
    assert t.recovery_seconds == pytest.approx(112.0 - 100.5)
    stopped = replace(failed, record=record.model_copy(update={"outcome": "stopped"}))
    assert recovery_totals([stopped, ok(1, 5, 110.0, 20, 124.0)]).incidents == 0  # stopped: no failure


def _decision(decision, failures):
    return RetryDecision(decision, "why", 0, {}, failures)


@pytest.mark.parametrize(
    ("decision", "failures", "budget", "spent"),
    [
        (Decision.STOP, 2, 1, True),  # budget 1 allows one retry; the second failure spends it
        (Decision.STOP, 1, 0, True),  # no retries allowed
        (Decision.STOP, 2, 3, False),  # stopped by the no-progress guard or the cap, budget left
        (Decision.RETRY, 1, 1, False),
        (Decision.RETRY, 5, 3, False),  # never exhausted while the decision is retry
    ],
)
def test_budget_exhausted(decision, failures, budget, spent):
    retry = RetryConfig(budgets={FailureClass.APPLICATION: budget})
    assert budget_exhausted(_decision(decision, failures), FailureClass.APPLICATION, retry) is spent


def _report(store, attempt, index, code, **kw):
    store.write_json(
        RunLayout.worker_report(attempt, index),
        {
            "run_id": RUN,
            "attempt": attempt,
            "process_index": index,
            "process_count": 2,
            "exit_code": code,
            "exit_name": "X",
            **kw,
        },
    )


def _validated(store_root: str) -> RunStore:
    """The run as validate-config leaves it (finalize records nothing for a run that was never validated)."""
    from support.ckpt_factory import tiny_config, write_run_config

    store = RunStore(store_root, RUN)
    write_run_config(store, tiny_config(run_id=RUN))
    return store


def test_finalize_outputs_totals_from_the_store(store_root, tmp_path):
    store = _validated(store_root)
    append_attempt(
        store,
        AttemptRecord(
            attempt=0,
            outcome="failed",
            failure_class=FailureClass.INFRASTRUCTURE,
            decision=Decision.RETRY,
            checkpoint_step_before=-1,
            checkpoint_step_after=5,
            ended_at=101.0,
            closed_at=102.0,
        ),
    )
    # worker 1 was killed (no report); worker 0 noticed at t=100.5 after step 8.
    _report(store, 0, 0, 20, last_step=8, restore_step=None, ended_at=100.5, first_step_at=20.0)
    for i in (0, 1):
        _report(
            store,
            1,
            i,
            0,
            last_step=20,
            restore_step=5,
            restored_at=108.0 + i,
            first_step_at=110.0 + i,
            ended_at=124.0 + i,
            steps_per_second=1.0,
        )
    r = finalize.run(RunStore(store_root, RUN), "Succeeded", None, tmp_path / "o")
    assert r.totals.steps_lost == 3
    # back at step 8: first step (6) at t=111, 1 step/s, so t=113; failed at t=100.5.
    assert r.totals.recovery_seconds == pytest.approx(12.5)
    assert (tmp_path / "o" / "steps-lost").read_text() == "3"
    assert float((tmp_path / "o" / "recovery-seconds").read_text()) == pytest.approx(12.5)


def test_finalize_without_incidents_outputs_zero_and_minus_one(store_root, tmp_path):
    store = _validated(store_root)
    _report(store, 0, 0, 0, last_step=20, restore_step=-1, first_step_at=10.0, ended_at=20.0)
    finalize.run(RunStore(store_root, RUN), "Succeeded", None, tmp_path / "o")
    assert (tmp_path / "o" / "steps-lost").read_text() == "0"
    assert (tmp_path / "o" / "recovery-seconds").read_text() == "-1"
