"""The pure half of restore-latest: judge and select_restore_step over plain candidate records."""

from __future__ import annotations

import pytest

from jaxrec.adapters.verify import CandidateInfo, SkipKind, judge, select_restore_step


def good(step: int, **kw) -> CandidateInfo:
    base = dict(
        name=str(step),
        step=step,
        on_gcs=False,
        file_count=12,
        committed=True,
        manifest_attempt=0,
        manifest_wall_time=1000.0,
        file_problems=(),
    )
    return CandidateInfo(**{**base, **kw})


CASES = [
    # (candidate, closed_at, expected kind or None, quarantined)
    (good(10), {}, None, False),
    (good(10, file_problems=None), {}, None, False),
    (good(10, name="10.orbax-checkpoint-tmp-5", temporary=True), {}, SkipKind.TEMPORARY, False),
    (good(10, file_count=0), {}, SkipKind.EMPTY, True),
    (good(10, file_count=0, on_gcs=True), {}, SkipKind.EMPTY, False),
    (good(10, committed=False), {}, SkipKind.UNCOMMITTED, True),
    (good(10, committed=False, on_gcs=True), {}, SkipKind.UNCOMMITTED, False),
    (good(10, manifest_problem="no manifest.json"), {}, SkipKind.MANIFEST, True),
    (good(10, manifest_attempt=2, manifest_wall_time=50.0), {2: 40.0}, SkipKind.CLOSED_ATTEMPT, True),
    (good(10, manifest_attempt=2, manifest_wall_time=30.0), {2: 40.0}, None, False),
    (good(10, manifest_attempt=3, manifest_wall_time=50.0), {2: 40.0}, None, False),
    (good(10, compat_problems=("model.d_model: 64 -> 128",)), {}, SkipKind.INCOMPATIBLE, True),
    (good(10, file_problems=("a is missing",)), {}, SkipKind.FILES, True),
    (CandidateInfo(name="notes", step=None, on_gcs=False), {}, SkipKind.NOT_A_STEP, False),
]


@pytest.mark.parametrize(("cand", "closed", "kind", "quarantine"), CASES)
def test_judge(cand, closed, kind, quarantine):
    verdict = judge(cand, closed)
    if kind is None:
        assert verdict is None
    else:
        assert verdict.kind is kind and verdict.quarantine is quarantine and verdict.reason


def test_first_failing_check_names_the_reason():
    # Uncommitted wins over a bad manifest; the ledger wins over compatibility.
    assert judge(good(1, committed=False, manifest_problem="x"), {}).kind is SkipKind.UNCOMMITTED
    c = good(1, manifest_attempt=1, manifest_wall_time=9.0, compat_problems=("x",))
    assert judge(c, {1: 5.0}).kind is SkipKind.CLOSED_ATTEMPT


def test_selects_newest_good_and_lists_newer_skips_newest_first():
    cands = [
        good(10),
        good(30, file_problems=("x is missing",)),
        good(20),
        good(40, name="40.orbax-checkpoint-tmp-1", temporary=True),
    ]
    sel = select_restore_step(cands, {})
    assert (sel.step, sel.name) == (20, "20")
    assert [(s.name, s.kind) for s in sel.skipped] == [
        ("40.orbax-checkpoint-tmp-1", SkipKind.TEMPORARY),
        ("30", SkipKind.FILES),
    ]
    assert not sel.incompatible


def test_numeric_not_lexical_order():
    assert select_restore_step([good(9), good(100), good(20)], {}).step == 100


def test_nothing_is_a_fresh_start():
    sel = select_restore_step([], {})
    assert (sel.step, sel.skipped, sel.incompatible) == (-1, [], False)


def test_only_damaged_is_a_fresh_start_not_a_stop():
    sel = select_restore_step([good(10, manifest_problem="garbled"), good(20, committed=False)], {})
    assert sel.step == -1 and not sel.incompatible and len(sel.skipped) == 2


def test_incompatible_and_nothing_restorable_is_a_stop():
    sel = select_restore_step([good(10, compat_problems=("x",)), good(20, file_problems=("y",))], {})
    assert sel.step == -1 and sel.incompatible


def test_incompatible_newer_but_good_older_restores_the_older():
    sel = select_restore_step([good(10), good(20, compat_problems=("x",))], {})
    assert sel.step == 10 and not sel.incompatible
