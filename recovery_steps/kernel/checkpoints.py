"""Checkpoint manifests: the file list (size, CRC32C) that completes a checkpoint transaction.

The trainer's primary host calls ``write_manifest`` after orbax committed a step; ``restore-latest``
verifies a step against the manifest before it trusts it.
"""

from __future__ import annotations

import google_crc32c

from recovery_steps.kernel.records import CheckpointManifest, ManifestFile
from recovery_steps.kernel.store import RunLayout, RunStore


def crc32c_hex(data: bytes) -> str:
    """CRC32C of ``data`` as 8 hex digits (the checksum GCS also keeps for every object)."""
    return f"{google_crc32c.value(data):08x}"


def step_files(store: RunStore, step: int) -> list[ManifestFile]:
    """Every file of the checkpoint at ``step`` (the manifest itself excluded), with size and CRC32C."""
    base = RunLayout.checkpoint(step) + "/"
    out = []
    for obj in store.list(RunLayout.checkpoint(step)):
        rel = obj.name[len(base) :]
        if rel == RunLayout.MANIFEST:
            continue
        data = store.read_bytes(obj.name)
        if data is None:  # vanished between list and read
            continue
        out.append(ManifestFile(path=rel, size=len(data), crc32c=crc32c_hex(data)))
    return out


def newest_complete_step(store: RunStore) -> int | None:
    """The newest checkpoint step whose manifest exists (written last: the step's transaction is complete)."""
    return max((s for s in store.checkpoint_steps() if store.exists(RunLayout.checkpoint_manifest(s))), default=None)


def write_manifest(store: RunStore, manifest: CheckpointManifest) -> None:
    """Write ``checkpoints/<step>/manifest.json``, filling ``files`` from what is stored now."""
    if not manifest.files:
        manifest = manifest.model_copy(update={"files": step_files(store, manifest.step)})
    store.write_record(RunLayout.checkpoint_manifest(manifest.step), manifest)
