"""Retry budgets over sequences of attempts (pure), and the ledger's conditional append (local and emulator)."""

from __future__ import annotations

import threading

import pytest

from jaxrec.adapters.store import PreconditionFailed, RunLayout, RunStore
from jaxrec.model.config import BackoffConfig, RetryConfig
from jaxrec.model.contract import Decision, FailureClass, FinalStatus
from jaxrec.model.records import AttemptRecord, Ledger
from recovery_steps.retry import (
    append_attempt,
    argo_duration,
    backoff_seconds,
    backoff_wait,
    decide,
    stalled_attempts,
    update_ledger,
)

P, A, C, INF, H = (
    FailureClass.PREEMPTION,
    FailureClass.APPLICATION,
    FailureClass.CAPACITY,
    FailureClass.INFRASTRUCTURE,
    FailureClass.HANG,
)


def rec(n: int, cls: FailureClass, before: int = -1, after: int | None = None) -> AttemptRecord:
    """Attempt n failed with cls; by default it advanced the checkpoint by 10 steps."""
    after = before + 10 if after is None else after
    return AttemptRecord(
        attempt=n, outcome="failed", failure_class=cls, checkpoint_step_before=before, checkpoint_step_after=after
    )


def run_sequence(classes_and_progress, cfg: RetryConfig):
    """Feed attempts one by one, as classify-failure would; return each decision."""
    ledger: list[AttemptRecord] = []
    out = []
    step = -1
    for n, (cls, advances) in enumerate(classes_and_progress):
        r = rec(n, cls, step, step + 10 if advances else step)
        d = decide(ledger, r, cfg)
        out.append(d)
        ledger.append(r.model_copy(update={"decision": d.decision}))
        step = r.checkpoint_step_after
        if d.decision is Decision.STOP:
            break
    return out


def test_preemptions_retry_with_exponential_capped_backoff():
    cfg = RetryConfig(backoff={P: BackoffConfig(base_s=10, factor=2, max_s=45)})
    ds = run_sequence([(P, True)] * 5, cfg)
    assert [d.decision for d in ds] == [Decision.RETRY] * 5
    assert [d.backoff_seconds for d in ds] == [10, 20, 40, 45, 45]
    assert ds[-1].attempts_by_class["preemption"] == 5


def test_backoff_counts_per_class_not_per_attempt():
    cfg = RetryConfig(default_backoff=BackoffConfig(base_s=3, factor=3, max_s=1000))
    ds = run_sequence([(P, True), (INF, True), (P, True), (INF, True), (INF, True)], cfg)
    assert [d.backoff_seconds for d in ds] == [3, 3, 9, 9, 27]
    assert backoff_seconds(cfg, INF, 1) == 3 and backoff_seconds(cfg, INF, 0) == 3


def test_application_budget_one_then_stop_with_reason():
    cfg = RetryConfig()
    ds = run_sequence([(P, True), (A, True), (P, True), (A, True), (P, True)], cfg)
    assert [d.decision for d in ds] == [Decision.RETRY, Decision.RETRY, Decision.RETRY, Decision.STOP]
    assert ds[-1].reason.startswith("application budget spent: 2 application failure(s)")
    assert "budget allows 1 retry" in ds[-1].reason
    assert ds[-1].backoff_seconds == 0


def test_configuration_stops_at_once():
    d = decide([], rec(0, FailureClass.CONFIGURATION), RetryConfig())
    assert d.decision is Decision.STOP
    assert "configuration budget spent" in d.reason and "no retries" in d.reason


def test_hang_budget_of_three():
    ds = run_sequence([(H, True)] * 6, RetryConfig())
    assert [d.decision for d in ds] == [Decision.RETRY] * 3 + [Decision.STOP]


def test_no_progress_guard_trips_after_consecutive_stalls():
    cfg = RetryConfig(no_progress_attempts=3)
    ds = run_sequence([(P, True), (INF, False), (P, False), (H, False), (INF, False), (INF, True)], cfg)
    assert [d.decision for d in ds] == [Decision.RETRY] * 4 + [Decision.STOP]
    assert ds[-1].reason.startswith("no progress: 3 consecutive failed attempts")


def test_progress_resets_the_guard():
    cfg = RetryConfig(no_progress_attempts=2)
    ds = run_sequence([(P, False), (P, True), (P, False), (P, True), (P, False)], cfg)
    assert all(d.decision is Decision.RETRY for d in ds)


def test_capacity_waits_do_not_count_as_stalls():
    cfg = RetryConfig(no_progress_attempts=2)
    ds = run_sequence([(C, False)] * 6 + [(INF, False)], cfg)
    assert all(d.decision is Decision.RETRY for d in ds)
    assert stalled_attempts([rec(0, C, -1, -1), rec(1, INF, -1, -1)]) == 1


# (id, attempts oldest first as (class, advanced the checkpoint), consecutive stalls the guard counts)
STALLS = [
    ("preemptions-are-not-counted", [(P, False)] * 5, 0),
    ("capacity-is-not-counted", [(C, False)] * 5, 0),
    ("preemptions-between-stalls-neither-count-nor-break-them", [(INF, False), (P, False), (H, False), (P, False)], 2),
    ("a-preemption-that-saved-on-its-way-out-is-progress", [(INF, False), (H, False), (P, True), (INF, False)], 1),
    ("progress-of-any-class-ends-the-run-of-stalls", [(INF, False), (INF, True), (A, False)], 1),
]


@pytest.mark.parametrize(("case", "attempts", "stalled"), STALLS, ids=[c[0] for c in STALLS])
def test_stalled_attempts(case, attempts, stalled):
    records = [rec(n, cls, 0, 10 if advanced else 0) for n, (cls, advanced) in enumerate(attempts)]
    assert stalled_attempts(records) == stalled


def test_quick_preemptions_on_spot_are_bounded_by_their_budget_not_the_guard():
    # A Spot run preempted faster than it checkpoints: the preemption budget (since progress) decides.
    cfg = RetryConfig(budgets={P: 50})
    ds = run_sequence([(P, False)] * 60, cfg)
    assert [d.decision for d in ds] == [Decision.RETRY] * 50 + [Decision.STOP]
    assert ds[-1].reason.startswith("preemption budget spent: 51 preemption failure(s) since the last progress")
    # One failure of another kind after them is the guard's first stall, not its fourth.
    ds = run_sequence([(P, False)] * 10 + [(INF, False)], cfg)
    assert all(d.decision is Decision.RETRY for d in ds)


def test_max_attempts_caps_the_run():
    cfg = RetryConfig(max_attempts=4)
    ds = run_sequence([(P, True)] * 10, cfg)
    assert [d.decision for d in ds] == [Decision.RETRY] * 3 + [Decision.STOP]
    assert "attempt cap reached: 4 attempts" in ds[-1].reason


def test_deciding_twice_for_the_same_attempt_counts_it_once():
    cfg = RetryConfig()
    first = rec(0, A)
    d1 = decide([], first, cfg)
    d2 = decide([first.model_copy(update={"decision": d1.decision})], first, cfg)
    assert d1.decision is d2.decision is Decision.RETRY
    assert d2.attempts_by_class["application"] == 1


def test_append_is_idempotent_and_ordered(store_root):
    store = RunStore(store_root, "run-ledger")
    append_attempt(store, rec(1, P))
    append_attempt(store, rec(0, INF))
    led = append_attempt(store, rec(1, P))
    assert [a.attempt for a in led.attempts] == [0, 1]
    stored = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert [a.attempt for a in stored.attempts] == [0, 1]
    assert stored.by_class()["preemption"] == 1 and stored.run_id == "run-ledger"


def test_concurrent_appends_lose_nothing(store_root):
    store = RunStore(store_root, "run-race")
    errors = []

    def worker(n):
        try:
            append_attempt(RunStore(store_root, "run-race"), rec(n, P), sleep=lambda s: None, tries=50)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a writer did not finish within 120 s"
    assert errors == []
    stored = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert sorted(a.attempt for a in stored.attempts) == list(range(6))


def test_lost_race_is_retried_with_fresh_contents(store_root):
    store = RunStore(store_root, "run-retry")
    append_attempt(store, rec(0, P))
    calls = []

    def mutate(led: Ledger) -> Ledger:
        calls.append(len(led.attempts))
        if len(calls) == 1:
            # Another writer closes attempt 1 between our read and our write.
            append_attempt(RunStore(store_root, "run-retry"), rec(1, INF))
        return led.model_copy(update={"final_status": FinalStatus.FAILED})

    led = update_ledger(store, mutate, sleep=lambda s: None)
    assert calls == [1, 2]
    assert led.final_status == "Failed" and [a.attempt for a in led.attempts] == [0, 1]


def test_update_gives_up_after_tries(tmp_path):
    store = RunStore(str(tmp_path), "run-busy")

    def always_race(led: Ledger) -> Ledger:
        RunStore(str(tmp_path), "run-busy").write_json(RunLayout.LEDGER, {"run_id": "run-busy", "attempts": []})
        return led.model_copy()  # a ledger to write (the very one read would write nothing)

    with pytest.raises(PreconditionFailed, match="still contended after 3 tries"):
        update_ledger(store, always_race, tries=3, sleep=lambda s: None)


def test_failures_doc_budgets_match_the_defaults():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "FAILURES.md").read_text()
    cfg = RetryConfig()
    for cls in FailureClass:
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{cls.value}` |"))
        assert row.split("|")[4].strip() == str(cfg.budget(cls)), row


def test_300_preemptions_with_progress_keep_the_run_going():
    ds = run_sequence([(P, True)] * 300, RetryConfig())
    assert len(ds) == 300 and all(d.decision is Decision.RETRY for d in ds)
    assert ds[-1].attempts_by_class["preemption"] == 300 and "retry 1 of 20 since progress" in ds[-1].reason


def test_300_preemptions_without_progress_stop_at_the_preemption_budget():
    ds = run_sequence([(P, False)] * 300, RetryConfig())
    assert [d.decision for d in ds] == [Decision.RETRY] * 20 + [Decision.STOP]
    assert ds[-1].reason.startswith("preemption budget spent: 21 preemption failure(s) since the last progress")


def test_since_progress_budget_still_stops_a_stalled_storm_and_run_scope_counts_everything():
    cfg = RetryConfig(no_progress_attempts=1000, budgets={P: 5})
    ds = run_sequence([(P, True)] + [(P, False)] * 10, cfg)
    assert [d.decision for d in ds] == [Decision.RETRY] * 5 + [Decision.STOP]
    assert "6 preemption failure(s) since the last progress, budget allows 5 retries" in ds[-1].reason
    whole = RetryConfig(budgets={P: 5}, budget_scopes={P: "run"})
    ds = run_sequence([(P, True)] * 10, whole)
    assert [d.decision for d in ds] == [Decision.RETRY] * 5 + [Decision.STOP]


def test_default_scopes_and_no_attempt_cap():
    cfg = RetryConfig()
    assert {c for c in FailureClass if cfg.scope(c) == "since_progress"} == {P, C}
    assert cfg.max_attempts is None


@pytest.mark.parametrize(
    ("backoff", "ended", "now", "left"),
    [
        (10, 100.0, 103.5, 6.5),  # detection, teardown and classification took 3.5 s of it
        (10, 100.0, 130.0, 0.0),  # all of it already passed
        (10, None, 130.0, 10.0),  # no end time known: the whole backoff
        (10, 100.0, 99.0, 10.0),  # a clock behind the end never lengthens it
        (0, 100.0, 100.0, 0.0),
    ],
)
def test_the_backoff_counts_from_the_attempts_end(backoff, ended, now, left):
    assert backoff_wait(backoff, ended, now) == pytest.approx(left)


def test_the_wait_is_an_argo_duration_never_shorter_than_asked():
    assert [argo_duration(s) for s in (0.0, 0.4, 6.5, 0.0004, 2)] == ["0ms", "400ms", "6500ms", "1ms", "2000ms"]
