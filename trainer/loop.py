"""The training loop: run steps, yield one record per step; everything else subscribes as a hook.

The host never waits for the device between two steps: up to ``training.steps_ahead`` steps are dispatched before a
step's loss and stop flag are read (JAX dispatches asynchronously; reading a result is what waits), so a pause of the
host shorter than that (an asynchronous save's own thread holds the interpreter for up to a second) costs the
accelerator nothing. Where hooks hold the loop and where an agreed stop takes effect: docs/TRAINER.md.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from jaxrec.model.records import now
from trainer.decisions import sigterm_age

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    """One completed step, as the hooks see it."""

    step: int = 0
    loss: float = 0.0
    started_at: float = 0.0  # wall clock (epoch s) before the step was dispatched
    finished_at: float = 0.0  # wall clock when its loss was on the host
    first: bool = False  # the first step of this worker (its time includes compilation)
    stop_agreed: bool = False  # every process agreed, inside this step, to stop after it
    sigterm_age_s: float | None = None  # with a stop: seconds since the gang's first SIGTERM, now
    last: bool = False  # the final step of training

    @property
    def seconds(self) -> float:
        """Wall-clock seconds the step took (with compilation on the first step)."""
        return self.finished_at - self.started_at


Hook = Callable[[StepRecord], None]


class Hooks:
    """Subscribers to the step records, each run every ``every`` steps (or on a stop or the last step)."""

    def __init__(self) -> None:
        self._before: list[Callable[[int], None]] = []
        self._after: list[tuple[Hook, int]] = []
        self._holds: list[Callable[[int], bool]] = []
        self._dispatched: list[Callable[[int], None]] = []

    def before_step(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(step)`` before each step is started (``step``: the number it will have)."""
        self._before.append(fn)

    def add(self, fn: Hook, every: int = 1) -> None:
        """Run ``fn(record)`` after every ``every``-th step, and after the step training ends on."""
        if every < 1:
            raise ValueError(f"every: {every} is not a positive number of steps")
        self._after.append((fn, every))

    def after_dispatch(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(step)`` right after ``step`` is dispatched, before any later step is.

        The state it will produce is ``Stepper.state`` until the next step donates it (a save copies it there).
        """
        self._dispatched.append(fn)

    def run_dispatched(self, step: int) -> None:
        """Run the after-dispatch hooks of the step just dispatched."""
        for fn in self._dispatched:
            fn(step)

    def hold(self, fn: Callable[[int], bool]) -> None:
        """Run no step ahead of the hooks of each step ``s`` where ``fn(s)``.

        Such hooks read the state ``s`` produced (donated to the next step once it runs), or a before-step hook
        acts at ``s + 1``.
        """
        self._holds.append(fn)

    def holds(self, step: int) -> bool:
        """Whether the step after ``step`` waits for the hooks of ``step``."""
        return any(fn(step) for fn in self._holds)

    def run_before(self, step: int) -> None:
        """Run the before-step hooks for the step about to start."""
        for fn in self._before:
            fn(step)

    def run(self, rec: StepRecord) -> None:
        """Run the after-step hooks due at ``rec``, in the order they were added."""
        for fn, every in self._after:
            if rec.step % every == 0 or rec.last or rec.stop_agreed:
                fn(rec)


class Stepper:
    """The training state, the data iterator and the compiled step: ``stepper(stop)`` runs one step.

    The state is replaced by each step (its buffers are donated), so hooks read ``stepper.state``
    between steps, never keep it.
    """

    def __init__(self, tr: Any, state: Any, data_iter: Any, process_count: int, compiled: Any = None):
        self.tr = tr
        self.state = state
        self.data_iter = data_iter
        self.process_count = process_count
        self.compiled = compiled
        self._checked = False

    def __call__(self, stop_requested: int) -> tuple[Any, Any]:
        """Dispatch one step on the next global batch; return its loss and the reduced stop flag (0: no stop).

        Both are device arrays, not yet read: ``float`` and ``int`` of them wait for the step. ``stop_requested``
        is this process's flag (``decisions.stop_flag``); the step returns the max over every process.
        """
        from trainer import train_state

        batch = train_state.global_batch(self.tr, next(self.data_iter), self.process_count)
        flags = train_state.stop_flags(self.tr, stop_requested)
        if self.compiled is None:
            self.compiled, self._checked = self.tr.step_fn.lower(self.state, batch, flags).compile(), True
        if self._checked:
            out = self.compiled(self.state, batch, flags)
        else:
            # An executable compiled ahead from abstract inputs checks the real ones before it runs anything
            # (nothing is donated yet): one that does not fit them is compiled again from the real inputs.
            try:
                out = self.compiled(self.state, batch, flags)
            except (TypeError, ValueError) as e:
                log.warning("the step compiled ahead does not fit the inputs (%s); compiling it again", e)
                self.compiled = self.tr.step_fn.lower(self.state, batch, flags).compile()
                out = self.compiled(self.state, batch, flags)
            self._checked = True
        self.state, loss, stop = out
        return loss, stop


def training_steps(
    run_step: Callable[[int], tuple[Any, Any]],
    start_step: int,
    total_steps: int,
    stop_requested: Callable[[], int],
    hooks: Hooks,
    steps_ahead: int = 1,
) -> Iterator[StepRecord]:
    """Run steps ``start_step + 1 .. total_steps`` (or until a stop is agreed), yielding each one's record.

    ``run_step(flag)`` dispatches a step and returns its loss and reduced stop flag, read here with ``float``
    and ``int`` (device arrays or plain numbers). The caller runs ``hooks.run(record)`` on each record; the
    before-step hooks run here, before each step is dispatched. Up to ``steps_ahead`` steps are dispatched beyond
    the one whose results are read, never one past a step ``n`` where ``hooks.holds(n)`` before n's hooks ran. A
    stop flag is 0 (no stop) or 1 + milliseconds since SIGTERM when the step was dispatched
    (``decisions.stop_flag``); a bool counts as a flag of age 0. The gang stops ``steps_ahead`` steps after the
    first step whose reduced flag is raised (or at the last step): a step every process computes alike, whatever
    it had in flight (docs/TRAINER.md says why).
    """
    if steps_ahead < 1:
        raise ValueError(f"steps_ahead: {steps_ahead} is not a positive number of steps")
    if start_step >= total_steps:
        return
    in_flight: deque[tuple[int, float, Any, Any]] = deque()
    following = start_step + 1  # the next step to dispatch
    hooks_done = start_step  # the last step whose hooks ran
    stop_at: int | None = None  # the step the agreed stop ends training at, once a raised flag was read

    def fill() -> None:
        nonlocal following
        while following <= (stop_at or total_steps) and len(in_flight) < steps_ahead:
            if following - 1 > hooks_done and hooks.holds(following - 1):
                return
            hooks.run_before(following)
            t0 = now()
            loss, stop = run_step(stop_requested())
            in_flight.append((following, t0, loss, stop))
            hooks.run_dispatched(following)
            following += 1

    fill()
    while in_flight:
        step, t0, loss, stop = in_flight.popleft()
        fill()
        loss_v, stop_v = float(loss), int(stop)
        t1 = now()
        if stop_v and stop_at is None:
            stop_at = min(step + steps_ahead, total_steps)
        agreed = step == stop_at
        age = sigterm_age(stop_v) if agreed else None
        yield StepRecord(
            step,
            loss_v,
            t0,
            t1,
            first=step == start_step + 1,
            stop_agreed=agreed,
            sigterm_age_s=None if age is None else age + (t1 - t0),
            last=step >= total_steps,
        )
        if agreed:
            return
        hooks_done = step
        fill()
