"""Checkpoints as transactions: orbax saves (async or sync), then the primary host writes the manifest."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata
import json
import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from recovery_steps.kernel.checkpoints import write_manifest
from recovery_steps.kernel.config import JobConfig
from recovery_steps.kernel.records import CheckpointManifest
from recovery_steps.kernel.store import RunLayout, RunStore

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


# Replicated arrays smaller than this per replica are written whole by one replica: slicing them across
# replicas costs one dispatched device op per array and slice on the training thread, for nothing.
_MIN_REPLICA_PARALLEL_BYTES = 4 << 20

# Arrays are stored uncompressed in chunks of this size: zstd saves ~7 % on float weights but is
# decompressed on one thread at restore, and one chunk per array stops tensorstore from reading a
# large array in parallel ranges (bench/bench_restore.py measures both layouts).
_CHUNK_BYTES = 4 << 20


def configure_orbax() -> None:
    """Make orbax's blocking part of a save cheap (idempotent; call before building a manager).

    * Barriers go through the coordination service (a key-value barrier) instead of a compiled
      all-gather over every device: no compilation on the first save, no collective on the
      training thread.
    * Replicated arrays are split across replicas only when each slice is large.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():  # orbax reads its flag only once absl flags count as parsed
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True
    ocp.args.register_with_handler(DataIteratorHandler, for_save=True)(DataSave)
    ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)(DataRestore)
    try:
        from orbax.checkpoint._src.metadata import array_metadata_store
    except ImportError:  # another orbax layout: keep its default array handler
        return
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=_MIN_REPLICA_PARALLEL_BYTES,
    )
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


def _save_args(state: Any) -> Any:
    """Per-array save options: uncompressed, chunked (see ``_CHUNK_BYTES``)."""
    return jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES), state)


class DataIteratorHandler(grain.checkpoint.CheckpointHandler, ocp.AsyncCheckpointHandler):
    """grain's iterator handler (same files, same restore) whose save writes in the background.

    The iterator's state is captured on the calling thread (the iterator moves on right after);
    the per-process JSON file is written by a commit future once orbax has created the item's
    directory, so an asynchronous save does not wait for a store round trip on the training thread.
    """

    async def async_save(self, directory: Any, item: Any = None, args: Any = None) -> list[Any]:
        """Capture the iterator state now; write ``process_<i>-of-<n>.json`` in the background."""
        item = item or args.item
        state = json.dumps(item.get_state(), indent=4)
        path = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

        async def write() -> None:
            await asyncio.to_thread(path.write_text, state)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="data_iterator_save")]

    def save(self, directory: Any, item: Any = None, args: Any = None) -> None:
        """Synchronous save (grain's)."""
        super().save(directory, item=item, args=args)


@dataclass
class DataSave(ocp.args.CheckpointArgs):
    """Save a grain iterator with ``DataIteratorHandler``."""

    item: Any


@dataclass
class DataRestore(ocp.args.CheckpointArgs):
    """Restore a grain iterator with ``DataIteratorHandler``."""

    item: Any


@dataclass(frozen=True)
class DataIdentity:
    """What the manifest records about the task and its data (the task's own, not the config's text)."""

    dataset_version: str
    task_name: str = "lm"
    task_version: str = "1"
    task_options_hash: str = ""


@dataclass
class PendingSave:
    """A save orbax has started but the manifest has not recorded yet."""

    step: int
    started: float
    attempt: int
    blocking: float = 0.0  # seconds the training thread spent in orbax's save
    committed: float | None = None  # when this worker saw orbax's commit
    manifest: concurrent.futures.Future | None = field(default=None, repr=False)  # primary: commit + manifest


class Checkpointer:
    """An orbax CheckpointManager at ``checkpoints/`` plus the manifest step of the transaction.

    The training thread only starts saves and polls. On the primary host a single background
    thread waits for orbax to commit each save and writes its manifest right away (one at a time,
    in step order); the step counts as committed only when its manifest is written. ``save`` and
    ``finish_pending`` wait for the previous save's commit and manifest first.
    """

    def __init__(
        self,
        store: RunStore,
        cfg: JobConfig,
        attempt: int,
        mesh_shape: dict[str, int],
        identity: DataIdentity | None = None,
    ):
        self.store = store
        self.cfg = cfg
        self.identity = identity or DataIdentity(cfg.data.dataset_version)
        self.attempt = attempt
        self.mesh_shape = mesh_shape
        self.primary = jax.process_index() == 0
        configure_orbax()
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.keep,
            enable_async_checkpointing=cfg.checkpoint.async_save,
            create=True,
        )
        self.mgr = ocp.CheckpointManager(
            store.url(RunLayout.CHECKPOINTS),
            options=opts,
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(use_compression=False),
                "data": DataIteratorHandler(),
            },
        )
        self.pending: PendingSave | None = None
        self.last_committed: int | None = None
        self.last_commit_time: float | None = None
        self.last_duration: float | None = None
        self.last_blocking: float | None = None
        self._code_version = code_version() if self.primary else ""
        self._libs = library_versions()
        self._writer = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="manifest")
            if self.primary
            else None
        )

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
                state=ocp.args.PyTreeSave(state, save_args=_save_args(state)), data=DataSave(data_iter)
            ),
            force=True,
        )
        self.pending.blocking = time.time() - self.pending.started
        if self._writer is not None:
            self.pending.manifest = self._writer.submit(self._commit_and_write_manifest, self.pending)

    def poll(self) -> int | None:
        """Record a save whose commit and manifest completed since the last call; never blocks.

        Returns:
            The step newly committed, or None.
        """
        p = self.pending
        if p is None:
            return None
        if p.manifest is not None:  # primary host: the writer waits for the commit, then writes the manifest
            return self._record(p) if p.manifest.done() else None
        if self.mgr.is_saving_in_progress():
            return None
        return self.finish_pending()

    def finish_pending(self) -> int | None:
        """Wait for the save in flight to commit and for its manifest (primary host). Returns its step."""
        p = self.pending
        if p is None:
            return None
        if p.manifest is None:
            self.mgr.wait_until_finished()  # raises a failed save's error
            p.committed = time.time()
        return self._record(p)

    def _commit_and_write_manifest(self, p: PendingSave) -> None:
        """On the writer thread: wait for orbax to commit ``p``, then write its manifest at once."""
        self.mgr.wait_until_finished()  # raises a failed save's error
        p.committed = time.time()
        if p.step not in self.mgr.all_steps():
            raise RuntimeError(f"checkpoint of step {p.step} was not committed")
        write_manifest(self.store, self.manifest(p.step, p.committed - p.started))

    def _record(self, p: PendingSave) -> int:
        """Wait for ``p``'s manifest (raising its error) and record the step as committed."""
        if p.manifest is not None:
            p.manifest.result()
        assert p.committed is not None
        self.pending = None
        duration = p.committed - p.started
        self.last_committed, self.last_commit_time, self.last_duration = p.step, time.time(), duration
        self.last_blocking = p.blocking
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
            dataset_version=self.identity.dataset_version,
            task_name=self.identity.task_name,
            task_version=self.identity.task_version,
            task_options_hash=self.identity.task_options_hash,
            process_count=jax.process_count(),
            mesh_shape=self.mesh_shape,
            library_versions=self._libs,
            wall_time=time.time(),
            save_seconds=save_seconds,
        )

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """Restore the ``state`` item of ``step`` into the shardings of ``abstract_state``."""
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        got = self.mgr.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args)),
        )
        return got["state"]

    def restore_data(self, step: int, data_iter: Any) -> Any:
        """Restore this process's data-iterator state of ``step`` into ``data_iter``."""
        got = self.mgr.restore(step, args=ocp.args.Composite(data=DataRestore(data_iter)))
        return got["data"]

    def close(self) -> None:
        """Wait for background work and release the manager."""
        self.mgr.close()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
