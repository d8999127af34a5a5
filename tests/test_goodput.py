"""Goodput in time, split into badput categories, from the workers' events (pure)."""

from __future__ import annotations

import pytest

from jaxrec.model.records import Incident, WorkerEvent
from jaxrec.model.totals import CATEGORIES, goodput, incident_badput


def _ev(t, event, attempt, pi=0, step=None, **kw):
    return WorkerEvent(t=t, event=event, attempt=attempt, process_index=pi, step=step, **kw)


def _attempt(a, t_start, t_init, t_restored, t_first, first_step, last_step, *, restore_step=-1, save_at=None):
    evs = []
    for pi in range(4):
        evs += [_ev(t_start + 0.01 * pi, "started", a, pi), _ev(t_init - 0.01 * pi, "initialized", a, pi)]
        evs += [_ev(t_restored, "restored", a, pi, max(restore_step, 0), restore_step=restore_step)]
        evs += [_ev(t_first, "first_step", a, pi, first_step)]
    for s in range(first_step, last_step + 1):
        evs.append(_ev(t_first + 0.1 * (s - first_step), "step", a, 0, s))
        evs.append(_ev(t_first + 0.1 * (s - first_step), "step", a, 1, s))  # other processes are not counted
    if save_at is not None:
        evs.append(_ev(t_first + 0.1 * (save_at - first_step), "save_committed", a, 0, save_at, save_seconds=1.0))
        evs.append(_ev(t_first + 0.1 * (save_at - first_step), "save_cost", a, 0, save_at, blocking_seconds=0.05))
    return evs


def test_uninterrupted_run_is_productive_but_for_start_and_saves():
    g = goodput(_attempt(0, 0.0, 1.0, 2.0, 4.0, 1, 21, save_at=10))
    assert g.badput["startup"] == pytest.approx(1.0)
    assert g.badput["restore"] == pytest.approx(1.0)
    assert g.badput["compilation"] == pytest.approx(2.0)
    assert g.badput["recomputed"] == 0 and g.badput["waiting_for_resources"] == 0
    assert g.productive_seconds == pytest.approx(2.0 - 0.05)
    assert g.wall_seconds == pytest.approx(6.0)
    assert (g.steps_computed, g.steps_kept, g.step_goodput) == (21, 21, 1.0)


def test_a_failure_costs_recomputed_steps_waiting_and_a_second_start():
    a0 = _attempt(0, 0.0, 1.0, 2.0, 4.0, 1, 12, save_at=10)
    a1 = _attempt(1, 8.0, 9.0, 9.5, 11.0, 11, 20, restore_step=10)
    g = goodput(a0 + a1)
    assert g.badput["startup"] == pytest.approx(2.0)
    assert g.badput["restore"] == pytest.approx(1.5)
    assert g.badput["compilation"] == pytest.approx(3.5)
    assert g.badput["recomputed"] == pytest.approx(0.2)  # steps 11 and 12 of attempt 0
    assert g.badput["waiting_for_resources"] == pytest.approx(8.0 - 5.1)
    assert g.badput["checkpoint_save"] == pytest.approx(0.05)
    assert g.productive_seconds == pytest.approx(1.1 + 0.9 - 0.2 - 0.05)
    assert g.wall_seconds == pytest.approx(11.9)
    assert sum(g.badput.values()) + g.productive_seconds == pytest.approx(g.wall_seconds)
    assert set(g.badput) == set(CATEGORIES)
    assert (g.steps_computed, g.steps_kept) == (22, 20)
    assert g.time_goodput == pytest.approx(1.75 / 11.9)


def test_an_attempt_that_dies_before_its_first_step_is_all_badput():
    a0 = _attempt(0, 0.0, 1.0, 2.0, 4.0, 1, 5)
    a1 = [_ev(6.0, "started", 1), _ev(6.5, "initialized", 1)]  # died in restore
    a2 = _attempt(2, 9.0, 9.5, 10.0, 11.0, 1, 5, restore_step=-1)
    g = goodput(a0 + a1 + a2)
    assert g.badput["recomputed"] == pytest.approx(0.4)  # the whole first attempt: nothing was saved
    assert g.badput["waiting_for_resources"] == pytest.approx((6.0 - 4.4) + (9.0 - 6.5))
    assert g.steps_kept == 5 and g.steps_computed == 10


def test_no_events_no_time():
    g = goodput([])
    assert g.wall_seconds == 0 and g.time_goodput == 0 and g.step_goodput == 0


def test_incident_phases_partition_its_recovery():
    inc = Incident(
        attempt=0,
        injected_at=100.0,
        detected_at=100.5,
        stopped_at=101.0,
        slice_ready_at=101.2,
        workers_started_at=102.0,
        restored_at=103.0,
        first_step_at=106.0,
        recovered_at=107.0,
    )
    b = incident_badput(inc)
    assert b == pytest.approx(
        {
            "detection": 0.5,
            "waiting_for_resources": 1.5,
            "startup_and_restore": 1.0,
            "compilation": 3.0,
            "recomputed": 1.0,
            "total": 7.0,
        }
    )
    assert sum(v for k, v in b.items() if k != "total") == pytest.approx(b["total"])
    assert incident_badput(Incident(attempt=1, detected_at=5.0))["total"] is None
