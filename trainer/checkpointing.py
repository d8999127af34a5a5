"""Checkpoints as transactions: orbax saves (async or sync), then the primary host writes the manifest."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from recovery_steps.checkpoints import write_manifest
from recovery_steps.config import JobConfig
from recovery_steps.records import CheckpointManifest
from recovery_steps.store import RunLayout, RunStore

log = logging.getLogger(__name__)

_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore")


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries that shape a checkpoint."""
    out = {}
    for name in _LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def code_version() -> str:
    """Package version, plus the git commit of the source tree when it is a checkout."""
    try:
        version = importlib.metadata.version("jax-slice-recovery")
    except importlib.metadata.PackageNotFoundError:
        version = "0+unknown"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{version}+g{sha}" if sha else version


@dataclass
class PendingSave:
    """A save orbax has started but the manifest has not recorded yet."""

    step: int
    started: float
    attempt: int


class Checkpointer:
    """An orbax CheckpointManager at ``checkpoints/`` plus the manifest step of the transaction."""

    def __init__(self, store: RunStore, cfg: JobConfig, attempt: int, mesh_shape: dict[str, int]):
        self.store = store
        self.cfg = cfg
        self.attempt = attempt
        self.mesh_shape = mesh_shape
        self.primary = jax.process_index() == 0
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.keep,
            enable_async_checkpointing=cfg.checkpoint.async_save,
            create=True,
        )
        self.mgr = ocp.CheckpointManager(
            store.url(RunLayout.CHECKPOINTS),
            options=opts,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler()},
        )
        self.pending: PendingSave | None = None
        self.last_committed: int | None = None
        self.last_commit_time: float | None = None
        self.last_duration: float | None = None
        self._code_version = code_version() if self.primary else ""
        self._libs = library_versions()

    def steps(self) -> list[int]:
        """Committed steps orbax lists."""
        return list(self.mgr.all_steps())

    def save(self, step: int, state: Any, data_iter: Any) -> None:
        """Start saving ``step`` (after recording the previous save, which orbax would wait for anyway)."""
        self.finish_pending()
        self.pending = PendingSave(step, time.time(), self.attempt)
        self.mgr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iter)
            ),
            force=True,
        )

    def poll(self) -> int | None:
        """Record a save that has committed since the last call; return its step (None: nothing new)."""
        if self.pending is None or self.mgr.is_saving_in_progress():
            return None
        return self.finish_pending()

    def finish_pending(self) -> int | None:
        """Wait for the save in flight to commit, then write its manifest (primary host). Returns its step."""
        if self.pending is None:
            return None
        self.mgr.wait_until_finished()
        p, self.pending = self.pending, None
        if self.primary and p.step not in self.mgr.all_steps():
            raise RuntimeError(f"checkpoint of step {p.step} was not committed")
        duration = time.time() - p.started
        if self.primary:
            write_manifest(self.store, self.manifest(p.step, duration))
        self.last_committed, self.last_commit_time, self.last_duration = p.step, time.time(), duration
        log.info("checkpoint %d committed in %.2f s", p.step, duration)
        return p.step

    def manifest(self, step: int, save_seconds: float) -> CheckpointManifest:
        """The manifest of ``step`` as this worker knows it (files are listed by write_manifest)."""
        return CheckpointManifest(
            step=step,
            run_id=self.cfg.run_id,
            attempt=self.attempt,
            config_hash=self.cfg.config_hash(),
            config=self.cfg.model_dump(mode="json"),
            code_version=self._code_version,
            dataset_version=self.cfg.data.dataset_version,
            process_count=jax.process_count(),
            mesh_shape=self.mesh_shape,
            library_versions=self._libs,
            wall_time=time.time(),
            save_seconds=save_seconds,
        )

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """Restore the ``state`` item of ``step`` into the shardings of ``abstract_state``."""
        got = self.mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        return got["state"]

    def restore_data(self, step: int, data_iter: Any) -> Any:
        """Restore this process's data-iterator state of ``step`` into ``data_iter``."""
        got = self.mgr.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(data_iter)))
        return got["data"]

    def close(self) -> None:
        """Wait for background work and release the manager."""
        self.mgr.close()
