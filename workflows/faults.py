"""What the faults act with, shared by the local injector and the drill.

``workflows/local/inject.py`` and ``workflows/drill.py`` damage a checkpoint one way, so both rehearse the same
corruption.
"""

from __future__ import annotations

from jaxrec.adapters.store import RunLayout, RunStore


def flip_middle(data: bytes) -> bytes:
    """``data`` with the 16 bytes in its middle inverted (same size: only a checksum can tell)."""
    out = bytearray(data)
    mid = len(out) // 2
    for i in range(mid, min(len(out), mid + 16)):
        out[i] ^= 0xFF
    return bytes(out)


def corrupt_newest_checkpoint(store: RunStore) -> str | None:
    """Flip bytes in the largest array file of the newest checkpoint that has a manifest (a complete save).

    An array's bytes, the same size: what silent corruption does, and what only the manifest's checksums reveal.

    Returns:
        What was damaged (``checkpoints/<step>/<file>``), or None when there is no such checkpoint.
    """
    for step in reversed(store.checkpoint_steps()):
        if not store.exists(RunLayout.checkpoint_manifest(step)):
            continue
        files = [
            o
            for o in store.list(RunLayout.checkpoint(step))
            if not o.name.endswith(".json") and "METADATA" not in o.name.upper() and o.size > 0
        ]
        if not files:
            continue
        target = max(files, key=lambda o: o.size)
        store.write_bytes(target.name, flip_middle(store.read_bytes(target.name) or b""))
        return target.name
    return None
