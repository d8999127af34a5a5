"""Checkpoint manifests: the file list (size, CRC32C, generation) that completes a checkpoint transaction.

The trainer's primary host calls ``write_manifest`` after orbax committed a step; ``restore-latest``
verifies a step against the manifest before it trusts it.

Integrity costs metadata, not bytes. On GCS no host reads back what it wrote: one listing gives every
object's size, the CRC32C GCS computed over the bytes it received, and its generation, and the manifest
pins each file by all three. How far that reaches: tensorstore's GCS driver (google/tensorstore,
``tensorstore/kvstore/gcs_http/gcs_key_value_store.cc``, ``WriteTask::Retry``) uploads each object as one
``uploadType=media`` POST with only ``Content-Type`` and ``Content-Length`` headers, sending no
``crc32c``/``x-goog-hash``, and from the response it parses only the generation (``FinishResponse``). So the
CRC32C GCS reports covers the bytes GCS received (transport integrity is HTTPS's), not a checksum orbax
computed: bytes damaged in the writing host's memory before the upload pass unnoticed, here as with a
read-back, which would read the same damaged object. Reads (``ReadTask::FinishResponse``) check no hash
either; see docs/CHECKPOINTS.md.

On a local directory there is no store checksum: the CRC32C is computed by streaming each file
(``RunStore.crc32c``, ``CRC_CHUNK`` at a time) on a few threads, so memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import google_crc32c

from recovery_steps.kernel.records import CheckpointManifest, ManifestFile
from recovery_steps.kernel.store import ObjectInfo, RunLayout, RunStore

CRC_THREADS = 4
"""Files summed at once on a local directory (each holds one ``CRC_CHUNK`` buffer)."""


def crc32c_hex(data: bytes) -> str:
    """CRC32C of ``data`` as 8 hex digits (the checksum GCS also keeps for every object)."""
    return f"{google_crc32c.value(data):08x}"


def files_from_listing(
    store: RunStore, base: str, objects: Iterable[ObjectInfo], *, threads: int = CRC_THREADS
) -> list[ManifestFile]:
    """Manifest entries for ``objects`` (names relative to the run, under ``base/``), the manifest excluded.

    On GCS every entry comes from the listing itself (size, CRC32C, generation): no byte is read. Locally,
    or for an object whose listing carries no CRC32C, the checksum is streamed from the file.
    """
    prefix = base.rstrip("/") + "/"
    objs = [o for o in objects if o.name[len(prefix) :] != RunLayout.MANIFEST]
    pinned = [o for o in objs if o.crc32c is not None]
    to_sum = [o for o in objs if o.crc32c is None]
    out = [
        ManifestFile(
            path=o.name[len(prefix) :],
            size=o.size,
            crc32c=o.crc32c or "",
            generation=o.generation if store.is_gcs else None,
        )
        for o in pinned
    ]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for o, got in zip(to_sum, pool.map(store.crc32c, [o.name for o in to_sum]), strict=True):
            if got is None:  # vanished between list and read
                continue
            crc, size = got
            out.append(ManifestFile(path=o.name[len(prefix) :], size=size, crc32c=crc))
    return sorted(out, key=lambda f: f.path)


def step_files(store: RunStore, step: int) -> list[ManifestFile]:
    """Every file of the checkpoint at ``step`` (the manifest itself excluded), with size, CRC32C and generation."""
    base = RunLayout.checkpoint(step)
    return files_from_listing(store, base, store.list(base))


def newest_complete_step(store: RunStore) -> int | None:
    """The newest checkpoint step whose manifest exists (written last: the step's transaction is complete)."""
    return max((s for s in store.checkpoint_steps() if store.exists(RunLayout.checkpoint_manifest(s))), default=None)


def write_manifest(store: RunStore, manifest: CheckpointManifest) -> None:
    """Write ``checkpoints/<step>/manifest.json``, filling ``files`` from what is stored now."""
    if not manifest.files:
        manifest = manifest.model_copy(update={"files": step_files(store, manifest.step)})
    store.write_record(RunLayout.checkpoint_manifest(manifest.step), manifest)
