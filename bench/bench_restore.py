"""Restore speed vs a plain read of the same bytes, from a local directory and from the GCS emulator.

Writes one orbax checkpoint of ``--mb`` MB (items ``state`` and ``data``, as the trainer does) into each
store, then alternates, ``--repeats`` times: a plain parallel read of every file of the step, an orbax
restore of the step, and restore-latest's verification (read back + CRC32C of every file). Prints
medians and the ratio restore speed / read speed (target >= 0.8).

    .venv/bin/python bench/bench_restore.py [--mb 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def plain_read(store, step: int) -> int:
    objs = store.list(f"checkpoints/{step}")
    with ThreadPoolExecutor(8) as pool:
        return sum(len(b or b"") for b in pool.map(store.read_bytes, [o.name for o in objs]))


def orbax_restore(store, step: int) -> None:
    import jax
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(store.url("checkpoints")) as mgr:
        got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
    jax.block_until_ready(got["state"])


def verify(store, cfg, step: int) -> None:
    from recovery_steps.verify import closed_attempts, verify_checkpoints

    sel, _ = verify_checkpoints(store, cfg.model_dump(mode="json"), cfg.slice.num_hosts, closed_attempts(store))
    assert sel.step == step, sel


def bench(label: str, store, cfg, mb: int, repeats: int) -> dict[str, float]:
    from ckpt_factory import write_checkpoint

    t = time.perf_counter()
    write_checkpoint(store, cfg, 100, floats=mb * 2**20 // 4)
    save_s = time.perf_counter() - t
    nbytes = sum(o.size for o in store.list("checkpoints/100"))
    times: dict[str, list[float]] = {"read": [], "restore": [], "verify": []}
    for _ in range(repeats):
        for name, fn in (
            ("read", lambda: plain_read(store, 100)),
            ("restore", lambda: orbax_restore(store, 100)),
            ("verify", lambda: verify(store, cfg, 100)),
        ):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    mbs = {k: nbytes / 2**20 / v for k, v in med.items()}
    print(
        f"{label:<9} {nbytes / 2**20:7.1f} MB  save {save_s:6.2f} s | read {med['read']:6.2f} s {mbs['read']:7.1f} MB/s"
        f" | restore {med['restore']:6.2f} s {mbs['restore']:7.1f} MB/s | verify {med['verify']:6.2f} s"
        f" {mbs['verify']:7.1f} MB/s | restore/read speed {mbs['restore'] / mbs['read']:5.2f}"
    )
    return {"ratio": mbs["restore"] / mbs["read"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=128, help="checkpoint size in MB (one float32 array)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from ckpt_factory import tiny_config, write_run_config

    from recovery_steps.emulator import GcsEmulator
    from recovery_steps.store import RunStore

    cfg = tiny_config()
    print(f"orbax restore vs plain read of the same bytes, median of {args.repeats}, target ratio >= 0.8")
    with tempfile.TemporaryDirectory() as tmp, GcsEmulator() as em:
        em.create_bucket("bench-bucket")
        em.apply()
        for label, root in (("local", f"{tmp}/store"), ("emulator", "gs://bench-bucket/bench")):
            store = RunStore(root, cfg.run_id)
            write_run_config(store, cfg)
            bench(label, store, cfg, args.mb, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
