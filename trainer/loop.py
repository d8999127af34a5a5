"""The training loop: run steps, yield one record per step; everything else subscribes as a hook.

The loop knows nothing of checkpoints, metrics, events or faults. ``training_steps`` yields a
``StepRecord`` after each step; ``Hooks`` runs the subscribers on it, each at its own frequency,
before the next step starts (so a hook may read the state the step produced).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from recovery_steps.kernel.records import now
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

    def before_step(self, fn: Callable[[int], None]) -> None:
        """Run ``fn(step)`` before each step is started (``step``: the number it will have)."""
        self._before.append(fn)

    def add(self, fn: Hook, every: int = 1) -> None:
        """Run ``fn(record)`` after every ``every``-th step, and after the step training ends on."""
        if every < 1:
            raise ValueError(f"every: {every} is not a positive number of steps")
        self._after.append((fn, every))

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

    def __call__(self, stop_requested: int) -> tuple[float, int]:
        """Run one step on the next global batch; return its loss and the reduced stop flag (0: no stop).

        ``stop_requested`` is this process's flag (``decisions.stop_flag``); the step returns the max
        over every process.
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
        return float(loss), int(stop)


def training_steps(
    run_step: Callable[[int], tuple[float, int]],
    start_step: int,
    total_steps: int,
    stop_requested: Callable[[], int],
    hooks: Hooks,
) -> Iterator[StepRecord]:
    """Run steps ``start_step + 1 .. total_steps`` (or until a stop is agreed), yielding each one's record.

    The caller runs ``hooks.run(record)`` on each record; the before-step hooks run here. A stop flag is
    0 (no stop) or 1 + milliseconds since SIGTERM when the step was started (``decisions.stop_flag``); a
    bool counts as a flag of age 0.
    """
    step = start_step
    while step < total_steps:
        hooks.run_before(step + 1)
        t0 = now()
        loss, stop = run_step(stop_requested())
        step += 1
        t1 = now()
        age = sigterm_age(int(stop))
        yield StepRecord(
            step,
            loss,
            t0,
            t1,
            first=step == start_step + 1,
            stop_agreed=bool(stop),
            sigterm_age_s=None if age is None else age + (t1 - t0),
            last=step >= total_steps,
        )
        if stop:
            return
