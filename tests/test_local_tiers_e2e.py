"""End to end: the local and peer checkpoint tiers, rehearsed with host faults, each run equal to an uninterrupted one.

Two runs, each a chain of failures (one attempt per fault): GCS every 5 steps, local every 2, each part copied to
the next host. The kills come one step after a local save that is newer than the newest GCS step (7, 13, 19),
once that save's parts and their peer copies have landed (the injector waits for their events; steps are paced,
0.2 s, so that the gang is not far past the step by then).
"""

from __future__ import annotations

import pytest
from support.local_job import reference_digest, shrunken_workflow

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import TierRecord
from workflows import local

pytestmark = pytest.mark.slow

TIERS = {"interval_steps": 2, "keep": 2, "peers": 1}


def _job(tmp_path_factory, hosts: int):
    d = tmp_path_factory.mktemp(f"tiers{hosts}")
    root = str(d / "store")
    batch = {"global_batch_size": 4 * hosts}
    wf = shrunken_workflow(
        d, f"tiers{hosts}", store_root=root, local_tier=TIERS, hosts=hosts, data_section=batch, step_delay_s=0.2
    )
    # The same model, data and gang, neither paced nor saving to the hosts (neither changes a parameter).
    plain = shrunken_workflow(d, f"tiers{hosts}-plain", store_root=root, hosts=hosts, data_section=batch)
    return wf, root, reference_digest(plain, root)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    return _job(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def three_hosts(tmp_path_factory):
    return _job(tmp_path_factory, 3)


def _assert_lost(incidents, want: dict[int, tuple[int, int]], text: str) -> None:
    """Each attempt's failure, injected once step ``s`` was reported, restored ``restored``: the steps lost are the
    steps the gang had computed past it. The loop dispatches a step before the previous one's hooks run, so the gang
    may have finished step ``s + 1`` when the kill lands (its survivors report it)."""
    for attempt, (s, restored) in want.items():
        inc = incidents[attempt]
        assert inc.pre_failure_step in (s, s + 1) and inc.restored_step == restored, text
        assert inc.steps_lost == inc.pre_failure_step - restored, text


def _run(job, run_id: str, inject: list[str]):
    wf, root, reference = job
    lines: list[str] = []
    res = local.run(
        wf,
        local.LocalRunOptions(
            inject=inject, run_id=run_id, store_root=root, reference_digest=reference, metrics_port=0
        ),
        say=lines.append,
    )
    text = "\n".join(lines)
    assert res.status == "Succeeded", text
    assert res.params_digest == reference, text
    store = RunStore(root, run_id)
    tiers = {a: store.read_record(RunLayout.tier_record(a), TierRecord) for a in store.attempts()}
    return res, tiers, text


def test_kill_swap_and_corrupt_restore_from_the_hosts_and_match_the_uninterrupted_run(two_hosts):
    res, tiers, text = _run(two_hosts, "chain2", ["swap-hosts@7", "corrupt-local@13", "kill-worker@19"])
    assert sorted(tiers) == [0, 1, 2, 3], text
    assert tiers[0] is not None and tiers[0].step == -1  # the fresh start asked the hosts too: nothing there
    # swap-hosts: each worker's part is on the node it now runs on (as the copy its peer took) or on the other one.
    assert tiers[1].tier in ("local", "peer") and tiers[1].step == 6 > tiers[1].gcs_step, tiers[1]
    # corrupt-local: the damaged own copy is refused on load, then its peer copy is used.
    t = tiers[2]
    assert t.step == 12 and t.rounds == 2 and t.tier == "peer", t
    assert len(t.refused) == 1 and "part 1" in t.refused[0] and "checksum mismatch" in t.refused[0], t
    assert [p.tier for p in t.parts] == ["local", "peer"], t
    # A plain kill: every disk intact, every part from its own host.
    assert tiers[3].tier == "local" and tiers[3].step == 18, tiers[3]
    incidents = {i.attempt: i for i in res.incidents}
    assert [incidents[a].restore_tier for a in (0, 1, 2)] == [tiers[1].tier, "peer", "local"], text
    _assert_lost(incidents, {0: (7, 6), 1: (13, 12), 2: (19, 18)}, text)
    assert " peer " in text and " local " in text  # the incident table's tier column


def test_lost_hosts_fall_back_to_a_peer_then_to_gcs_and_match_the_uninterrupted_run(three_hosts):
    res, tiers, text = _run(three_hosts, "chain3", ["lose-host@7", "lose-two-hosts@13", "lose-slice@19"])
    # lose-host: worker 2's disk is gone; the copy its peer (worker 0's host) took serves it.
    t = tiers[1]
    assert t.step == 6 and t.tier == "peer" and [p.tier for p in t.parts] == ["local", "local", "peer"], t
    # lose-two-hosts: part 1 had its own copy and its only peer copy on the two lost hosts: GCS, for every part.
    t = tiers[2]
    assert t.tier == "gcs" and t.step == t.gcs_step == 10, t
    assert any(s.step == 12 and "part 1" in s.reason for s in t.skipped), t
    # lose-slice: no host of the slice is left: GCS.
    t = tiers[3]
    assert t.tier == "gcs" and t.step == t.gcs_step == 15, t
    _assert_lost({i.attempt: i for i in res.incidents}, {0: (7, 6), 1: (13, 10), 2: (19, 15)}, text)
