"""What subscribes to the loop's step records: loss guard, faults, progress, events, metrics, checkpoints."""

from __future__ import annotations

import logging
import math
import os
import signal
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import (
    EventKind,
    PreemptionSave,
    RunLease,
    WorkerExitReport,
    WorkerHeartbeat,
    WorkerPhase,
    now,
)
from trainer.compile_cache import CacheCounter
from trainer.decisions import Faults, PreemptionAction, PreemptionPlan, SaveReason, TrainerExit, save_decision
from trainer.lifecycle import Watchdog, native_crash
from trainer.loop import Stepper, StepRecord
from trainer.telemetry import Events, WorkerMetrics, cpu_seconds

log = logging.getLogger("trainer")


def check_finite_loss(rec: StepRecord) -> None:
    """A non-finite loss is an application error (exit 42)."""
    if not math.isfinite(rec.loss):
        raise TrainerExit(ExitCode.APPLICATION, f"non-finite loss {rec.loss} at step {rec.step}")


class FaultHook:
    """Rehearsal faults of ``TRAINER_FAULT``: before a step, on its loss, and during a save.

    ``CheckpointHook`` calls ``save_starting`` and ``save_handed_over``; ``kill-during-save`` acts on process 0
    alone (``primary``).
    """

    def __init__(self, faults: Faults, *, primary: bool = True):
        self.faults = faults
        self.primary = primary

    def before_step(self, step: int) -> None:
        """``hang`` stops making progress and ``app-bug`` raises, before step ``step``."""
        if self.faults.due("hang", step):
            log.warning("injected hang before step %d", step)
            while True:
                time.sleep(3600)
        if self.faults.due("app-bug", step):
            raise RuntimeError(f"injected application bug in step {step}")
        if step > 0 and self.faults.due("native-crash", step):
            native_crash()

    def acts_before_next(self, step: int) -> bool:
        """Whether ``before_step`` acts before the step after ``step`` (which then is not run ahead)."""
        return any(self.faults.due(kind, step + 1) for kind in ("hang", "app-bug", "native-crash"))

    def on_step(self, rec: StepRecord) -> None:
        """``nan``: the loss of that step is reported non-finite."""
        if self.faults.due("nan", rec.step):
            check_finite_loss(StepRecord(rec.step, float("nan")))

    def save_starting(self, step: int, async_save: bool) -> None:
        """``kill-during-save`` of a synchronous save: SIGKILL as it starts (once it returns it is complete)."""
        if not async_save and self._kills_save(step):
            os.kill(os.getpid(), signal.SIGKILL)

    def save_handed_over(self, step: int, ckpt: Any) -> None:
        """``kill-during-save`` of an asynchronous save: SIGKILL once orbax's writes are in flight, not committed."""
        if self._kills_save(step):
            ckpt.wait_until_writing()
            os.kill(os.getpid(), signal.SIGKILL)

    def _kills_save(self, step: int) -> bool:
        return self.primary and self.faults.due("kill-during-save", step)


class ProgressHook:
    """The exit report's progress fields (and, on the first step, the compilation cache's use), the watchdog's clock."""

    def __init__(self, report: WorkerExitReport, watchdog: Watchdog, cache: CacheCounter | None = None):
        self.report = report
        self.watchdog = watchdog
        self.cache = cache

    def on_step(self, rec: StepRecord) -> None:
        """Record the step; the first one also its compile-and-run time."""
        self.report.last_step = rec.step
        self.watchdog.touch()
        if rec.first:
            self.watchdog.first_step_done = True
            self.report.first_step_at = rec.finished_at
            if self.report.compile_seconds is None:  # not compiled ahead: the first step compiled
                self.report.compile_seconds = rec.seconds
            if self.cache is not None:
                self.report.compile_cache_requests = self.cache.requests
                self.report.compile_cache_hits = self.cache.hits


RECENT_STEPS = 100
"""How many of its latest steps a heartbeat's ``step_seconds`` (the longest of them) is taken over."""


class HeartbeatHook:
    """The worker's heartbeat (``WorkerHeartbeat``) in the run store: at most one write per interval.

    The train-segment supervisor decides "no progress" from it; the first and the last step are always
    written. One small write per interval costs the loop nothing measurable; a transient answer is retried for one
    interval at most (the write is on the training thread), and a failure is logged only.
    """

    def __init__(
        self, store: RunStore, attempt: int, process_index: int, interval_s: float, ckpt: Any, report: WorkerExitReport
    ):
        self.store, self.attempt, self.index = store.bounded(interval_s), attempt, process_index
        self.interval_s, self.ckpt, self.report = interval_s, ckpt, report
        self._last = float("-inf")
        self._step: int | None = None
        self._waiting = False  # a heartbeat saying the loop waits for a save is in the store
        self._wait: threading.Timer | None = None
        self._force = False  # the next step is written whatever the interval (a clearing write failed)
        self._lock = threading.Lock()
        # The times between the ends of the latest steps (the first step's compilation not among them).
        self._gaps: deque[float] = deque(maxlen=RECENT_STEPS)
        self._ended: float | None = None
        self._longest: float | None = None  # the longest of them (read by the timer's writes, too)

    def on_step(self, rec: StepRecord) -> None:
        """Write the step when the interval has passed (or on the first and last step)."""
        self._step = rec.step
        if self._ended is not None and not rec.first:
            self._gaps.append(rec.finished_at - self._ended)
            self._longest = max(self._gaps)
        self._ended = rec.finished_at
        if not (rec.first or rec.last or self._force) and rec.finished_at - self._last < self.interval_s:
            return
        self._force = not self._write(rec.finished_at)

    def saving(self, step: int | None) -> None:
        """The loop blocks on the save of ``step`` from now (None: no longer).

        A wait that lasts a heartbeat interval is announced in a heartbeat (from a timer, off the training
        thread), so the supervisor gives it ``save_timeout_s`` rather than ``hang_timeout_s``; its end then
        clears it at once, so a step that hangs after the save is judged by the hang timeout again. A wait
        shorter than an interval costs no write: the interval's heartbeat covers it.
        """
        if step is not None:
            with self._lock:
                self._wait = threading.Timer(self.interval_s, self._announce, args=(step,))
                self._wait.daemon = True
                self._wait.start()
            return
        with self._lock:
            if self._wait is not None:
                self._wait.cancel()
                self._wait = None
            if self._waiting:
                self._waiting = False
                self._force = not self._write(now())

    def _announce(self, step: int) -> None:
        with self._lock:
            if self._wait is None:  # the wait ended meanwhile
                return
            self._waiting = self._write(now(), saving=step)

    def _write(self, at: float, saving: int | None = None) -> bool:
        """One heartbeat; False when the store refused it (logged: progress reporting never stops training)."""
        self._last = at
        beat = WorkerHeartbeat(
            process_index=self.index,
            step=self._step,
            checkpoint_step=self.ckpt.last_committed,
            at=at,
            first_step_at=self.report.first_step_at,
            saving=saving,
            phase=WorkerPhase.STEP if saving is None else WorkerPhase.SAVE,
            step_seconds=self._longest,
        )
        try:
            self.store.write_record(RunLayout.heartbeat(self.attempt, self.index), beat)
        except Exception as e:  # noqa: BLE001 - progress reporting must never stop training
            log.warning("could not write the heartbeat: %s", e)
            return False
        return True


class LeaseGauge:
    """Worker 0 exports when the run lease was last renewed (``jaxrec_run_lease_renewed_timestamp_seconds``).

    It reads the lease every ``every_s``, off the training thread.
    The supervisor renews the lease while it supervises the gang; a gang that trains while the renewals stop runs
    with nothing to end it when it fails or stalls (its supervisor's pod gone while Argo still shows the step
    Running). The gang is what is scraped then, so it is the gang that tells (alert ``JaxrecRunUnsupervised``). A
    read that fails leaves the gauge as it was: unknown is not stale.
    """

    def __init__(self, store: RunStore, metrics: WorkerMetrics, every_s: float):
        self.store, self.metrics, self.every_s = store, metrics, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-gauge", daemon=True)

    def start(self) -> LeaseGauge:
        """Start reading (a daemon thread: it never holds the process up)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reading (the thread ends at its next wake-up at the latest)."""
        self._stop.set()

    def read_once(self) -> float | None:
        """Read the lease once and set the gauge; its renewal time (None: absent or unreadable)."""
        try:
            lease = self.store.read_record(RunLayout.LEASE, RunLease)
        except Exception as e:  # noqa: BLE001 - a gauge's read never stops training
            log.warning("could not read the run lease: %s", e)
            return None
        if lease is None:
            return None
        self.metrics.set("jaxrec_run_lease_renewed_timestamp_seconds", lease.renewed_at)
        return lease.renewed_at

    def _run(self) -> None:
        while True:
            self.read_once()
            if self._stop.wait(self.every_s):
                return


class EventsHook:
    """The ``first_step`` and ``step`` event lines (the local runner times incidents from them)."""

    def __init__(self, events: Events, cache: CacheCounter | None = None):
        self.events = events
        self.cache = cache

    def on_step(self, rec: StepRecord) -> None:
        """Emit the step's events (``first_step`` with the compilation cache's requests and hits so far)."""
        if rec.first:
            cache = {} if self.cache is None else {"cache_requests": self.cache.requests, "cache_hits": self.cache.hits}
            self.events.emit(EventKind.FIRST_STEP, rec.step, compile_seconds=rec.seconds, cpu_s=cpu_seconds(), **cache)
            log.info("first step %d done (compile + run %.2f s), loss %.4f", rec.step, rec.seconds, rec.loss)
        self.events.emit(EventKind.STEP, rec.step, loss=rec.loss)


class MetricsHook:
    """The per-step gauges: step, loss, last-step time, steps/s over the last 50 steps, checkpoint age."""

    def __init__(self, metrics: WorkerMetrics, ckpt: Any, started: float):
        self.metrics = metrics
        self.ckpt = ckpt
        self.started = started
        self._window: list[float] = []

    def on_step(self, rec: StepRecord) -> None:
        """Update the gauges (the first step, which compiles, stays out of the rate)."""
        m, now = self.metrics, rec.finished_at
        if rec.first:
            m.set("jaxrec_compile_seconds", rec.seconds)
        else:
            self._window = (self._window + [now])[-50:]
        m.set("jaxrec_train_step", rec.step)
        m.set("jaxrec_train_loss", rec.loss)
        m.set("jaxrec_last_step_timestamp_seconds", now)
        if len(self._window) > 1:
            w = self._window
            m.set("jaxrec_train_steps_per_second", (len(w) - 1) / max(w[-1] - w[0], 1e-9))
        m.set("jaxrec_checkpoint_age_seconds", now - (self.ckpt.last_commit_time or self.started))


@dataclass(frozen=True)
class SaveOptions:
    """When ``CheckpointHook`` saves and how (the first three from the config)."""

    interval_steps: int
    total_steps: int
    async_save: bool
    restore_step: int = -1  # the step this attempt restored (-1: fresh)
    estimate_s: float | None = None  # one save's seconds until this attempt commits one (the restored step's; None)
    steps_ahead: int = 1  # the loop's ``training.steps_ahead``: reads after a commit until a save's cost is known


@dataclass(frozen=True)
class SaveObservers:
    """Who hears of ``CheckpointHook``'s saves: the event log, the gauges, the exit report, watchdog and heartbeat."""

    events: Events
    metrics: WorkerMetrics
    report: WorkerExitReport
    watchdog: Watchdog
    heartbeat: HeartbeatHook | None = None  # None: no heartbeat says that a save blocks the loop
    faults: FaultHook | None = None  # the rehearsal faults that act during a save


SLOWED_PART = "the steps slowed while it ran"
"""The part of a save's ``blocking_parts`` that its steps took beyond their usual pace, its waits apart
(``SaveSlowdown``): the loop's thread held by the save's own threads, the accelerator left without work."""


class SaveSlowdown:
    """How much longer the loop's steps took while a save ran than at their usual pace.

    An asynchronous save costs the loop more than its waits: while orbax's threads run they hold the interpreter,
    the loop reads and dispatches late, and the accelerator may run out of queued steps. The steps' read times
    say how much: over the span from the save's step to where ``close`` is called (``CheckpointHook``: once the
    steps in flight at the commit were read), the time beyond that many steps at the usual pace (the median
    interval between steps read while no save ran, the last ``window`` of them). Spans never overlap: a save's
    span ends where the next one's starts at the latest.
    """

    def __init__(self, window: int = 32, least: int = 5):
        self._usual: deque[float] = deque(maxlen=window)
        self.least = least  # usual intervals needed before a span is measured
        self._last: float | None = None  # when the last step was read
        self._span: tuple[float, int] | None = None  # the open span: its start and the steps read in it

    def step(self, rec: StepRecord) -> None:
        """Note a step read (before its hooks record a commit or start a save)."""
        if self._last is not None and self._span is not None:
            self._span = (self._span[0], self._span[1] + 1)
        elif self._last is not None:
            self._usual.append(rec.finished_at - self._last)
        self._last = rec.finished_at

    def open(self, waited: float = 0.0) -> None:
        """A save starts at the step read last: its span starts there (an earlier span left open is dropped).

        ``waited``: seconds since that step counted elsewhere (the wait for an earlier save's commit).
        """
        self._span = None if self._last is None else (self._last + waited, 0)

    def close(self) -> float | None:
        """End the open span at the step read last: its seconds beyond the usual pace (None: not measured)."""
        span, self._span = self._span, None
        if span is None or self._last is None or len(self._usual) < self.least:
            return None
        start, steps = span
        return max(0.0, (self._last - start) - steps * statistics.median(self._usual))


class CheckpointHook:
    """Saves when ``save_decision`` says so and records each commit (event, gauges, report, watchdog).

    Interval saves are left to complete in the background; a final save is waited for (commit and
    manifest) so that exit 0 always leaves a complete last checkpoint. A SIGTERM stop saves only what
    fits the shutdown window, as the gang's ``PreemptionAgreement`` decides: the agreed step (waited
    for), only the save in flight, or nothing (``abandoned``: leave at once, wait for no save).
    """

    def __init__(
        self, ckpt: Any, stepper: Stepper, options: SaveOptions, observers: SaveObservers, *, agreement: Any = None
    ):
        self.ckpt = ckpt
        self.heartbeat = observers.heartbeat
        self.stepper = stepper
        self.interval_steps = options.interval_steps
        self.total_steps = options.total_steps
        self.async_save = options.async_save
        self.last_saved: int | None = options.restore_step if options.restore_step >= 0 else None
        self.faults = observers.faults
        self.events = observers.events
        self.metrics = observers.metrics
        self.report = observers.report
        self.watchdog = observers.watchdog
        self.agreement = agreement
        # Seconds one save takes: the restored checkpoint's save_seconds first, then each commit's own.
        self.estimate_s = options.estimate_s
        self.abandoned = False  # a SIGTERM stop with no save that fits: nothing more is waited for
        self.busy = False  # saving or waiting for a commit on the training thread (no step completes meanwhile)
        self.started: tuple[int, float] | None = None  # the step and time of the last save started
        self.late_said = False  # a save still running when the next was due has been said (once)
        self.captured: Any = None  # the copy taken for the next save as its step was dispatched (``capture``)
        self.slowdown = SaveSlowdown()  # what a save cost the loop beyond its waits
        # After a commit, the loop may still be reading steps the accelerator finished while it was held: a save's
        # span ends once the steps in flight then were read (or at the next save, or the end).
        self.settle = options.steps_ahead + 1
        self._cost: tuple[int, float, float, dict[str, float]] | None = None  # committed, its span still open
        self._settling = 0  # reads left before ``_cost`` is emitted

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved without a stop."""
        return self._decision(step, stop_agreed=False) is not SaveReason.NONE

    def capture(self, step: int) -> None:
        """Right after ``step`` was dispatched: take the copy an asynchronous save due at it writes.

        The next step donates the state, so its copy and the data position are taken now, one save at a time (and
        one copy on the device: not while an earlier save still holds its own), and the loop keeps its steps in
        flight through the save.
        """
        st = self.stepper
        if not (self.async_save and self.captured is None and self.due(step) and self.ckpt.copy_released()):
            return
        if self.ckpt.copy_fits(st.state, st.compiled):
            self.captured = self.ckpt.capture(step, st.state, st.data_iter)

    def holds(self, step: int) -> bool:
        """Whether the loop runs no step ahead of ``step``'s hooks: a save is due there that reads the live state.

        A synchronous one, or one whose copy was not taken as the step was dispatched.
        """
        return self.due(step) and (self.captured is None or self.captured.step != step)

    def _decision(self, step: int, *, stop_agreed: bool) -> SaveReason:
        return save_decision(
            step,
            interval_steps=self.interval_steps,
            total_steps=self.total_steps,
            stop_agreed=stop_agreed,
            last_saved=self.last_saved,
        )

    def on_step(self, rec: StepRecord) -> None:
        """Record a commit seen since the last step, then save if this step is due."""
        self.slowdown.step(rec)
        if self._cost is not None:
            self._settling -= 1
            if self._settling <= 0:
                self.emit_cost()
        self.note_commit(self.ckpt.poll())
        if rec.stop_agreed:
            log.info("stop agreed by every process after step %d", rec.step)
        reason = self._decision(rec.step, stop_agreed=rec.stop_agreed)
        c = self.captured
        if c is not None and (c.step < rec.step or (c.step == rec.step and reason is SaveReason.NONE)):
            self.captured = None  # not saved after all: its device copy goes
        if reason is SaveReason.NONE:
            return
        if reason is SaveReason.PREEMPTION and self.agreement is not None:
            self.on_preemption(rec)
            return
        self.save(rec.step)
        if reason in (SaveReason.PREEMPTION, SaveReason.FINAL):
            committed = self.finish()
            if reason is SaveReason.FINAL and committed != rec.step:
                # Exit 0 promises a complete last checkpoint: without it the run would end short of its last step.
                raise TrainerExit(
                    ExitCode.TRANSIENT,
                    f"the last checkpoint (step {rec.step}) is an incomplete transaction "
                    f"({self.ckpt.last_incomplete or 'see the log'}); the next attempt restores "
                    "the newest complete checkpoint and trains to the end",
                )

    def on_preemption(self, rec: StepRecord) -> None:
        """Carry out the gang's plan for the SIGTERM stop agreed at ``rec`` and record it in the exit report."""
        in_flight = self.ckpt.pending is not None
        plan = self.agreement.decide(rec.step, rec.sigterm_age_s or 0.0, self.estimate_s, in_flight)
        self.note_plan(plan)
        self.events.emit(EventKind.PREEMPTION_PLAN, rec.step, reason=f"{plan.action.value}: {plan.reason}")
        if plan.action is PreemptionAction.SAVE:
            self.save(rec.step)
            self.finish()
            self.report.preemption_save = PreemptionSave.SAVED
        elif plan.action is PreemptionAction.FINISH_IN_FLIGHT:
            self.finish()
            self.report.preemption_save = PreemptionSave.IN_FLIGHT_ONLY
        else:
            self.abandoned = True
            self.report.preemption_save = PreemptionSave.SKIPPED

    def note_plan(self, plan: PreemptionPlan) -> None:
        """Copy what the plan was decided from into the exit report."""
        r = self.report
        r.preemption_reason, r.preemption_budget_s, r.preemption_elapsed_s = plan.reason, plan.budget_s, plan.elapsed_s
        r.preemption_estimate_s, r.preemption_in_flight = plan.estimate_s, plan.in_flight

    def save(self, step: int) -> None:
        """Start saving ``step`` (after recording the previous save's commit)."""
        self.busy = True
        blocks = False
        try:
            # The loop waits for the save itself where it is synchronous or no device copy of the state fits.
            st = self.stepper
            live = not self.async_save or not self.ckpt.copy_fits(st.state, st.compiled)
            blocks = self._blocking_wait(step if live else None)
            self._save(step)
        finally:
            self._waited(blocks)
            self.busy = False

    def _blocking_wait(self, step: int | None) -> bool:
        """Tell the watchdog and the heartbeat of a wait that will block; True when there is one.

        The wait is for the save in flight, else (a synchronous save) for ``step`` itself.
        """
        p = self.ckpt.pending
        waits_for = p.step if p is not None and p.done is not None and not p.done.done() else step
        if waits_for is None:
            return False
        self.watchdog.saving = True
        if self.heartbeat is not None:
            self.heartbeat.saving(waits_for)
        return True

    def _waited(self, blocked: bool) -> None:
        if not blocked:
            return
        self.watchdog.saving = False
        self.watchdog.touch()
        if self.heartbeat is not None:
            self.heartbeat.saving(None)

    def _save(self, step: int) -> None:
        p = self.ckpt.pending
        late = p is not None and p.done is not None and not p.done.done()
        due_at = now()  # the steps' pace is measured up to here, not through the wait that follows
        self.note_commit(self.ckpt.finish_pending())
        self.emit_cost()
        self.slowdown.open(waited=now() - due_at)  # that wait is the earlier save's cost, not this one's
        if late and not self.late_said:
            self._say_late(step, due_at)
        self.started = (step, now())
        self.events.emit(EventKind.SAVE_STARTED, step)
        self.watchdog.touch()
        if self.faults is not None:
            self.faults.save_starting(step, self.async_save)
        capture, self.captured = self.captured, None
        self.ckpt.save(step, self.stepper.state, self.stepper.data_iter, capture=capture)
        self.last_saved = step
        if self.faults is not None:
            self.faults.save_handed_over(step, self.ckpt)

    def _say_late(self, step: int, due_at: float) -> None:
        """Say, once, that a save outlasts the interval between saves, and the interval that would fit."""
        duration = self.ckpt.last_duration
        if self.started is None or duration is None:
            return
        prev, at = self.started
        per_step = (due_at - at) / max(1, step - prev)
        fits = math.ceil(duration / per_step) if per_step > 0 else None
        self.late_said = True
        log.warning(
            "checkpoint.interval_steps %d: the save of step %d took %.1f s, longer than the %d steps after it "
            "(%.3f s each); the loop waited for it before saving step %d. An interval of at least %s steps fits "
            "a save this long",
            self.interval_steps, prev, duration, step - prev, per_step, step, fits if fits is not None else "more",
        )  # fmt: skip

    def finish(self) -> int | None:
        """Wait for the save in flight to commit with its manifest, and record it; the step, None if incomplete."""
        self.busy = True
        blocks = False
        try:
            blocks = self._blocking_wait(None)
            committed = self.ckpt.finish_pending()
            self.note_commit(committed)
            self.emit_cost()
            return committed
        finally:
            self._waited(blocks)
            self.busy = False

    def note_commit(self, committed: int | None) -> None:
        """Publish a newly committed step."""
        if committed is None:
            return
        c = self.ckpt
        self.events.emit(EventKind.SAVE_COMMITTED, committed, save_seconds=c.last_duration)
        if c.last_blocking is not None:
            self._cost, self._settling = (committed, c.last_blocking, c.last_held, c.last_parts), self.settle
        self.metrics.set("jaxrec_checkpoint_step", committed)
        self.metrics.set("jaxrec_checkpoint_last_commit_timestamp_seconds", c.last_commit_time or 0)
        self.metrics.set("jaxrec_checkpoint_duration_seconds", c.last_duration or 0)
        # The age drops when the commit is seen, not one step later: a worker stopped (or killed) right
        # after a commit would otherwise leave the previous checkpoint's age on its endpoint.
        self.metrics.set("jaxrec_checkpoint_age_seconds", now() - c.last_commit_time if c.last_commit_time else 0.0)
        self.report.last_checkpoint_step = committed
        if c.last_duration is not None:
            self.estimate_s = c.last_duration
        self.watchdog.touch()

    def emit_cost(self) -> None:
        """End the span of the save committed last and say what it cost the loop (``save_cost``), once."""
        slowed = self.slowdown.close()
        if self._cost is None:
            return
        (step, blocking, held, parts), self._cost = self._cost, None
        if slowed is not None:
            # Its span holds the loop's time inside save(), not the copy taken before it nor the commit wait after.
            parts = {**parts, SLOWED_PART: max(0.0, slowed - held)}
            blocking += parts[SLOWED_PART]
        self.events.emit(EventKind.SAVE_COST, step, blocking_seconds=blocking, blocking_parts=parts)


class LocalSaveHook:
    """``checkpoint.local.interval_steps``: hand a copy of the state to the local tier's saver (never waits for it).

    The on-device copy is compiled ahead (``snapshot``) and dispatched asynchronously, as for a GCS save: the next
    step donates the live buffers. The data position is captured here, on the training thread.
    """

    def __init__(self, tier: Any, stepper: Stepper, snapshot: Any, total_steps: int):
        self.tier, self.stepper, self.snapshot, self.total_steps = tier, stepper, snapshot, total_steps

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved locally (the loop runs no step ahead of its save)."""
        return step < self.total_steps and self.tier.due(step)

    def on_step(self, rec: StepRecord) -> None:
        """Start a local save when ``rec.step`` is due (not the last step: the final GCS save covers it)."""
        if rec.stop_agreed or rec.step >= self.total_steps or not self.tier.due(rec.step):
            return
        self.tier.save(rec.step, self.snapshot(self.stepper.state), self.stepper.data_iter.get_state())


class PaceHook:
    """``training.step_delay_s``: sleep after each step (local rehearsals stretch a run to watch it)."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def on_step(self, rec: StepRecord) -> None:
        """Sleep, unless training ends at this step."""
        if not (rec.stop_agreed or rec.last):
            time.sleep(self.delay_s)
