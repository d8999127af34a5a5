"""Checkpoints as transactions: orbax saves (async or sync), then the primary host writes the manifest."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata
import json
import logging
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grain
import jax
import jax.monitoring
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxrec.adapters.checkpoints import StepGone, TooManyFiles, gather_files, host_files, step_files, write_manifest
from jaxrec.adapters.store import PreconditionFailed, RunLayout, RunStore, first_line, is_transient, store_errors
from jaxrec.model.config import JobConfig
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import CheckpointManifest, ManifestFile, RestoreRecord, SkippedStep, now
from trainer.decisions import TrainerExit
from trainer.preemption import distributed_client

log = logging.getLogger(__name__)


def give_orbax_the_pods_credentials() -> None:
    """In a pod, orbax's reads of a bucket's metadata use the store's client (the metadata server's credentials).

    orbax reads the bucket with a ``storage.Client()`` of its own (orbax-checkpoint 0.12.8
    ``_src/path/gcs_utils.py`` ``get_bucket``, called by ``step.py`` and ``deleter.py`` while a save finalizes):
    against an emulator that client is anonymous, on GKE it asks ``google.auth.default()``, whose metadata ping
    a blip fails, ending the attempt as an application error in the middle of a save. Where orbax has no such
    function any more, it keeps its own client (and this says so).
    """
    import functools

    from jaxrec.adapters.store import credentials_source, make_gcs_client

    if credentials_source() != "pod":
        return
    from orbax.checkpoint._src.path import gcs_utils

    if not callable(getattr(gcs_utils, "get_bucket", None)):
        log.warning("orbax has no gcs_utils.get_bucket: its bucket reads keep a client of their own")
        return

    @functools.lru_cache(maxsize=32)
    def get_bucket(bucket_name: str) -> Any:
        return make_gcs_client().get_bucket(bucket_name)

    gcs_utils.get_bucket = get_bucket


def settle_tensorstores_credentials(bucket: str, key: str) -> None:
    """In a pod, have tensorstore decide on its credentials now, while the metadata server answers.

    tensorstore decides once per process, at its first GCS request, whether it has credentials: it asks the metadata
    server whether it runs on GCE (3 tries within about a second), and without an answer it works with none for
    good (tensorstore ``internal/oauth2/google_auth_provider.cc``). Left to orbax, that first request is the first
    save's, which may meet the metadata server silent (a step pod starting beside it, chaos seed 1): every array
    write is then refused 401 and the save hangs. One read (of a key that need not exist) right after the store's
    own token came makes the decision while the server is known to answer. A failed read is logged: the saves
    decide then, as before.
    """
    from jaxrec.adapters.store import credentials_source

    if credentials_source() != "pod":
        return
    try:
        import tensorstore as ts

        ts.KvStore.open({"driver": "gcs", "bucket": bucket}).result().read(key).result()
    except Exception as e:  # noqa: BLE001 - the saves decide later; nothing here ends the worker
        log.warning("tensorstore's first GCS read failed (%s: %s); its saves decide later", type(e).__name__, e)


_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore")


def _version(package: str, absent: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return absent


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries that shape a checkpoint."""
    return {name: _version(name, "absent") for name in _LIBRARIES}


def code_version() -> str:
    """Package version, plus the git commit of the source tree when it is a checkout."""
    version = _version("jax-slice-recovery", "0+unknown")
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

    Barriers go through the coordination service instead of a compiled all-gather over every device (no compile on
    the first save, no collective on the training thread); replicated arrays are split across replicas only when
    each slice is large.
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


RESTORE_CHECK_WAIT_S = 600.0
"""How long process 0 waits for each process's check of the restored step (and the others for its verdict)."""

SNAPSHOT_WAIT_S = 600.0
"""How long the loop waits for orbax's host copy of the live state, where no device copy fits (a bound, not a pace)."""

COMMIT_WAIT_PART = "the loop's wait for its commit"
"""The part of a save's ``blocking_parts`` that the loop spent waiting for its commit (the next save, the end)."""

MANIFEST_WAIT_S = 120.0
"""How long a non-primary process waits for process 0's manifest before it leaves the step uncounted."""


def _snapshot_fn(target: Any) -> Any:
    """A jitted copy of the state into new device buffers, same shardings (the next step donates the live ones).

    It holds one more copy of the state in device memory until orbax has copied it to the host.
    """
    shardings = jax.tree.map(lambda x: x.sharding, target)
    return jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=shardings)


def device_copy_fits(state: Any, compiled: Any = None) -> bool:
    """Whether a second copy of ``state`` fits in each local device's memory beside what the step needs.

    An asynchronous save copies the state on the device so that the next step can run while orbax reads the copy;
    on a device with a memory limit, the copy, what is in use now and the compiled step's temporaries and code
    (``compiled.memory_analysis()``, per device) must fit under it: a copy that does not leaves the step unable to
    load (RESOURCE_EXHAUSTED; seen on a v5e with the 269M model, whose step reserves 10.5 GB beside 3.2 GB of state,
    of 15.7). A device that reports no limit (the CPU) always fits.
    """
    per_device: dict[Any, int] = {}
    for leaf in jax.tree.leaves(state):
        for shard in getattr(leaf, "addressable_shards", ()):
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    step_bytes = 0
    analysis = compiled.memory_analysis() if compiled is not None and hasattr(compiled, "memory_analysis") else None
    if analysis is not None:
        step_bytes = int(analysis.temp_size_in_bytes) + int(analysis.generated_code_size_in_bytes)
    for device, copy_bytes in per_device.items():
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit and stats.get("bytes_in_use", 0) + step_bytes + copy_bytes > limit:
            return False
    return True


HOST_MEMORY_KINDS = ("unpinned_host", "pinned_host")
"""The host memories a save's copy of the state may go to, the fastest first. On a TPU v5e (JAX 0.10.2, libtpu
0.0.42.1) a state of the 269M model's size (3.22 GB) went to ``unpinned_host`` in 0.34-0.39 s and to ``pinned_host``
in 1.7-2.6 s, one 1 GiB array to pinned memory in 1.0-1.3 s (docs/PERFORMANCE.md; ``bench/bench_trainer.py
--host-copy``): the next step waits on the chip for that transfer, so its time is what a save costs the loop."""


def host_copy(state: Any) -> Any:
    """A function that copies ``state`` into the host's memory, or None where a device has no host memory kind.

    ``jax.device_put`` to the same shardings with the first of ``HOST_MEMORY_KINDS`` every device has (JAX docs,
    "Memory spaces and host offloading"): the transfer is dispatched asynchronously, in order, and takes no device
    memory; a later step that donates the state waits on the device for the transfer to have read it, not the loop
    on the host.
    """
    leaves = jax.tree.leaves(state)
    devices = {d for leaf in leaves for d in getattr(leaf, "devices", set)()}
    kinds = [{m.kind for m in d.addressable_memories()} for d in devices]
    kind = next((k for k in HOST_MEMORY_KINDS if kinds and all(k in have for have in kinds)), None)
    if kind is None:
        return None
    shardings = jax.tree.map(lambda x: x.sharding.with_memory_kind(kind), state)
    return lambda s: jax.device_put(s, shardings, may_alias=False)


# tensorstore's status for an answer worth retrying, in the error its GCS driver raises once its own retries are
# spent (absl status names; "HTTP response code: 429" or 5xx in the message).
_TENSORSTORE_TRANSIENT = ("unavailable:", "deadline_exceeded:", "http response code: 429", "http response code: 5")


def failed_on_the_store(e: BaseException) -> bool:
    """Whether a save failed because the run store did not answer past its clients' retries.

    A 429, a 5xx, a reset or a timeout anywhere in the exception's chain: orbax's writes go through tensorstore (the
    arrays) and gcsfs (its metadata and commit marker on ``gs://``), the manifest through the run store's own client.
    """
    try:
        from gcsfs.retry import HttpError, is_retriable
    except ImportError:  # no gcsfs: no gs:// path goes through it
        HttpError, is_retriable = None, None  # noqa: N806
    seen: BaseException | None = e
    for _ in range(8):  # a chain is short; a cycle must not loop
        if seen is None:
            return False
        if "barrier" in str(seen).lower():  # orbax's cross-process barrier timed out: a peer, not the store
            return False
        if isinstance(seen, store_errors()) and is_transient(seen):
            return True
        if HttpError and isinstance(seen, HttpError) and is_retriable(seen):
            return True
        if isinstance(seen, ValueError) and any(m in str(seen).lower() for m in _TENSORSTORE_TRANSIENT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _save_args(state: Any) -> Any:
    """Per-array save options: uncompressed, chunked (see ``_CHUNK_BYTES``)."""
    return jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES), state)


def _state_file(directory: Any) -> Any:
    """The iterator-state file of this process in the item's directory (grain's own name for it)."""
    return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"


class DataIteratorHandler(grain.checkpoint.CheckpointHandler, ocp.AsyncCheckpointHandler):
    """grain's iterator handler (same files, same restore) whose save writes in the background.

    The state is captured on the calling thread; the file is written by a commit future once orbax has created the
    item's directory, so an asynchronous save does not wait for a store round trip on the training thread.
    """

    async def async_save(self, directory: Any, item: Any = None, args: Any = None) -> list[Any]:
        """Capture the iterator state now; write ``process_<i>-of-<n>.json`` in the background."""
        item = item or args.item
        state = json.dumps(item.get_state(), indent=4)
        path = _state_file(directory)

        async def write() -> None:
            await asyncio.to_thread(path.write_text, state)

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="data_iterator_save")]

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        """Restore as grain does; a bare ``_IteratorSnapshot`` gets the file's JSON state (grain gives it bytes)."""
        item = item or args.item
        if not isinstance(item, _IteratorSnapshot):
            return super().restore(directory, item=item, args=args)
        path = _state_file(directory)
        if not path.exists():
            raise ValueError(f"File {path} does not exist.")
        item.set_state(json.loads(path.read_text()))
        return item

    def save(self, directory: Any, item: Any = None, args: Any = None) -> None:
        """Synchronous save: the file grain's handler writes for a dataset iterator, from the captured state."""
        item = item or args.item
        path = _state_file(directory)
        path.write_text(json.dumps(item.get_state(), indent=4))


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


class _IteratorSnapshot:
    """A data iterator's state without the iterator.

    Captured on the training thread for a save (the iterator moves on right after), or filled by a
    restore before the iterator can be built.
    """

    def __init__(self, state: dict[str, Any]):
        self._state = state

    def get_state(self) -> dict[str, Any]:
        """The captured state (what grain's handler writes)."""
        return self._state

    def set_state(self, state: dict[str, Any]) -> None:
        """Take the state a restore read."""
        self._state = dict(state)


@dataclass
class Capture:
    """What an asynchronous save of ``step`` writes, taken on the training thread right after the step was dispatched.

    The copy of the state runs on the device in the order dispatched, before any later step donates the state, so
    the loop need not wait for the step to finish or hold its next steps back for the save.
    """

    step: int
    state: Any  # the on-device copy of the state the step produced
    data: _IteratorSnapshot  # the data position after the step
    seconds: float  # the training thread's time taking them


@dataclass
class PendingSave:
    """A save handed to the saver thread and not yet recorded as committed."""

    step: int
    started: float
    blocking: float = 0.0  # seconds the training thread spent in save()
    held: float = 0.0  # of them, the seconds inside save() (not the copy taken as the step was dispatched)
    parts: dict[str, float] = field(default_factory=dict)  # where those seconds (and the saver's) went
    committed: float | None = None  # when this worker saw orbax's commit
    incomplete: str | None = None  # why the transaction is not known complete (process 0's manifest not heard of)
    writing: threading.Event = field(default_factory=threading.Event, repr=False)  # orbax's save() returned
    done: concurrent.futures.Future | None = field(default=None, repr=False)  # commit (+ manifest on primary)


class _OrbaxTimings:
    """Collects the durations orbax reports (``jax.monitoring``) on one thread while a save runs there."""

    _NAMES = {
        "/jax/orbax/write/checkpoint_start_sync_duration_secs": "orbax start barriers",
        "/jax/orbax/write/blocking_wait_prev_duration_secs": "orbax wait for previous",
        "/jax/orbax/write/blocking_tree_map_duration_secs": "orbax tree map",
        "/jax/orbax/write/blocking_d2h_duration_secs": "orbax device-to-host copy",
        "/jax/orbax/write/directory_creation_secs": "orbax directory creation",
        "/jax/orbax/write/blocking_duration_secs": "orbax save() blocking in all",
    }

    def __init__(self) -> None:
        self._thread: int | None = None
        self._into: dict[str, float] | None = None
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **kwargs: Any) -> None:
        name = self._NAMES.get(event)
        if name and self._into is not None and threading.get_ident() == self._thread:
            self._into[name] = self._into.get(name, 0.0) + duration

    def collect(self, into: dict[str, float]) -> None:
        """Start collecting this thread's orbax durations into ``into`` (``stop()`` ends it)."""
        self._thread, self._into = threading.get_ident(), into

    def stop(self) -> None:
        """Stop collecting."""
        self._into = None


class Checkpointer:
    """An orbax CheckpointManager at ``checkpoints/`` plus the manifest step of the transaction (docs/TRAINER.md).

    The training thread only takes a snapshot of the state and of the data position, and hands both to one saver
    thread: orbax's save, its commit and (primary host) the manifest. Every process counts the step only once it
    heard, through the coordination service's key-value store, that process 0 wrote the manifest.
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
        self.async_save = cfg.checkpoint.async_save
        configure_orbax()
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.keep,
            enable_async_checkpointing=self.async_save,
            # orbax's default, named because the saver thread relies on it: the step directory is
            # created by a commit future, not before orbax's save() returns (orbax 0.12.x options.py).
            async_options=ocp.AsyncOptions(create_directories_asynchronously=True),
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
        self.last_held: float = 0.0  # of the last committed save's blocking, the seconds inside save()
        self.last_parts: dict[str, float] = {}
        self.last_incomplete: str | None = None  # why the newest step left uncounted is (one line)
        self._code_version = code_version() if self.primary else ""
        self._libs = library_versions()
        self._orbax_timings = _OrbaxTimings()
        self._snapshot: Any = None  # the copy a save writes: on the device, or in the host's memory
        self._preparing: concurrent.futures.Future | None = None  # its compile, started ahead (``prepare_snapshot``)
        self._copy_fits: bool | None = None  # a copy of the state can be taken without the loop waiting (decided once)
        self._announced: int | None = None  # the step whose manifest key process 0 set last
        self._saver = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-saver")
        self._kv = distributed_client() if jax.process_count() > 1 else None

    def prepare_snapshot(self, abstract_state: Any) -> None:
        """Start compiling the on-device copy of the state on the saver's thread; the first save's capture waits for it.

        Off the first save's time, and beside the restore instead of before the first step.
        """
        if self.async_save:
            self._preparing = self._saver.submit(lambda: _snapshot_fn(abstract_state).lower(abstract_state).compile())

    def _prepared(self) -> None:
        """The copy compiled ahead, once (its compile's error raised here, on the training thread)."""
        fut, self._preparing = self._preparing, None
        if fut is not None:
            compiled = fut.result()
            if self._snapshot is None:  # a host copy chosen meanwhile (``copy_fits``) stays
                self._snapshot = compiled

    def steps(self) -> list[int]:
        """Committed steps orbax lists."""
        return list(self.mgr.all_steps())

    def copy_fits(self, state: Any, compiled: Any = None) -> bool:
        """Whether saves take a copy of the state the loop need not wait for (decided at the first ask, said once).

        On the device where it fits beside the step (``device_copy_fits``); else in the host's memory
        (``host_copy``: the next step waits on the device for the transfer); else not at all: orbax reads
        the live state and the loop waits until its host copy is taken.
        """
        if self._copy_fits is None:
            self._copy_fits = device_copy_fits(state, compiled)
            if not self._copy_fits:
                self._snapshot = host_copy(state)
                self._copy_fits = self._snapshot is not None
                log.warning(
                    "a copy of the state does not fit in device memory beside the step: %s",
                    "each save copies it to the host's memory as its step is dispatched (the step after waits "
                    "on the device for that transfer)"
                    if self._copy_fits
                    else "each save holds the loop until orbax has copied the state to the host "
                    "(blocking_seconds says how long)",
                )
        return self._copy_fits

    def copy_released(self) -> bool:
        """Whether no earlier save still holds its device copy (orbax has the save in flight on the host)."""
        p = self.pending
        return p is None or p.writing.is_set()

    def capture(self, step: int, state: Any, data_iter: Any) -> Capture:
        """Copy ``state`` (dispatched asynchronously, where ``copy_fits`` says) and the data position for a save."""
        t0 = now()
        self._prepared()
        if self._snapshot is None:
            self._snapshot = _snapshot_fn(state)
        snap = self._snapshot(state)
        return Capture(step, snap, _IteratorSnapshot(data_iter.get_state()), now() - t0)

    def save(self, step: int, state: Any, data_iter: Any, capture: Capture | None = None) -> None:
        """Start saving ``step`` (after recording the previous save, which orbax would wait for anyway).

        ``capture``: the state and data position taken as the step was dispatched (asynchronous saves), else they
        are taken here from ``state`` and ``data_iter``. Its ``blocking`` is the time the loop does not step because
        of this save: taking them, starting it here, and later the wait for its commit (``_record``), whoever waits
        (the next save, the end, a preemption).
        """
        self.finish_pending()
        t1 = now()
        p = PendingSave(step, t1)
        copies = self.async_save and self.copy_fits(state)
        taken = 0.0  # the loop's time taking the copy before this call (as the step was dispatched)
        if copies and capture is not None and capture.step == step:
            state, data, taken = capture.state, capture.data, capture.seconds
        elif copies:
            c = self.capture(step, state, data_iter)
            state, data = c.state, c.data
        else:
            data = _IteratorSnapshot(data_iter.get_state())
        t2 = now()
        p.done = self._saver.submit(self._save_and_commit, p, state, data)
        self.pending = p
        if not self.async_save:
            p.writing.wait()
        elif not copies:  # orbax reads the live state, which the next step donates: wait for its host copy
            p.writing.wait(SNAPSHOT_WAIT_S)
        t3 = now()
        p.blocking, p.held = taken + (t3 - t1), t3 - t1
        p.parts.update(
            {"snapshot of state and data position": taken + (t2 - t1), "hand-off to the saver thread": t3 - t2}
        )

    def wait_until_writing(self, timeout: float = 60) -> None:
        """Wait until orbax's save of the pending step returned (its writes are in flight, not committed)."""
        if self.pending is not None:
            self.pending.writing.wait(timeout)

    def poll(self) -> int | None:
        """Record a save whose commit (and manifest) completed since the last call: its step, or None (never blocks)."""
        p = self.pending
        if p is None or p.done is None or not p.done.done():
            return None
        return self._record(p)

    def finish_pending(self) -> int | None:
        """Wait for the save in flight to commit and for process 0's manifest; its step, or None if not complete."""
        return None if self.pending is None else self._record(self.pending)

    def _save_and_commit(self, p: PendingSave, state: Any, data: _IteratorSnapshot) -> None:
        """On the saver thread: orbax's save, its commit, then (primary host) the manifest."""
        saver: dict[str, float] = {}
        self._orbax_timings.collect(saver)
        try:
            try:
                t0 = now()
                self.mgr.save(
                    p.step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeSave(state, save_args=_save_args(state)), data=DataSave(data)
                    ),
                    force=True,
                )
                saver["orbax save() on the saver thread"] = now() - t0
            finally:  # orbax has the state on the host (or failed): the loop and the next copy may go on
                self._orbax_timings.stop()
                p.writing.set()
                p.parts.update({f"off the loop: {k}": v for k, v in saver.items()})
            del state  # the snapshot's device buffers go once orbax has its host copy
            self.mgr.wait_until_finished()  # raises a failed save's error
        except Exception as e:
            if not failed_on_the_store(e):
                raise  # a bug or a refusal ends the worker
            # The store did not take a file of the step (an array, orbax's metadata, its commit marker) past the
            # clients' retries: the step is an incomplete transaction, never restored (no manifest).
            why = f"orbax could not write it to the run store ({type(e).__name__}: {first_line(e)[:300]})"
            if jax.process_count() > 1:
                # The other processes wait in orbax's barriers for this one's part or process 0's commit, until
                # orbax's timeout: ending now, as transient, lets the gang restart from the newest complete step
                # at once instead.
                raise TrainerExit(ExitCode.TRANSIENT, f"checkpoint {p.step}: {why}") from e
            p.committed, p.incomplete = now(), why  # a gang of one goes on training; the next save commits
            log.error("checkpoint %d: %s", p.step, why)
            return
        p.committed = now()
        if self.primary:
            if p.step not in self.mgr.all_steps():
                raise RuntimeError(f"checkpoint of step {p.step} was not committed")
            manifest = self.manifest(p.step, p.committed - p.started)
            try:
                write_manifest(self.store, manifest.model_copy(update={"files": self._gather_files(p.step)}))
            except TooManyFiles as e:  # the step stays without a manifest: never restored, quarantined later
                log.error("%s", e)
                p.incomplete = str(e)
            except StepGone as e:  # quarantined by a restore-latest that ran while this attempt ended
                log.warning("%s", e)
                p.incomplete = str(e)
            except (PreconditionFailed, *store_errors()) as e:
                # The store failed past its retries (or holds another manifest of the step): the step is an
                # incomplete transaction, never restored; training goes on and the next save commits.
                p.incomplete = f"its manifest could not be written ({type(e).__name__}: {str(e)[:300]})"
                log.error("checkpoint %d: %s", p.step, p.incomplete)
            self._announce_manifest(p.step, p.incomplete)
        else:
            if not self.store.is_gcs:
                self._report_files(p.step)
            p.incomplete = self._await_manifest(p.step)

    def _manifest_key(self, step: int) -> str:
        return f"jaxrec/manifest/{self.attempt}/{step}"

    def _files_key(self, step: int, process: int) -> str:
        return f"jaxrec/files/{self.attempt}/{step}/{process}"

    def _report_files(self, step: int) -> None:
        """Local directory, other processes: stream the files this process wrote and hand the entries to process 0.

        Each host reads only its own files (in parallel with the others), through the coordination service's
        key-value store the gang already uses for the manifest: no new service, nothing read twice.
        """
        try:
            files = host_files(self.store, step, jax.process_index())
            payload = json.dumps([f.model_dump(mode="json") for f in files])
            if self._kv is not None:
                self._kv.key_value_set(self._files_key(step, jax.process_index()), payload)
        except Exception as e:  # noqa: BLE001 - process 0 then streams this host's files itself
            log.warning("could not report the files of checkpoint %d to process 0: %s", step, e)

    def _gather_files(self, step: int) -> list[ManifestFile]:
        """Process 0: the manifest entries of ``step``.

        GCS: from one listing (no byte read). Local directory: process 0 streams its own files, takes the
        other processes' entries from the key-value store (waiting at most ``MANIFEST_WAIT_S`` in all), and
        streams itself only files no process reported.
        """
        if self.store.is_gcs:
            return step_files(self.store, step)
        reported = {f.path: f for f in host_files(self.store, step, 0)}
        deadline = now() + MANIFEST_WAIT_S
        for i in range(1, jax.process_count()):
            if self._kv is None:
                break
            try:
                raw = self._kv.blocking_key_value_get(self._files_key(step, i), max(1, int((deadline - now()) * 1000)))
                reported.update({f.path: f for f in map(ManifestFile.model_validate, json.loads(raw))})
                self._kv.key_value_delete(self._files_key(step, i))
            except Exception as e:  # noqa: BLE001 - its files are streamed here instead
                log.warning("process %d did not report the files of checkpoint %d (%s)", i, step, e)
        files, streamed = gather_files(self.store, step, reported)
        if streamed:
            log.warning("checkpoint %d: %d files no process reported were streamed by process 0", step, len(streamed))
        return files

    def _announce_manifest(self, step: int, refused: str | None = None) -> None:
        """Process 0: tell the others the step's manifest is written (its transaction is complete) or why not."""
        if self._kv is None:
            return
        try:
            self._kv.key_value_set(self._manifest_key(step), "1" if refused is None else f"0{refused}")
            if self._announced is not None:  # every process read it before this step's barriers let us commit
                self._kv.key_value_delete(self._manifest_key(self._announced))
            self._announced = step
        except Exception as e:  # noqa: BLE001 - the others then do not count the step; it is still restorable
            log.warning("could not tell the other processes that checkpoint %d is complete: %s", step, e)

    def _await_manifest(self, step: int) -> str | None:
        """Other processes: wait (on the saver thread) until process 0 wrote the manifest; None when it did."""
        if self._kv is None:
            return None
        try:
            said = self._kv.blocking_key_value_get(self._manifest_key(step), int(MANIFEST_WAIT_S * 1000))
            return None if said == "1" else f"process 0 wrote no manifest for step {step}: {said[1:]}"
        except Exception as e:  # noqa: BLE001 - process 0 gone or slow: the step is not known complete here
            return f"process 0 did not report the manifest of step {step} within {MANIFEST_WAIT_S:.0f} s ({e})"

    def _record(self, p: PendingSave) -> int | None:
        """Wait for ``p``'s commit and manifest (raising its error) and record the step as committed."""
        assert p.done is not None
        t0 = now()
        try:
            p.done.result()
        finally:
            # The loop waited this long for the save in flight: part of what the save cost it.
            waited = now() - t0
            p.blocking += waited
            p.parts[COMMIT_WAIT_PART] = waited
        assert p.committed is not None
        self.pending = None
        if p.incomplete is not None:
            log.warning("checkpoint %d not counted: %s", p.step, p.incomplete)
            self.last_incomplete = f"checkpoint {p.step}: {p.incomplete}"
            return None
        duration = p.committed - p.started
        self.last_committed, self.last_commit_time, self.last_duration = p.step, now(), duration
        self.last_blocking, self.last_held, self.last_parts = p.blocking, p.held, dict(p.parts)
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
            wall_time=now(),
            save_seconds=save_seconds,
        )

    def restore(self, step: int, abstract_state: Any, *, with_data: bool = True) -> tuple[Any, dict | None]:
        """Restore ``step``'s state and, with ``with_data``, this process's data-iterator state, in one orbax restore.

        One restore is one set of orbax's cross-process barriers. The state comes in the shardings of
        ``abstract_state``. The iterator state comes back as a dict (grain's ``get_state``), not inside an iterator: the
        iterator's order depends on the restored state, so the caller builds it afterwards.
        """
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        items: dict[str, Any] = {"state": ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args)}
        position = _IteratorSnapshot({}) if with_data else None
        if position is not None:
            items["data"] = DataRestore(position)
        got = self.mgr.restore(step, args=ocp.args.Composite(**items))
        return got["state"], (position.get_state() if position is not None else None)

    def check_restored(self, step: int, manifest: CheckpointManifest) -> int | None:
        """After orbax read ``step``: every process checks its part of the bytes; None when the step is intact.

        orbax's read checks no checksum of the array bytes (docs/CHECKPOINTS.md, "Bytes are checked where they are
        read"), so each process checks its share (``verify.part_problems``) and process 0 gathers the verdicts
        through the coordination service. A damaged step is treated as restore-latest treats one: quarantined, the
        decision taken again (recorded in the attempt's ``restore.json``), every process told the step to restore
        instead (-1: a fresh start).

        Raises:
            TrainerExit: restore-latest's decision was a stop (no compatible checkpoint: exit 3; or 2).
        """
        from jaxrec.adapters import verify

        pi, pc = jax.process_index(), jax.process_count()
        name = str(step)
        mine = verify.part_problems(self.store, name, manifest, pi, pc)
        if pc == 1:
            verdict = self._fall_back(step, mine) if mine else None
        elif self.primary:
            problems = list(mine)
            for i in range(1, pc):
                raw = self._kv.blocking_key_value_get(self._check_key(step, i), int(RESTORE_CHECK_WAIT_S * 1000))
                problems += json.loads(raw)
            verdict = self._fall_back(step, problems) if problems else None
            self._kv.key_value_set(self._check_key(step, "verdict"), json.dumps(verdict))
        else:
            self._kv.key_value_set(self._check_key(step, pi), json.dumps(mine))
            raw = self._kv.blocking_key_value_get(self._check_key(step, "verdict"), int(RESTORE_CHECK_WAIT_S * 1000))
            verdict = json.loads(raw)
        if verdict is None:
            return None
        if verdict["code"] != 0:
            raise TrainerExit(verdict["code"], verdict["message"])
        log.warning("checkpoint %d is damaged (%s); restoring %d instead", step, verdict["why"], verdict["step"])
        self.last_committed = None
        return int(verdict["step"])

    def _check_key(self, step: int, part: int | str) -> str:
        return f"jaxrec/restore-check/{self.attempt}/{step}/{part}"

    def _fall_back(self, step: int, problems: list[str]) -> dict[str, Any]:
        """Process 0: quarantine the damaged ``step`` and decide again as restore-latest does; the gang's verdict."""
        from jaxrec.adapters import restore
        from jaxrec.adapters.verify import Skip
        from jaxrec.model.contract import SkipKind

        shown = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
        why = f"damaged data found by the workers while restoring: {shown}"
        target = restore.quarantine(self.store, Skip(str(step), step, SkipKind.FILES, why, True), self.attempt)
        decided = restore.run(self.store, self.attempt)
        new = decided.selection.step if decided.selection is not None else -1
        record = self.store.read_record(RunLayout.restore_record(self.attempt), RestoreRecord)
        if record is not None and target is not None:  # the attempt's record lists this quarantine too
            skipped = SkippedStep(step=step, name=str(step), reason=why, kind=SkipKind.FILES.value, quarantined=True)
            restore.write_restore_record(
                self.store, record.model_copy(update={"skipped": [skipped, *record.skipped], "quarantined": [target]})
            )
        return {"code": int(decided.code), "message": decided.message, "step": new, "why": shown}

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """Restore the ``state`` item of ``step`` into the shardings of ``abstract_state``."""
        return self.restore(step, abstract_state, with_data=False)[0]

    def close(self) -> None:
        """Wait for background work and release the manager."""
        self._saver.shutdown(wait=True)
        self.mgr.close()
