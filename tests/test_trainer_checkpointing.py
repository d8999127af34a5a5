"""The checkpoint transaction in one process: orbax commit, then the manifest from the background writer."""

from __future__ import annotations

import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.trainer_harness import lm_examples, tiny_config

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import CheckpointManifest
from trainer import checkpointing
from trainer import data as data_lib
from trainer.checkpointing import Checkpointer, device_copy_fits


@pytest.fixture
def setup(tmp_path):
    cfg = tiny_config(str(tmp_path / "store"), run_id="ckpt-unit", hosts=1, checkpoint={"keep": 5})
    store = RunStore.for_config(cfg)
    ckpt = Checkpointer(store, cfg, attempt=0, mesh_shape={"data": 1})
    it = data_lib.make_iterator(cfg.data, lm_examples(cfg), data_lib.DataPosition(cfg.data.seed, 0, 0), 0, 1)
    yield cfg, store, ckpt, it
    ckpt.close()


def state_at(step: int) -> dict:
    return {"w": jnp.full((4, 8), float(step)), "step": jnp.asarray(step, jnp.int32)}


def manifest_of(store: RunStore, step: int) -> CheckpointManifest | None:
    raw = store.read_json(RunLayout.checkpoint_manifest(step))
    return None if raw is None else CheckpointManifest.model_validate(raw)


def test_poll_reports_a_step_only_with_its_manifest(setup):
    _, store, ckpt, it = setup
    for _ in range(3):
        next(it)
    ckpt.save(3, state_at(3), it)
    assert ckpt.pending is not None and ckpt.pending.blocking >= 0
    got, deadline = None, time.monotonic() + 60
    while got is None and time.monotonic() < deadline:
        got = ckpt.poll()
        if got is None:
            assert ckpt.last_committed is None
            time.sleep(0.01)
    assert got == 3 and ckpt.last_committed == 3 and ckpt.pending is None
    m = manifest_of(store, 3)
    assert m is not None and m.step == 3
    paths = {f.path for f in m.files}
    assert "data/process_0-of-1.json" in paths
    assert any(p.startswith("state/") for p in paths)
    assert ckpt.last_blocking is not None and ckpt.last_duration >= ckpt.last_blocking
    assert ckpt.poll() is None


def test_a_save_s_blocking_time_counts_the_loop_s_wait_for_its_commit(setup, monkeypatch):
    """The loop that waits for a save in flight (the next save, the end) does not step: that wait is the save's
    cost too, in its blocking_seconds and its parts, not only the start that hands it to the saver thread."""
    _, _, ckpt, it = setup
    slow = ckpt.mgr.save

    def slowed(*a, **k):
        time.sleep(0.5)
        return slow(*a, **k)

    monkeypatch.setattr(ckpt.mgr, "save", slowed)
    next(it)
    ckpt.save(1, state_at(1), it)
    started = ckpt.pending.blocking
    assert ckpt.finish_pending() == 1
    waited = ckpt.last_parts[checkpointing.COMMIT_WAIT_PART]
    assert waited >= 0.4 and ckpt.last_blocking == pytest.approx(started + waited)


def test_next_save_and_finish_wait_for_the_previous_manifest(setup):
    _, store, ckpt, it = setup
    ckpt.save(1, state_at(1), it)
    ckpt.save(2, state_at(2), it)  # waits for step 1's commit and manifest first
    assert manifest_of(store, 1) is not None
    assert ckpt.last_committed == 1
    assert ckpt.finish_pending() == 2
    assert manifest_of(store, 2) is not None
    assert ckpt.finish_pending() is None
    assert ckpt.steps() == [1, 2]


def test_restore_gives_back_the_state_and_the_data_position(setup):
    cfg, _, ckpt, it = setup
    for _ in range(5):
        next(it)
    expected = next(it)  # the batch after the save
    it.set_state({"next_index": 5})
    ckpt.save(5, state_at(5), it)
    assert ckpt.finish_pending() == 5
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_at(0))
    got, saved_iter = ckpt.restore(5, abstract)  # state and data position in one orbax restore
    assert int(got["step"]) == 5 and float(got["w"][0, 0]) == 5.0
    assert saved_iter == {"next_index": 5}
    assert ckpt.restore(5, abstract, with_data=False)[1] is None
    fresh = data_lib.make_iterator(cfg.data, lm_examples(cfg), data_lib.DataPosition(cfg.data.seed, 0, 0), 0, 1)
    fresh.set_state(saved_iter)
    assert fresh.get_state()["next_index"] == 5
    np.testing.assert_array_equal(next(fresh), expected)


def test_a_manifest_the_store_cannot_take_leaves_the_step_incomplete_and_the_next_save_commits(setup, monkeypatch):
    """GCS answers 503 past the library's retries on one manifest write: that step is an incomplete transaction
    (never restored), the worker goes on training, and the next save commits."""
    from google.api_core.exceptions import ServiceUnavailable

    _, store, ckpt, it = setup
    create = RunStore.create_record

    def refused_once(self, rel, record):
        if rel == RunLayout.checkpoint_manifest(2):
            raise ServiceUnavailable("POST https://storage.googleapis.com/upload: 503 Backend Error")
        return create(self, rel, record)

    monkeypatch.setattr(RunStore, "create_record", refused_once)
    for step in (2, 4):
        for _ in range(2):
            next(it)
        ckpt.save(step, state_at(step), it)
        got = ckpt.finish_pending()
        assert got == (None if step == 2 else 4), step
    assert manifest_of(store, 2) is None and manifest_of(store, 4) is not None
    assert ckpt.last_committed == 4


class _Device:
    def __init__(self, limit: int | None, in_use: int):
        self.stats = None if limit is None else {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def _sharded(device, nbytes: int):
    return SimpleNamespace(addressable_shards=[SimpleNamespace(device=device, data=np.zeros(nbytes, np.uint8))])


def test_a_device_copy_fits_only_beside_what_is_in_use_and_what_the_step_needs():
    """The copy's bytes on each device + the device's bytes in use + the step's temporaries and code <= its limit;
    a device without a limit (the CPU) always fits."""
    dev = _Device(limit=10_000, in_use=4_000)
    state = {"params": _sharded(dev, 3_000), "opt": _sharded(dev, 1_000)}
    step = SimpleNamespace(memory_analysis=lambda: SimpleNamespace(temp_size_in_bytes=1_000,
                                                                   generated_code_size_in_bytes=0))  # fmt: skip
    assert device_copy_fits(state, step)  # 4,000 + 1,000 + 4,000 of 10,000
    big = SimpleNamespace(memory_analysis=lambda: SimpleNamespace(temp_size_in_bytes=2_500,
                                                                  generated_code_size_in_bytes=10))  # fmt: skip
    assert not device_copy_fits(state, big)  # 10,510 of 10,000
    assert device_copy_fits({"p": _sharded(_Device(limit=None, in_use=0), 10**9)}, big)
    assert device_copy_fits(state_at(1), None)  # this machine's devices


def test_where_no_device_copy_fits_the_save_copies_the_state_to_host_memory_the_next_step_may_donate(
    setup, monkeypatch, caplog
):
    """The copy is a dispatched transfer into the host's memory (unpinned where the device has it, the faster
    transfer on a TPU): the save returns before orbax has it, the step right after may donate the state, and the
    step restores with the values it had when it was taken."""
    cfg, store, ckpt, it = setup
    monkeypatch.setattr(checkpointing, "device_copy_fits", lambda *a: False)
    double = jax.jit(lambda s: jax.tree.map(lambda a: a * 2, s), donate_argnums=0)
    with caplog.at_level("WARNING", logger="trainer.checkpointing"):
        state = state_at(3)
        assert ckpt.copy_fits(state)
        taken = ckpt.capture(3, state, it)
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(taken.state)} == {"unpinned_host"}
        state = double(state)  # the live buffers are donated while the transfer may still be on its way
        ckpt.save(3, state, it, capture=taken)
    assert ckpt.finish_pending() == 3 and float(state["w"][0, 0]) == 6.0
    said = [r.getMessage() for r in caplog.records if "does not fit in device memory" in r.getMessage()]
    assert len(said) == 1 and "the host's memory" in said[0], said
    restored = Checkpointer(store, cfg, attempt=1, mesh_shape={"data": 1})
    try:
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        got = restored.restore_state(3, target)
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(got)} == {"device"}
        assert float(got["w"][0, 0]) == 3.0 and int(got["step"]) == 3
    finally:
        restored.close()


def test_where_no_copy_fits_anywhere_the_save_reads_the_live_state_and_returns_once_it_is_on_the_host(
    setup, monkeypatch, caplog
):
    """The next step donates the live state: the loop waits for orbax's host copy of it (counted in the save's
    blocking time), says so once, and the step commits as any other."""
    _, store, ckpt, it = setup
    monkeypatch.setattr(checkpointing, "device_copy_fits", lambda *a: False)
    monkeypatch.setattr(checkpointing, "host_copy", lambda state: None)
    with caplog.at_level("WARNING", logger="trainer.checkpointing"):
        for step in (1, 2):
            next(it)
            ckpt.save(step, state_at(step), it)
            assert ckpt.pending.writing.is_set(), "save returned before orbax had the state on the host"
            assert ckpt.pending.blocking >= ckpt.pending.parts["hand-off to the saver thread"]
    assert ckpt.finish_pending() == 2 and manifest_of(store, 2) is not None
    said = [r.getMessage() for r in caplog.records if "does not fit in device memory" in r.getMessage()]
    assert len(said) == 1 and "holds the loop" in said[0], said


def test_a_step_whose_commit_marker_the_store_refuses_past_its_retries_is_incomplete_and_the_next_commits(
    gcs_emulator, gcs_bucket, monkeypatch, request
):
    """GCS answers 503 to step 2's commit marker (orbax writes it through gcsfs, whose back-off is shortened here)
    past gcsfs's own retries: step 2 is an incomplete transaction, never counted and without a manifest; the worker
    goes on, and step 4 commits with its manifest. A failure that is not the store's still ends the worker, and
    orbax's host copy releases the loop before the commit, as before."""
    import gcsfs.retry

    from workflows.local.outage import OutageProxy

    async def at_once(_seconds):
        return None

    proxy = OutageProxy(gcs_emulator.url)
    try:
        for k, v in proxy.env(gcs_emulator.env).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(gcsfs.retry, "asyncio", SimpleNamespace(sleep=at_once))
        root = f"gs://{gcs_bucket}/{request.node.name}"
        cfg = tiny_config(root, run_id="ckpt-marker", hosts=1, checkpoint={"keep": 5})
        store = RunStore.for_config(cfg)
        ckpt = Checkpointer(store, cfg, attempt=0, mesh_shape={"data": 1})
        it = data_lib.make_iterator(cfg.data, lm_examples(cfg), data_lib.DataPosition(cfg.data.seed, 0, 0), 0, 1)
        try:
            proxy.fail_matching("checkpoints/2/commit_success.txt", 600)
            for step in (2, 4):
                for _ in range(2):
                    next(it)
                ckpt.save(step, state_at(step), it)
                assert ckpt.finish_pending() == (None if step == 2 else 4), step
            assert proxy.refused >= 6  # gcsfs asked six times
            assert manifest_of(store, 2) is None and manifest_of(store, 4) is not None
            assert ckpt.last_committed == 4 and ckpt.steps() == [4]
            # orbax's host copy releases the loop (and the next copy) before the commit, not after it.
            proxy.hold_matching("checkpoints/6/commit_success.txt", 60)
            ckpt.save(6, state_at(6), it)
            ckpt.wait_until_writing(30)
            assert ckpt.pending.writing.is_set() and not ckpt.pending.done.done()
            proxy.release()
            assert ckpt.finish_pending() == 6

            def broken(*a, **kw):
                raise TypeError("a bug in a handler")

            monkeypatch.setattr(ckpt.mgr, "save", broken)
            ckpt.save(8, state_at(8), it)
            with pytest.raises(TypeError):
                ckpt.finish_pending()
        finally:
            ckpt.close()
    finally:
        proxy.close()


def test_a_save_failed_on_the_store_is_told_from_a_bug_and_from_a_peer_missing_at_orbaxs_barrier():
    """What ends a save as an incomplete step is the store's answer past its clients' retries, anywhere in the
    chain; orbax's barrier timing out (a TimeoutError, as a store timeout is) is a peer gone, and a bug is a bug."""
    import gcsfs.retry

    def chained(outer: BaseException, inner: BaseException) -> BaseException:
        outer.__cause__ = inner
        return outer

    assert checkpointing.failed_on_the_store(chained(RuntimeError("save failed"), gcsfs.retry.HttpError({"code": 503})))
    assert checkpointing.failed_on_the_store(ValueError("UNAVAILABLE: HTTP response code: 503 with body: ..."))
    assert checkpointing.failed_on_the_store(ConnectionResetError("connection reset by peer"))
    assert not checkpointing.failed_on_the_store(gcsfs.retry.HttpError({"code": 403, "message": "Forbidden"}))
    assert not checkpointing.failed_on_the_store(TypeError("a bug in a handler"))
    barrier = chained(TimeoutError("Timed out while waiting for async_write_complete barrier."), RuntimeError("x"))
    assert not checkpointing.failed_on_the_store(barrier)
