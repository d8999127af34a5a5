"""The restore decision across tiers: newest step every part of which has a verified copy, nearest copy first."""

from __future__ import annotations

import pytest

from jaxrec.model.tiers import GcsStep, PartCopy, Tier, TierPlan, TierSkip, choose_restore

L, P, G = Tier.LOCAL, Tier.PEER, Tier.GCS
HOME = {0: "n0", 1: "n1", 2: "n2", 3: "n3"}  # part (process index) -> the node it runs on now


def replicated(step: int, parts=range(4), *, lost_nodes=(), bad=()) -> list[PartCopy]:
    """Each part on its own node and on the next node (the peer copy), minus lost nodes, ``bad`` unverified."""
    out = []
    for p in parts:
        for node in (f"n{p}", f"n{(p + 1) % 4}"):
            if node in lost_nodes:
                continue
            ok = (p, node) not in bad
            out.append(PartCopy(step, p, node, verified=ok, problem="" if ok else "crc32c mismatch"))
    return out


CASES = [
    # name, placement, copies, gcs steps, max_step -> step, tiers of parts 0..3
    ("kill-worker: every disk intact", HOME, replicated(20), [GcsStep(10)], None, 20, [L, L, L, L]),
    (
        "lose-host: part 1 from its peer",
        HOME,
        replicated(20, lost_nodes=["n1"]),
        [GcsStep(10)],
        None,
        20,
        [L, P, L, L],
    ),  # n1 also held part 0's peer copy: part 0's own copy on n0 is enough
    (
        "lose-two-hosts: part 1 has no copy left",
        HOME,
        replicated(20, lost_nodes=["n1", "n2"]),
        [GcsStep(10)],
        None,
        10,
        [G, G, G, G],
    ),
    (
        "corrupt-local: the damaged own copy is refused",
        HOME,
        replicated(20, bad=[(2, "n2")]),
        [GcsStep(10)],
        None,
        20,
        [L, L, P, L],
    ),
    (
        "swap-hosts: each reads its part from the other",
        {0: "n1", 1: "n0", 2: "n2", 3: "n3"},
        [PartCopy(20, 0, "n0"), PartCopy(20, 1, "n1"), PartCopy(20, 2, "n2"), PartCopy(20, 3, "n3")],
        [],
        None,
        20,
        [P, P, L, L],
    ),
    (
        "whole slice lost: new nodes, GCS",
        {0: "m0", 1: "m1", 2: "m2", 3: "m3"},
        replicated(20),
        [GcsStep(10)],
        None,
        10,
        [G, G, G, G],
    ),
    ("a newer GCS step wins over older local copies", HOME, replicated(20), [GcsStep(30)], None, 30, [G, G, G, G]),
    (
        "the local step is used when the bucket's copy of it is damaged",
        HOME,
        replicated(20),
        [GcsStep(20, verified=False, problem="size 10 != 12"), GcsStep(10)],
        None,
        20,
        [L, L, L, L],
    ),
    (
        "a part with no local copy sends every part to the GCS copy of the same step",
        HOME,
        replicated(20, parts=[0, 1, 2]),
        [GcsStep(20)],
        None,
        20,
        [G, G, G, G],
    ),
    ("steps beyond total_steps are not restored", HOME, replicated(20) + replicated(30), [], 25, 20, [L, L, L, L]),
]


@pytest.mark.parametrize(
    ("name", "placement", "copies", "gcs", "max_step", "step", "tiers"), CASES, ids=[c[0] for c in CASES]
)
def test_choose_restore(name, placement, copies, gcs, max_step, step, tiers):
    plan = choose_restore(placement, copies, gcs, max_step=max_step)
    assert plan.step == step
    assert [plan.tier_of(p) for p in sorted(placement)] == tiers


def test_never_a_step_newer_than_the_newest_complete_one():
    # Step 30 has no part 3 anywhere (part 0 survives on its peer n1): 20, complete locally, is restored.
    copies = replicated(30, parts=[0, 1, 2], lost_nodes=["n3", "n0"]) + replicated(20)
    plan = choose_restore(HOME, copies, [GcsStep(10)])
    assert plan.step == 20
    [skip] = plan.skipped
    assert skip.step == 30
    assert skip.reason == "no verified copy of part 3 (no local copy; not in the bucket)"


def test_each_skip_says_why_each_copy_did_not_count():
    copies = [
        PartCopy(20, 0, "n0"),
        PartCopy(20, 1, "n1", verified=False, problem="crc32c mismatch"),
        PartCopy(20, 1, "old-node"),  # the copy a replaced node held: gone with it
    ]
    plan = choose_restore({0: "n0", 1: "n1"}, copies, [GcsStep(20, verified=False, problem="generation changed")])
    assert plan == TierPlan(
        None,
        (),
        (
            TierSkip(
                20,
                "no verified copy of part 1 (on node n1: crc32c mismatch; on node old-node, not in this "
                "slice; bucket: generation changed)",
            ),
        ),
    )


def test_peer_sources_are_chosen_the_same_way_every_time():
    copies = [
        PartCopy(20, 0, "n3"),
        PartCopy(20, 0, "n2"),
        PartCopy(20, 1, "n1"),
        PartCopy(20, 2, "n2"),
        PartCopy(20, 3, "n3"),
    ]
    plans = {choose_restore({0: "n0", 1: "n1", 2: "n2", 3: "n3"}, order, []) for order in (copies, copies[::-1])}
    [plan] = plans
    assert [(s.part, s.tier, s.node) for s in plan.sources][:2] == [(0, P, "n2"), (1, L, "n1")]


def test_a_part_count_per_tier_for_the_attempt_record():
    plan = choose_restore(HOME, replicated(20, lost_nodes=["n1"]), [GcsStep(10)])
    assert plan.parts_by_tier == {L: 3, P: 1}


def test_nothing_restorable():
    assert choose_restore(HOME, [], []) == TierPlan(None)


def test_one_part_from_gcs_sends_every_part_there_and_says_which_part_forced_it():
    plan = choose_restore(HOME, replicated(20, parts=[0, 1, 2]), [GcsStep(20)])
    assert plan.tier is G and plan.parts_by_tier == {G: 4}
    assert "part 3 of step 20" in plan.note


def test_the_plan_names_its_farthest_tier():
    assert choose_restore(HOME, replicated(20), []).tier is L
    assert choose_restore(HOME, replicated(20, lost_nodes=["n1"]), []).tier is P
    assert TierPlan(None).tier is None
