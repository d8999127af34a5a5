"""The trainer's restore reads every checkpoint layout the save side may choose, into the current sharding.

Layouts: orbax's defaults (zstd, one chunk per array) and the faster-to-restore one that
bench/bench_restore.py measures (no compression, small chunks). Local disk and the GCS emulator.
Each task's real training state, saved by the trainer's own checkpointer, comes back from the older
step when the newer one is damaged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from support.ckpt_factory import tiny_config, write_run_config
from support.trainer_harness import tiny_classifier_config, write_config
from support.trainer_harness import tiny_config as tiny_job

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import ExitCode
from recovery_steps import restore_latest
from trainer.checkpointing import Checkpointer

CHUNK = 64 * 1024
FLOATS = 100_000  # 400 KB: several 64 KiB chunks


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "params": {"w": rng.standard_normal(FLOATS).astype(np.float32), "b": np.full((4,), step, np.float32)},
        "opt": {"mu": rng.standard_normal((8, 16)).astype(np.float32)},
        "step": np.asarray(step, np.int32),
    }


def _save(store: RunStore, step: int, state: dict, layout: str) -> None:
    if layout == "default":
        handler, args = ocp.StandardCheckpointHandler(), ocp.args.StandardSave(state)
    else:
        handler = ocp.PyTreeCheckpointHandler(use_compression=False)
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK), state)
        args = ocp.args.PyTreeSave(state, save_args=save_args)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(
        store.url(RunLayout.CHECKPOINTS), options=options, item_handlers={"state": handler}
    ) as mgr:
        mgr.save(step, args=ocp.args.Composite(state=args))
        mgr.wait_until_finished()


@pytest.mark.parametrize("layout", ["default", "uncompressed-chunked"])
def test_restore_state_reads_the_layout_into_the_target_sharding(store_root, layout):
    cfg = tiny_config()
    store = RunStore(store_root, cfg.run_id)
    write_run_config(store, cfg)
    saved = _state(7)
    _save(store, 7, saved, layout)

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), saved)
    ckpt = Checkpointer(store, cfg, attempt=0, mesh_shape={"data": len(jax.devices())})
    try:
        chunks = ckpt.mgr.item_metadata(7)["state"]["params"]["w"].storage.chunk_shape
        got = ckpt.restore_state(7, target)
    finally:
        ckpt.close()

    if layout == "default":
        assert chunks == (FLOATS,)
    else:
        assert chunks[0] * 4 <= CHUNK < FLOATS * 4
    for path, want in jax.tree_util.tree_leaves_with_path(saved):
        have = got
        for key in path:
            have = have[key.key]
        assert isinstance(have, jax.Array), path
        assert have.sharding == replicated, path
        np.testing.assert_array_equal(np.asarray(have), want, err_msg=str(path))


def _train_and_save(cfg, steps: tuple[int, ...]) -> tuple[Checkpointer, object, dict[int, list[np.ndarray]]]:
    """Train ``cfg``'s task in this process, saving at ``steps`` with the trainer's checkpointer.

    Returns the checkpointer, the abstract state (target of a restore) and each saved step's leaves on the host.
    """
    from trainer import data as data_lib
    from trainer import train_state

    spec = cfg.task.spec()
    task = spec.build(cfg.task_options())
    source = data_lib.open_source(task, cfg.data)
    tr = train_state.build(cfg, train_state.make_mesh(), task)
    ckpt = Checkpointer(RunStore.for_config(cfg), cfg, attempt=0, mesh_shape={"data": len(jax.devices())})
    state = tr.init_fn(jnp.asarray(cfg.training.seed, jnp.int32))
    it = data_lib.make_iterator(cfg.data, source.examples, data_lib.DataPosition(cfg.data.seed, 0, 0), 0, 1)
    saved = {}
    for step in range(1, max(steps) + 1):
        batch = train_state.global_batch(tr, next(it), 1)
        state, _, _ = tr.step_fn(state, batch, train_state.stop_flags(tr, False))
        if step in steps:
            saved[step] = [np.asarray(x) for x in jax.tree.leaves(state)]  # before the next step donates it
            ckpt.save(step, state, it)
            ckpt.finish_pending()
    return ckpt, tr.abstract_state, saved


# Slow: it compiles each task's step. One root: verification on gs:// is tests/test_restore.py's business.
@pytest.mark.slow
@pytest.mark.parametrize("make", [tiny_job, tiny_classifier_config], ids=["lm", "image-classifier"])
def test_each_tasks_state_comes_back_from_the_older_step_when_the_newer_is_damaged(tmp_path, make):
    cfg = make(
        str(tmp_path / "store"),
        run_id="task-restore",
        hosts=1,
        training={"total_steps": 4},
        checkpoint={"interval_steps": 2, "async_save": False},
    )
    store = write_config(cfg)
    ckpt, abstract, saved = _train_and_save(cfg, (2, 4))
    try:
        objs = [o for o in store.list(RunLayout.checkpoint(4)) if "/state/" in o.name and "/d/" in o.name]
        name = max(objs, key=lambda o: o.size).name
        data = bytearray(store.read_bytes(name) or b"")
        data[len(data) // 2] ^= 0xFF
        store.write_bytes(name, bytes(data))

        r = restore_latest.run(store, 1)
        assert r.code == ExitCode.OK and r.selection.step == 2, r
        [skip] = r.selection.skipped
        assert skip.step == 4 and "CRC32C" in skip.reason, skip
        assert "4" in store.children(RunLayout.QUARANTINE)

        got = ckpt.restore_state(2, abstract)
    finally:
        ckpt.close()
    leaves = jax.tree.leaves(got)
    assert len(leaves) == len(saved[2])
    if make is tiny_classifier_config:
        assert "extra" in got  # the batch-norm statistics came back with the parameters
    for have, want in zip(leaves, saved[2], strict=True):
        np.testing.assert_array_equal(np.asarray(have), want)
    assert any(not np.array_equal(a, b) for a, b in zip(saved[2], saved[4], strict=True))
