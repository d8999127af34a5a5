"""The training loop's pure parts: the save decision, the step records and hook frequencies."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import EventKind, WorkerExitReport, WorkerHeartbeat
from trainer.decisions import SaveReason, TrainerExit, parse_faults, save_decision
from trainer.hooks import (
    SLOWED_PART,
    CheckpointHook,
    FaultHook,
    HeartbeatHook,
    SaveObservers,
    SaveOptions,
    SaveSlowdown,
    check_finite_loss,
)
from trainer.loop import Hooks, StepRecord, training_steps

NONE, INTERVAL, PREEMPTION, FINAL = SaveReason.NONE, SaveReason.INTERVAL, SaveReason.PREEMPTION, SaveReason.FINAL


@pytest.mark.parametrize(
    ("step", "interval", "total", "stop", "last_saved", "want"),
    [
        (3, 5, 20, False, None, NONE),  # between intervals
        (5, 5, 20, False, None, INTERVAL),
        (10, 5, 20, False, 5, INTERVAL),
        (7, 5, 20, True, 5, PREEMPTION),  # a stop saves the step it stopped at
        (10, 5, 20, True, 5, PREEMPTION),  # a stop on an interval step: one save, waited for
        (20, 5, 20, False, 15, FINAL),  # the last step is saved even off the interval
        (23, 10, 23, False, 20, FINAL),
        (20, 5, 20, True, 15, PREEMPTION),  # stop agreed on the last step: exit 143, not 0
        (15, 5, 20, False, 15, NONE),  # the restored step is not saved again
        (15, 5, 20, True, 15, NONE),
        (20, 5, 20, False, 20, NONE),
        (1, 1, 3, False, None, INTERVAL),
    ],
)
def test_save_decision(step, interval, total, stop, last_saved, want):
    got = save_decision(step, interval_steps=interval, total_steps=total, stop_agreed=stop, last_saved=last_saved)
    assert got is want


class FakeStep:
    """A step function over plain numbers: loss = 1 / step; stop agreed after ``stop_at``."""

    def __init__(self, start: int, stop_at: int | None = None):
        self.step = start
        self.stop_at = stop_at
        self.requests: list[bool] = []

    def __call__(self, stop_requested: bool) -> tuple[float, bool]:
        self.requests.append(stop_requested)
        self.step += 1
        return 1.0 / self.step, self.stop_at is not None and self.step >= self.stop_at


def test_training_steps_yields_one_record_per_step_and_marks_first_and_last():
    hooks = Hooks()
    recs = list(training_steps(FakeStep(4), 4, 8, lambda: False, hooks))
    assert [r.step for r in recs] == [5, 6, 7, 8]
    assert [r.first for r in recs] == [True, False, False, False]
    assert [r.last for r in recs] == [False, False, False, True]
    assert [r.loss for r in recs] == [1 / 5, 1 / 6, 1 / 7, 1 / 8]
    assert all(r.seconds >= 0 and not r.stop_agreed for r in recs)


def test_training_steps_ends_after_the_agreed_stop_and_passes_the_request():
    requested = {"now": False}
    fake = FakeStep(0, stop_at=3)
    recs = []
    for rec in training_steps(fake, 0, 10, lambda: requested["now"], Hooks()):
        recs.append(rec)
        requested["now"] = rec.step >= 2
    # Step 4 was dispatched (with the request raised after step 2's hooks) before step 3's agreement was read:
    # it carries the agreement too, and training stops after it.
    assert [(r.step, r.stop_agreed) for r in recs] == [(1, False), (2, False), (3, False), (4, True)]
    assert fake.requests == [False, False, False, True]


@pytest.mark.parametrize("steps_ahead", [1, 3])
def test_a_stop_ends_every_process_at_one_step_whether_or_not_it_held_the_flagged_one(steps_ahead):
    # One process held its steps at step 3 (its save's device copy was not taken as 3 was dispatched), the other
    # had dispatched ahead: both read step 3's reduced flag and must leave after the same step, or the one with a
    # step more in flight waits in its collective alone.
    ends = []
    for held in (set(), {3}):
        hooks = Hooks()
        hooks.hold(lambda step, held=held: step in held)
        fake = FakeStep(0, stop_at=3)
        recs = list(training_steps(fake, 0, 10, lambda: False, hooks, steps_ahead=steps_ahead))
        assert [r.step for r in recs] == list(range(1, 4 + steps_ahead))
        assert [r.step for r in recs if r.stop_agreed] == [recs[-1].step]
        ends.append((recs[-1].step, fake.step))
    assert ends == [(3 + steps_ahead, 3 + steps_ahead)] * 2


def test_a_stop_read_near_the_end_ends_at_the_last_step():
    recs = list(training_steps(FakeStep(0, stop_at=4), 0, 5, lambda: False, Hooks(), steps_ahead=3))
    assert [(r.step, r.stop_agreed, r.last) for r in recs][-2:] == [(4, False, False), (5, True, True)]


class Deferred:
    """A step result read later, as a device array is: reading it is logged."""

    def __init__(self, log: list[str], name: str, value: float):
        self.log, self.name, self.value = log, name, value

    def __float__(self) -> float:
        self.log.append(f"read {self.name}")
        return float(self.value)

    def __int__(self) -> int:
        return int(self.value)


def _logged_steps(log: list[str]):
    """A step function that logs each dispatch and returns results that log when they are read."""
    steps = iter(range(1, 100))

    def run_step(flag: int):
        n = next(steps)
        log.append(f"dispatch {n}")
        return Deferred(log, str(n), 1.0 / n), 0

    return run_step


def test_the_next_step_is_dispatched_before_this_one_is_read_except_where_a_hook_holds_it():
    log: list[str] = []
    run_step = _logged_steps(log)

    hooks = Hooks()
    hooks.hold(lambda step: step == 3)  # a hook reads the state step 3 produced
    for rec in training_steps(run_step, 0, 5, lambda: 0, hooks):
        log.append(f"hooks {rec.step}")
    assert log == [
        "dispatch 1",
        "dispatch 2", "read 1", "hooks 1",
        "dispatch 3", "read 2", "hooks 2",
        "read 3", "hooks 3",  # held: step 4 waits for step 3's hooks
        "dispatch 4",
        "dispatch 5", "read 4", "hooks 4",
        "read 5", "hooks 5",  # the last step: nothing after it
    ]  # fmt: skip


def test_with_steps_ahead_that_many_steps_are_in_flight_and_a_held_step_drains_them():
    log: list[str] = []
    run_step = _logged_steps(log)

    hooks = Hooks()
    hooks.hold(lambda step: step == 4)  # a save reads the state step 4 produced
    recs = []
    for rec in training_steps(run_step, 0, 7, lambda: 0, hooks, steps_ahead=3):
        recs.append(rec.step)
        log.append(f"hooks {rec.step}")
    assert recs == [1, 2, 3, 4, 5, 6, 7]
    assert log == [
        "dispatch 1", "dispatch 2", "dispatch 3",
        "dispatch 4", "read 1", "hooks 1",  # three steps in flight beyond the one read
        "read 2", "hooks 2",  # step 5 waits for step 4's hooks
        "read 3", "hooks 3",
        "read 4", "hooks 4",
        "dispatch 5", "dispatch 6", "dispatch 7",
        "read 5", "hooks 5", "read 6", "hooks 6", "read 7", "hooks 7",  # the last step: nothing after it
    ]  # fmt: skip
    with pytest.raises(ValueError, match="steps_ahead"):
        list(training_steps(run_step, 0, 7, lambda: 0, hooks, steps_ahead=0))


def test_an_async_save_copies_the_state_as_its_step_is_dispatched_and_holds_no_step_back(tmp_path):
    """Step 20's save takes its copy right after step 20 is dispatched, before step 21 donates the state: steps 21
    and on are in flight while step 20's hooks start the save, which writes that copy. A save due while another copy
    waits for its hooks (one copy at a time) holds the loop at its step and copies the live state there."""
    _store, hook, _watchdog, _during = _save_hooks(tmp_path, done=True)
    log: list[str] = []
    run_step = _logged_steps(log)
    stepper = hook.stepper

    def step(flag):
        out = run_step(flag)
        stepper.state = f"state {len(log)}"
        return out

    def capture(s: int) -> None:
        hook.capture(s)
        if hook.captured is not None and hook.captured.step == s:
            log.append(f"capture {s}")

    hooks = Hooks()
    hooks.after_dispatch(capture)
    hooks.hold(hook.holds)
    hooks.add(hook.on_step)
    for rec in training_steps(step, 18, 24, lambda: 0, hooks, steps_ahead=3):
        log.append(f"hooks {rec.step}")
        hooks.run(rec)
    assert hook.ckpt.captures == [20] and hook.ckpt.saved == [20] and hook.ckpt.used == [20], hook.ckpt.__dict__
    assert log.index("capture 20") == log.index("dispatch 2") + 1  # step 20 is the second dispatched (from 18)
    assert log.index("dispatch 4") < log.index("hooks 20")  # steps 21 and 22 in flight before step 20's save
    assert hook.captured is None

    # interval 1: step 2's copy waits for step 1's hooks, so step 2 reads the live state and holds the loop
    hook.interval_steps, hook.ckpt.captures, hook.ckpt.saved, hook.ckpt.used = 1, [], [], []
    hook.last_saved = 0
    for rec in training_steps(step, 0, 3, lambda: 0, hooks, steps_ahead=2):
        hooks.run(rec)
    assert hook.ckpt.saved == [1, 2, 3], hook.ckpt.saved
    assert hook.ckpt.used[0] == 1 and None in hook.ckpt.used, hook.ckpt.used
    assert hook.captured is None


def test_a_copy_not_saved_after_all_is_dropped(tmp_path):
    _store, hook, _watchdog, _during = _save_hooks(tmp_path, done=True)
    hook.capture(30)
    assert hook.captured.step == 30 and not hook.holds(30) and hook.holds(40)
    hook.last_saved = 30  # saved meanwhile (a stop's save): step 30 is no longer due
    hook.on_step(StepRecord(30, 0.5))
    assert hook.captured is None and hook.ckpt.saved == []
    sync = _save_hooks(tmp_path / "sync", done=True)[1]
    sync.async_save = False
    sync.capture(30)
    assert sync.captured is None and sync.holds(30)  # a synchronous save reads the live state: the loop holds
    tight = _save_hooks(tmp_path / "tight", done=True)[1]
    tight.ckpt.fits = False
    tight.capture(30)
    assert tight.captured is None and tight.holds(30)  # no device copy fits: the save reads the live state too
    busy = _save_hooks(tmp_path / "busy", done=False)[1]
    busy.ckpt.pending.writing.clear()  # orbax's save() of step 10 has not returned
    busy.capture(30)
    assert busy.captured is None and busy.holds(30)  # step 10's save still holds its copy: one copy at a time


def test_a_stop_read_with_steps_in_flight_ends_after_the_last_of_them():
    requested = {"now": False}
    fake = FakeStep(0, stop_at=3)
    recs = []
    for rec in training_steps(fake, 0, 20, lambda: requested["now"], Hooks(), steps_ahead=4):
        recs.append(rec)
        requested["now"] = rec.step >= 2
    # Steps 4 to 7 were in flight when step 3's agreement was read: they carry it, and training stops after 7.
    assert [(r.step, r.stop_agreed) for r in recs] == [(s, s == 7) for s in range(1, 8)]
    assert fake.step == 7  # nothing dispatched after the stop was read


def test_a_fault_before_a_step_comes_after_the_hooks_of_the_step_before():
    fault = FaultHook(parse_faults("app-bug@3"))
    hooks = Hooks()
    hooks.before_step(fault.before_step)
    hooks.hold(fault.acts_before_next)
    seen = []
    with pytest.raises(RuntimeError, match="injected application bug in step 3"):
        for rec in training_steps(FakeStep(0), 0, 10, lambda: False, hooks):
            seen.append(rec.step)
    assert seen == [1, 2]


def test_nothing_runs_when_the_restored_step_is_the_last():
    assert list(training_steps(FakeStep(20), 20, 20, lambda: False, Hooks())) == []


def test_hooks_run_at_their_frequency_and_at_the_end():
    hooks = Hooks()
    seen: dict[str, list[int]] = {"every1": [], "every3": [], "before": []}
    hooks.before_step(seen["before"].append)
    hooks.add(lambda r: seen["every1"].append(r.step))
    hooks.add(lambda r: seen["every3"].append(r.step), every=3)
    for rec in training_steps(FakeStep(0), 0, 7, lambda: False, hooks):
        hooks.run(rec)
    assert seen == {"every1": [1, 2, 3, 4, 5, 6, 7], "every3": [3, 6, 7], "before": [1, 2, 3, 4, 5, 6, 7]}
    hooks.run(StepRecord(step=4, stop_agreed=True))  # a stop reaches every hook
    assert seen["every3"][-1] == 4
    with pytest.raises(ValueError, match="every"):
        hooks.add(print, every=0)


def test_fault_and_loss_guard_hooks():
    with pytest.raises(TrainerExit, match="non-finite loss nan at step 4") as e:
        check_finite_loss(StepRecord(step=4, loss=float("nan")))
    assert e.value.code == ExitCode.APPLICATION
    check_finite_loss(StepRecord(step=4, loss=0.5))

    fault = FaultHook(parse_faults("nan@3,app-bug@5"))
    fault.on_step(StepRecord(step=2, loss=0.5))
    with pytest.raises(TrainerExit, match="non-finite loss"):
        fault.on_step(StepRecord(step=3, loss=0.5))
    fault.before_step(4)
    with pytest.raises(RuntimeError, match="injected application bug in step 5"):
        fault.before_step(5)


class SlowCheckpointer:
    """A checkpointer whose save of step 10 is in flight; ``finish_pending`` records what the others saw meanwhile."""

    def __init__(self, seen):
        self.seen = seen
        self.last_committed = None
        self.last_duration = self.last_blocking = self.last_commit_time = None
        self.last_held = 0.0
        self.last_parts = {}
        self.last_incomplete = None
        self.pending = self._pending(10)
        self.saved = []
        self.captures: list[int] = []  # steps whose state was copied as they were dispatched
        self.fits = True  # a copy of the state fits on the device beside the step
        self.used: list[int | None] = []  # per save, the step of the copy it wrote (None: taken in save)

    def poll(self):
        return self._record() if self.pending is not None and self.pending.done.done() else None

    def finish_pending(self):
        if self.pending is None:
            return None
        self.seen()
        return self._record()

    def _record(self):
        self.pending, self.last_committed = None, 10
        return 10

    def copy_fits(self, state, compiled=None):
        return self.fits

    def copy_released(self):
        return self.pending is None or self.pending.writing.is_set()

    def capture(self, step, state, data_iter):
        self.captures.append(step)
        return SimpleNamespace(step=step, state=state, data=data_iter, seconds=0.0)

    def save(self, step, state, data_iter, capture=None):
        self.saved.append(step)
        self.used.append(None if capture is None else capture.step)
        self.pending = self._pending(step)

    @staticmethod
    def _pending(step):
        """A save handed over, its writes in flight: orbax's save() returned (the device copy released)."""
        writing = threading.Event()
        writing.set()
        return SimpleNamespace(step=step, done=concurrent.futures.Future(), writing=writing)


def _save_hooks(tmp_path, *, done: bool, wait_s: float = 0.0):
    store = RunStore(str(tmp_path), "run")
    watchdog = SimpleNamespace(saving=False, touch=lambda: None)
    during = {}

    def seen():
        during["watchdog_saving"] = watchdog.saving
        deadline = time.monotonic() + (5 if wait_s else 0)
        while True:  # the announce comes from the heartbeat's timer once the wait lasted an interval
            during["beat"] = store.read_record(RunLayout.heartbeat(0, 1), WorkerHeartbeat)
            if during["beat"].saving is not None or time.monotonic() > deadline:
                break
            time.sleep(0.01)

    ckpt = SlowCheckpointer(seen)
    if done:
        ckpt.pending.done.set_result(None)
    report = WorkerExitReport(run_id="run", attempt=0, process_index=1, process_count=2, exit_code=0, exit_name="OK")
    beat = HeartbeatHook(store, 0, 1, 0.05 if wait_s else 30.0, ckpt, report)
    metrics = SimpleNamespace(set=lambda *a: None)
    events = SimpleNamespace(emit=lambda *a, **k: None)
    stepper = SimpleNamespace(state=None, data_iter=None, compiled=None)
    hook = CheckpointHook(
        ckpt,
        stepper,
        SaveOptions(interval_steps=10, total_steps=100, async_save=True, restore_step=-1),
        SaveObservers(events=events, metrics=metrics, report=report, watchdog=watchdog, heartbeat=beat),
    )
    beat.on_step(StepRecord(19, 0.5, first=True))
    return store, hook, watchdog, during


def test_a_wait_for_a_save_in_flight_is_in_the_heartbeat_and_ends_with_it(tmp_path):
    """The loop blocks at step 20 on step 10's commit: the heartbeat says so while it waits (the supervisor then
    applies the save timeout) and the watchdog does too; once committed, a heartbeat without the wait follows."""
    store, hook, watchdog, during = _save_hooks(tmp_path, done=False, wait_s=1.0)
    hook.heartbeat.on_step(StepRecord(20, 0.5, finished_at=time.time()))
    hook.on_step(StepRecord(20, 0.5))
    assert during["beat"].saving == 10 and during["beat"].step == 20, during
    assert during["beat"].phase == "save", during
    assert during["watchdog_saving"] is True
    after = store.read_record(RunLayout.heartbeat(0, 1), WorkerHeartbeat)
    assert after.saving is None and after.checkpoint_step == 10 and after.phase == "step", after
    assert watchdog.saving is False
    assert hook.ckpt.saved == [20]


def test_the_heartbeat_says_how_long_the_latest_steps_took_at_most_leaving_out_the_first(tmp_path):
    """``step_seconds``: the longest gap between two of the latest step ends (a save pause between them counts),
    never the first step's compilation; the oldest gaps leave the window."""
    from trainer.hooks import RECENT_STEPS

    store = RunStore(str(tmp_path / "store"), "run")
    report = WorkerExitReport(run_id="run", attempt=0, process_index=1, process_count=2, exit_code=0, exit_name="OK")
    beat = HeartbeatHook(store, 0, 1, 0.0, SimpleNamespace(last_committed=None), report)
    read = lambda: store.read_record(RunLayout.heartbeat(0, 1), WorkerHeartbeat)  # noqa: E731
    beat.on_step(StepRecord(1, 0.5, started_at=100.0, finished_at=160.0, first=True))  # 60 s: compiled
    assert read().step_seconds is None
    beat.on_step(StepRecord(2, 0.5, started_at=160.0, finished_at=160.5))
    beat.on_step(StepRecord(3, 0.5, started_at=160.5, finished_at=163.5))  # a save paused the loop 2.5 s
    assert read().step_seconds == 3.0
    t = 163.5
    for step in range(4, 4 + RECENT_STEPS):
        t += 0.5
        beat.on_step(StepRecord(step, 0.5, started_at=t - 0.5, finished_at=t))
    assert read().step_seconds == 0.5  # the pause has left the window


def test_a_save_that_committed_in_the_background_costs_no_heartbeat(tmp_path):
    store, hook, watchdog, during = _save_hooks(tmp_path, done=True)
    first = store.read_record(RunLayout.heartbeat(0, 1), WorkerHeartbeat)
    hook.heartbeat.on_step(StepRecord(20, 0.5))
    hook.on_step(StepRecord(20, 0.5))
    assert "beat" not in during and watchdog.saving is False  # polled as committed: nothing was waited for
    assert store.read_record(RunLayout.heartbeat(0, 1), WorkerHeartbeat) == first  # no write for the save


def test_a_wait_shorter_than_an_interval_costs_no_write_and_a_failed_clear_forces_the_next_beat(tmp_path):
    store, hook, watchdog, during = _save_hooks(tmp_path, done=False)  # interval 30 s: the wait ends first
    first = store.read_record(RunLayout.heartbeat(0, 1), WorkerHeartbeat)
    hook.on_step(StepRecord(20, 0.5))
    assert during["watchdog_saving"] is True and during["beat"] == first  # no write for a short wait
    beat = hook.heartbeat
    beat._waiting = True  # a wait was announced; the store refuses the write that clears it
    real, refused = beat.store.write_record, []
    beat.store.write_record = lambda *a: refused.append(a) or (_ for _ in ()).throw(OSError("503"))
    beat.saving(None)
    beat.store.write_record = real
    beat.on_step(StepRecord(21, 0.5, finished_at=first.at + 1))  # within the interval, yet written
    got = store.read_record(RunLayout.heartbeat(0, 1), WorkerHeartbeat)
    assert refused and (got.step, got.saving) == (21, None), got


def test_a_save_longer_than_its_interval_is_said_once_with_the_interval_that_fits(tmp_path, caplog):
    store, hook, watchdog, during = _save_hooks(tmp_path, done=True)
    hook.started = (10, time.time() - 2.0)  # step 10's save started 2 s (10 steps of 0.2 s) before step 20
    hook.ckpt.pending.done = concurrent.futures.Future()  # ... and is still running when step 20 is due
    hook.ckpt.last_duration = 5.0
    with caplog.at_level("WARNING", logger="trainer.hooks"):
        hook.on_step(StepRecord(20, 0.5))
        hook.on_step(StepRecord(30, 0.5))  # late again: not said twice
    said = [r.getMessage() for r in caplog.records if "checkpoint.interval_steps" in r.getMessage()]
    assert len(said) == 1, said
    assert "the save of step 10 took 5.0 s, longer than the 10 steps after it" in said[0]
    assert "An interval of at least 25 steps fits" in said[0] or "at least 26 steps" in said[0], said[0]
    assert hook.ckpt.saved == [20, 30]


def _read_at(slow: SaveSlowdown, step: int, t: float) -> None:
    slow.step(StepRecord(step, 0.5, finished_at=t))


def test_a_save_s_slowdown_is_its_steps_time_beyond_the_usual_pace_catch_up_and_earlier_waits_apart():
    """Steps read every 0.1 s; during a save one is read 0.8 s after the one before (0.7 s late) and the two after it
    at once (the accelerator kept working on queued steps while the loop's thread was held): the save cost the loop
    0.5 s. The wait for an earlier save's commit at the start of a span is that save's, not this one's."""
    slow, t = SaveSlowdown(), 0.0
    assert slow.close() is None  # no span open
    for step in range(1, 11):
        t += 0.1
        _read_at(slow, step, t)
    slow.open()
    for step, gap in ((11, 0.8), (12, 0.0), (13, 0.0), (14, 0.1), (15, 0.1)):
        t += gap
        _read_at(slow, step, t)
    assert slow.close() == pytest.approx(0.5)
    assert slow.close() is None  # closed once
    slow.open(waited=0.3)  # step 15's hooks waited 0.3 s for the commit of the save before
    for step, gap in ((16, 0.4), (17, 0.1)):
        t += gap
        _read_at(slow, step, t)
    assert slow.close() == pytest.approx(0.0, abs=1e-9)


def test_a_save_s_slowdown_is_not_measured_without_a_usual_pace():
    slow = SaveSlowdown(least=5)
    for step, t in ((1, 0.1), (2, 0.2), (3, 0.3)):
        _read_at(slow, step, t)
    slow.open()
    _read_at(slow, 4, 5.0)
    assert slow.close() is None  # two usual intervals: no pace to measure against


def test_a_save_s_cost_counts_its_steps_slowed_until_the_steps_in_flight_at_its_commit_were_read(tmp_path, monkeypatch):
    """The commit is said at once; what the save cost the loop (``save_cost``) once the steps in flight at the commit
    were read (steps_ahead + 1 reads: any the accelerator finished while the loop was held are read at once, and
    make up for the late ones): the span's time beyond the usual pace, less the loop's time inside save() (which
    the span holds and blocking_seconds already count), as its own part."""
    _, hook, _, _ = _save_hooks(tmp_path, done=True)
    monkeypatch.setattr("trainer.hooks.now", lambda: 1000.0)  # no wait for an earlier commit at step 20's save
    emitted: list[tuple] = []
    hook.events = SimpleNamespace(emit=lambda kind, step, **k: emitted.append((kind, step, k)))
    hook.settle = 3  # steps_ahead 2
    t = 1000.0
    for step in range(11, 21):  # step 10's save committed in the background; step 20 starts the next
        t += 0.1
        hook.on_step(StepRecord(step, 0.5, finished_at=t))
    assert hook.ckpt.saved == [20]
    ckpt = hook.ckpt
    ckpt.last_blocking, ckpt.last_held, ckpt.last_parts = 0.05, 0.04, {"hand-off to the saver thread": 0.04}
    for step, gap in ((21, 0.9), (22, 0.1)):  # the loop held: step 21 read 0.8 s late
        t += gap
        hook.on_step(StepRecord(step, 0.5, finished_at=t))
    ckpt.pending.done.set_result(None)
    emitted.clear()
    for step, gap in ((23, 0.1), (24, 0.0), (25, 0.0), (26, 0.1)):  # committed at 23; 24 and 25 were done already
        t += gap
        hook.on_step(StepRecord(step, 0.5, finished_at=t))
        if step == 23:
            assert [e[0] for e in emitted] == [EventKind.SAVE_COMMITTED]  # its cost is not known yet
    assert [e[0] for e in emitted] == [EventKind.SAVE_COMMITTED, EventKind.SAVE_COST]
    got = emitted[-1][2]
    assert got["blocking_parts"][SLOWED_PART] == pytest.approx(0.6 - 0.04, abs=1e-9)
    assert got["blocking_seconds"] == pytest.approx(0.05 + 0.6 - 0.04, abs=1e-9)
    hook.finish()
    assert [e[0] for e in emitted] == [EventKind.SAVE_COMMITTED, EventKind.SAVE_COST]  # said once


@pytest.mark.parametrize("complete", [True, False])
def test_a_last_checkpoint_left_incomplete_ends_the_worker_as_transient_not_as_a_finished_run(tmp_path, complete):
    """Exit 0 promises a complete last checkpoint: a final save the store left incomplete (its manifest or a file of
    orbax's not written past the retries) ends the worker with 69 and why, so the next attempt trains to the end."""
    _, hook, _, _ = _save_hooks(tmp_path, done=True)
    ckpt = hook.ckpt
    ckpt.last_incomplete = "checkpoint 100: orbax could not write it to the run store (HttpError: 503)"

    def record():
        step, ckpt.pending = ckpt.pending.step, None
        return step if complete else None

    ckpt._record = record
    hook.on_step(StepRecord(90))
    ckpt.pending.done.set_result(None)
    if complete:
        hook.on_step(StepRecord(100, last=True))
        assert ckpt.saved == [90, 100]
        return
    with pytest.raises(TrainerExit) as e:
        hook.on_step(StepRecord(100, last=True))
    assert e.value.code == ExitCode.TRANSIENT and "last checkpoint (step 100)" in str(e.value)
    assert "HttpError: 503" in str(e.value)
