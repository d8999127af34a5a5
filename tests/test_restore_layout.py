"""The trainer's restore reads every checkpoint layout the save side may choose, into the current sharding.

Layouts: orbax's defaults (zstd, one chunk per array) and the faster-to-restore one that
bench/bench_restore.py measures (no compression, small chunks). Local disk and the GCS emulator.
"""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from ckpt_factory import tiny_config, write_run_config

from recovery_steps.kernel.store import RunLayout, RunStore
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
