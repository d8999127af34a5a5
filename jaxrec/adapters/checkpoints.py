"""Checkpoint manifests: the file list (size, CRC32C, generation or SHA-256) that completes a checkpoint transaction.

The trainer's primary host calls ``write_manifest`` after orbax committed a step; ``restore-latest`` verifies a step
against it. Integrity costs metadata, not bytes (docs/CHECKPOINTS.md, "Integrity from metadata"): on GCS one listing
gives each object's size, GCS's CRC32C and generation, which the manifest pins (tensorstore's GCS driver sends no
checksum of its own: ``tensorstore/kvstore/gcs_http/gcs_key_value_store.cc``, ``WriteTask::Retry``); on a local
directory each host streams the files it wrote (``writer_of``) through CRC32C and SHA-256 (``host_files``) and the
primary gathers the entries (``gather_files``). SHA-256 pins a local file: every OCDBT file ends with the CRC32C of
the bytes before it, so all have one and the same whole-file CRC32C.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import google_crc32c

from jaxrec.adapters.store import CRC_CHUNK, ObjectInfo, RunLayout, RunStore
from jaxrec.model.records import CheckpointManifest, ManifestFile

GCS_COMMIT = "commit_success.txt"
"""On GCS orbax writes the step in place and this file last, in the step directory."""
LOCAL_METADATA = "_CHECKPOINT_METADATA"
"""Orbax's step metadata, present in every finished local step directory."""

CRC_THREADS = 4
"""Files summed at once on a local directory (each holds one ``CRC_CHUNK`` buffer)."""

MAX_MANIFEST_FILES = 100_000
"""The most files one step may have. orbax writes a handful of files per process and item (OCDBT packs every
array chunk into a few data files per process), so a real step has a few per host: 100,000 covers thousands of
hosts, and a manifest that size (about 20 MiB) parses in restore-latest within its 256 MiB (measured: 210 MiB
peak, 2.5 s). A step beyond it (a layout without OCDBT writes one file per array chunk) is refused."""

MAX_MANIFEST_BYTES = 32 << 20
"""A ``manifest.json`` larger than this is refused before it is read (a manifest of ``MAX_MANIFEST_FILES`` is
about 20 MiB)."""

# orbax's names for what one process writes in a step directory (orbax 0.12 with OCDBT): its OCDBT
# sub-database (``<item>/ocdbt.process_<i>/``), its array metadata (``<item>/array_metadatas/process_<i>``)
# and grain's iterator state (``<item>/process_<i>-of-<n>.json``). Everything else (the item metadata,
# the merged OCDBT root, the commit markers) is written by the primary host.
_WRITER = (
    re.compile(r"(?:^|/)ocdbt\.process_(\d+)/"),
    re.compile(r"(?:^|/)array_metadatas/process_(\d+)$"),
    re.compile(r"(?:^|/)process_(\d+)-of-\d+\.json$"),
)


def crc32c_hex(data: bytes) -> str:
    """CRC32C of ``data`` as 8 hex digits (the checksum GCS also keeps for every object)."""
    return f"{google_crc32c.value(data):08x}"


def writer_of(path: str) -> int:
    """The process that wrote ``path`` (relative to the step directory): orbax's per-process names, else 0."""
    for pattern in _WRITER:
        m = pattern.search(path)
        if m:
            return int(m.group(1))
    return 0


def stream_digests(file: Path) -> tuple[str, str, int] | None:
    """CRC32C (hex), SHA-256 (hex) and size of ``file``, read ``CRC_CHUNK`` at a time; None when it is gone."""
    crc, sha, n = google_crc32c.Checksum(), hashlib.sha256(), 0
    try:
        with open(file, "rb", buffering=0) as f:
            while chunk := f.read(CRC_CHUNK):
                crc.update(chunk)
                sha.update(chunk)
                n += len(chunk)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    return crc.digest().hex(), sha.hexdigest(), n


def _local_entries(store: RunStore, base: str, paths: list[str], threads: int) -> list[ManifestFile]:
    """Entries of ``paths`` (relative to ``base``) streamed from the local directory on ``threads`` threads."""
    root = Path(store.url(base))
    out = []
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for path, got in zip(paths, pool.map(stream_digests, [root / p for p in paths]), strict=True):
            if got is not None:  # vanished between list and read
                out.append(ManifestFile(path=path, size=got[2], crc32c=got[0], sha256=got[1]))
    return out


def _relative(base: str, objects: Iterable[ObjectInfo]) -> list[ObjectInfo]:
    prefix = base.rstrip("/") + "/"
    return [
        ObjectInfo(o.name[len(prefix) :], o.size, o.generation, o.crc32c)
        for o in objects
        if o.name[len(prefix) :] != RunLayout.MANIFEST
    ]


def files_from_listing(
    store: RunStore, base: str, objects: Iterable[ObjectInfo], *, threads: int = CRC_THREADS
) -> list[ManifestFile]:
    """Manifest entries for ``objects`` (names relative to the run, under ``base/``), the manifest excluded.

    On GCS every entry comes from the listing itself (size, CRC32C, generation): no byte is read. Locally
    each file is streamed (CRC32C and SHA-256) by this host.
    """
    objs = _relative(base, objects)
    if not store.is_gcs:
        return sorted(_local_entries(store, base, [o.name for o in objs], threads), key=lambda f: f.path)
    out = [ManifestFile(path=o.name, size=o.size, crc32c=o.crc32c, generation=o.generation) for o in objs if o.crc32c]
    unsummed = [o.name for o in objs if not o.crc32c]  # a listing without a CRC32C (never from GCS itself)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for path, got in zip(unsummed, pool.map(store.crc32c, [f"{base}/{p}" for p in unsummed]), strict=True):
            if got is not None:
                out.append(ManifestFile(path=path, size=got[1], crc32c=got[0]))
    return sorted(out, key=lambda f: f.path)


def host_files(store: RunStore, step: int, process_index: int, *, threads: int = CRC_THREADS) -> list[ManifestFile]:
    """Local directory: the entries of the files process ``process_index`` wrote in ``step``, streamed here."""
    base = RunLayout.checkpoint(step)
    mine = [o.name for o in _relative(base, store.list(base)) if writer_of(o.name) == process_index]
    return _local_entries(store, base, mine, threads)


def gather_files(
    store: RunStore, step: int, reported: Mapping[str, ManifestFile], *, threads: int = CRC_THREADS
) -> tuple[list[ManifestFile], list[str]]:
    """The primary host's manifest entries of ``step``: every file listed now, from the hosts' reports.

    ``reported`` holds the entries the hosts streamed (``host_files``, the primary's own included). A
    listed file no host reported with its current size (a host whose report never came) is streamed here,
    so the manifest is complete either way.

    Returns:
        The entries (sorted by path) and the paths streamed here for want of a report.
    """
    base = RunLayout.checkpoint(step)
    objs = _relative(base, store.list(base))
    out = [reported[o.name] for o in objs if o.name in reported and reported[o.name].size == o.size]
    missing = [o.name for o in objs if o.name not in reported or reported[o.name].size != o.size]
    out += _local_entries(store, base, missing, threads)
    return sorted(out, key=lambda f: f.path), missing


def step_files(store: RunStore, step: int) -> list[ManifestFile]:
    """Every file of the checkpoint at ``step`` (the manifest excluded): from the listing on GCS, else streamed."""
    base = RunLayout.checkpoint(step)
    return files_from_listing(store, base, store.list(base))


def newest_complete_step(store: RunStore) -> int | None:
    """The newest checkpoint step whose manifest exists (written last: the step's transaction is complete)."""
    return max((s for s in store.checkpoint_steps() if store.exists(RunLayout.checkpoint_manifest(s))), default=None)


class TooManyFiles(ValueError):
    """A step has more files than a manifest may list (``MAX_MANIFEST_FILES``)."""


class StepGone(Exception):
    """The step's commit marker is no longer where orbax wrote it: restore-latest moved the step to quarantine."""


def commit_marker(store: RunStore, step: int) -> str:
    """The file orbax writes last in a committed step (``GCS_COMMIT`` on GCS, ``LOCAL_METADATA`` locally)."""
    return f"{RunLayout.checkpoint(step)}/{GCS_COMMIT if store.is_gcs else LOCAL_METADATA}"


def write_manifest(store: RunStore, manifest: CheckpointManifest) -> None:
    """Write ``checkpoints/<step>/manifest.json``, filling ``files`` from what is stored now when it has none.

    The manifest is written once (create-only): a transient answer is retried, and our own earlier try that
    succeeded unseen counts as done (``RunStore.create_record``). A step whose commit marker is gone by then was
    moved to quarantine by a restore-latest that ran while this attempt ended (its gang was already counted gone:
    a straggler on a lost node): no manifest is written, so none lands alone where the next attempt saves that
    step again.

    Raises:
        TooManyFiles: the step has more than ``MAX_MANIFEST_FILES`` files (no manifest is written).
        StepGone: the step was moved away (no manifest is written).
        PreconditionFailed: another manifest of the step is there.
    """
    if not manifest.files:
        manifest = manifest.model_copy(update={"files": step_files(store, manifest.step)})
    if len(manifest.files) > MAX_MANIFEST_FILES:
        raise TooManyFiles(
            f"checkpoint {manifest.step} has {len(manifest.files)} files, more than a manifest lists "
            f"({MAX_MANIFEST_FILES}); save with OCDBT (orbax's default), which packs array chunks into a few files"
        )
    if store.crc32c(commit_marker(store, manifest.step)) is None:
        raise StepGone(f"checkpoint {manifest.step} was moved away before its manifest was written")
    store.create_record(RunLayout.checkpoint_manifest(manifest.step), manifest)
