"""Writes real orbax checkpoints into a run store the way the trainer does, for restore and verify tests."""

from __future__ import annotations

import time
from typing import Any

from jaxrec.adapters.checkpoints import write_manifest
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import JobConfig, load_config
from jaxrec.model.records import CheckpointManifest, RestoreRecord


def tiny_config(**overrides: Any) -> JobConfig:
    """The local CPU config (optionally with a different run id)."""
    cfg = load_config("configs/local-cpu.yaml")
    return cfg.model_copy(update=overrides) if overrides else cfg


def write_run_config(store: RunStore, cfg: JobConfig) -> None:
    """Write ``config.json`` as validate-config does."""
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})


def write_checkpoint(
    store: RunStore,
    cfg: JobConfig,
    step: int,
    *,
    attempt: int = 0,
    floats: int = 1000,
    config: dict[str, Any] | None = None,
    process_count: int | None = None,
    wall_time: float | None = None,
    manifest: bool = True,
) -> dict[str, Any]:
    """Save one step with an orbax CheckpointManager (items ``state`` and ``data``) and write its manifest.

    Returns the saved state (numpy arrays) so that a test can compare a restore with it.
    """
    import numpy as np
    import orbax.checkpoint as ocp

    rng = np.random.default_rng(step)
    state = {
        "params": {"w": rng.standard_normal(floats).astype(np.float32), "b": np.full((4,), step, np.float32)},
        "step": np.asarray(step, np.int32),
    }
    options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(store.url(RunLayout.CHECKPOINTS), options=options) as mgr:
        mgr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"position": step * 16})
            ),
        )
        mgr.wait_until_finished()
    if manifest:
        cfg_dict = config if config is not None else cfg.model_dump(mode="json")
        write_manifest(
            store,
            CheckpointManifest(
                step=step,
                run_id=cfg.run_id,
                attempt=attempt,
                config_hash=cfg.config_hash() if config is None else "other",
                config=cfg_dict,
                code_version="test",
                dataset_version=cfg_dict["data"]["dataset_version"],
                process_count=process_count if process_count is not None else cfg.slice.num_hosts,
                mesh_shape={"data": cfg.slice.num_hosts},
                library_versions={"orbax-checkpoint": ocp.__version__},
                wall_time=wall_time if wall_time is not None else time.time(),
            ),
        )
    return state


def restore_record(store, attempt: int, step: int) -> None:
    """What restore-latest records for ``attempt`` when it chose ``step`` (-1: fresh start)."""
    path = store.url(RunLayout.checkpoint(step)) if step >= 0 else ""
    rec = RestoreRecord(
        attempt=attempt,
        run_id=store.run_id,
        config_hash="test",
        exit_code=0,
        restore_step=step,
        restore_path=path,
        decided_at=0.0,
    )
    store.write_record(RunLayout.restore_record(attempt), rec)
