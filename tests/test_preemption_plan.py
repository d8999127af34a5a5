"""The save on SIGTERM: the budget, the stop flag that carries SIGTERM's age, and the plan's table of cases."""

from __future__ import annotations

import pytest

from trainer.decisions import (
    EXIT_MARGIN_S,
    SAVE_SAFETY_FACTOR,
    STUCK_AFTER_SIGTERM_MIN_S,
    PreemptionAction,
    PreemptionPlan,
    preemption_plan,
    save_budget,
    sigterm_age,
    stop_flag,
    stuck_after_sigterm_s,
)
from trainer.loop import Hooks, training_steps

SAVE, FINISH, EXIT = PreemptionAction.SAVE, PreemptionAction.FINISH_IN_FLIGHT, PreemptionAction.EXIT


def test_budget_is_the_window_minus_the_exit_margin():
    assert save_budget(15) == 15 - EXIT_MARGIN_S
    assert save_budget(3) == 3 - EXIT_MARGIN_S
    assert save_budget(0) == 0.0  # host errors: no graceful shutdown, nothing to spend
    assert save_budget(EXIT_MARGIN_S / 2) == 0.0


F = SAVE_SAFETY_FACTOR


@pytest.mark.parametrize(
    ("budget", "elapsed", "estimate", "in_flight", "want"),
    [
        (14.0, 0.1, 2.0, False, SAVE),  # Spot default window, a 2 s save: fits
        (14.0, 0.1, 10.0, False, EXIT),  # 15 s > 13.9 s left
        (14.0, 14.5, 0.1, False, EXIT),  # the stop was agreed after the budget ran out
        (14.0, 14.0, None, False, EXIT),  # no budget left, even without an estimate
        (2.0, 0.0, 2.0 / F, False, SAVE),  # exactly fits
        (2.0, 0.01, 2.0 / F, False, EXIT),  # a hair over
        (14.0, 0.1, None, False, SAVE),  # nothing measured yet (fresh run): try, a cut save is never restored
        (14.0, 0.1, None, True, SAVE),
        (14.0, 1.0, 4.0, True, SAVE),  # in flight + one more: 2 x 6 s <= 13 s
        (14.0, 1.0, 5.0, True, FINISH),  # 7.5 s <= 13 s < 15 s: only the one in flight
        (14.0, 1.0, 9.0, True, EXIT),  # not even the one in flight: 13.5 s > 13 s
        (0.0, 0.0, 0.1, True, EXIT),  # a window no larger than the exit margin
    ],
)
def test_preemption_plan(budget, elapsed, estimate, in_flight, want):
    plan = preemption_plan(budget_s=budget, elapsed_s=elapsed, estimate_s=estimate, save_in_flight=in_flight)
    assert plan.action is want, plan.reason
    assert (plan.budget_s, plan.elapsed_s, plan.estimate_s, plan.in_flight) == (budget, elapsed, estimate, in_flight)
    assert plan.reason and "\n" not in plan.reason
    assert PreemptionPlan.from_json(plan.to_json()) == plan  # what process 0 publishes, the others read back


def test_stop_flag_carries_the_age_of_the_first_sigterm_through_the_max():
    assert stop_flag(None) == 0 and sigterm_age(0) is None
    assert sigterm_age(stop_flag(0.0)) == 0.0
    assert sigterm_age(stop_flag(2.5)) == 2.5
    # The step reduces every process's flag with a max: all learn the age of the earliest SIGTERM.
    flags = [stop_flag(None), stop_flag(0.2), stop_flag(1.25), stop_flag(None)]
    assert sigterm_age(max(flags)) == 1.25
    assert stop_flag(1e12) == 2**31 - 1  # an int32 on the device, never overflowing


class AgedStop:
    """A step over plain numbers whose reduced stop flag is what the processes passed in."""

    def __init__(self):
        self.step = 0

    def __call__(self, flag: int) -> tuple[float, int]:
        self.step += 1
        return 1.0, flag


def test_the_step_record_carries_the_age_of_the_sigterm_at_the_end_of_the_step():
    # A process's flag stays raised once its SIGTERM came (its age grows): read one step late, the agreement
    # of step 3 takes effect after step 4, already dispatched with the flag.
    flags = iter([0, 0, stop_flag(0.5), stop_flag(0.6)])
    recs = list(training_steps(AgedStop(), 0, 10, lambda: next(flags), Hooks()))
    assert [(r.step, r.stop_agreed) for r in recs] == [(1, False), (2, False), (3, False), (4, True)]
    assert all(r.sigterm_age_s is None for r in recs[:3])
    assert recs[3].sigterm_age_s == pytest.approx(0.6 + recs[3].seconds)


@pytest.mark.parametrize(
    "last_step_seconds, expected",
    [(None, STUCK_AFTER_SIGTERM_MIN_S), (0.01, STUCK_AFTER_SIGTERM_MIN_S), (2.0, 6.0)],
)
def test_a_gang_that_cannot_step_after_sigterm_is_left_after_three_step_times(last_step_seconds, expected):
    assert stuck_after_sigterm_s(last_step_seconds) == expected
