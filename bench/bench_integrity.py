"""Checkpoint integrity vs checkpoint size: building the manifest and restore-latest's check, before and now.

For each backend (a local directory, the GCS emulator) and each size it writes one step directory of four
equal data files (the array files of a checkpoint) plus orbax's small marker files, then measures, each in
a fresh process (so that peak memory is that process's own, interpreter and imports included):

- ``manifest``: the file list of the step. ``read-back`` is the method the trainer used before: every file read
  whole into memory and its CRC32C computed, one after another. ``metadata`` is today's: on GCS one listing
  (size, CRC32C, generation as GCS reports them, no byte read); locally each file streamed through CRC32C and
  SHA-256 (in the trainer each host streams only the files it wrote; here one host wrote them all).
- ``restore-latest``: ``read-back`` reads every listed file whole, eight at a time, as restore-latest did;
  ``metadata`` is today's ``python -m recovery_steps.restore_latest`` ``run()`` over the same store (it also
  reads the run's config and ledger and writes its record).

Local files are warm in the page cache (just written; caches cannot be dropped here), so the local rows
measure CRC32C, SHA-256 and memory traffic, not the disk. The emulator keeps objects in memory; it is seeded
through its ``-data`` directory (hard links to the local files) rather than uploads. Ratios are of the
largest size to the smallest: flat is 1.

    .venv/bin/python bench/bench_integrity.py [--gb 0.25 1 4] [--backends local gcs]
    .venv/bin/python bench/bench_integrity.py --entries   # the in-memory part's time, 10,000 -> 80,000 entries
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

STEP = 50  # within the config's training.total_steps (60): restore-latest refuses later steps
FILES = 4
BLOCK = 64 << 20


def _peak_mib() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- the method before: read every byte back ---------------------------------------------------------


def readback_step_files(store, step: int) -> list[Any]:
    """The manifest's file list as the trainer built it before: each file read whole, then summed."""
    from jaxrec.adapters.checkpoints import crc32c_hex
    from jaxrec.adapters.store import RunLayout
    from jaxrec.model.records import ManifestFile

    base = RunLayout.checkpoint(step) + "/"
    out = []
    for obj in store.list(RunLayout.checkpoint(step)):
        rel = obj.name[len(base) :]
        if rel == RunLayout.MANIFEST:
            continue
        data = store.read_bytes(obj.name)
        out.append(ManifestFile(path=rel, size=len(data), crc32c=crc32c_hex(data)))
    return out


def readback_check(store, step: int) -> list[str]:
    """restore-latest's check before: every listed file read whole (eight at a time) and summed."""
    from jaxrec.adapters.checkpoints import crc32c_hex
    from jaxrec.adapters.store import RunLayout
    from jaxrec.model.records import CheckpointManifest

    m = store.read_record(RunLayout.checkpoint_manifest(step), CheckpointManifest)
    sizes = {o.name: o.size for o in store.list(RunLayout.checkpoint(step))}

    def crc(path: str) -> str | None:
        data = store.read_bytes(f"{RunLayout.checkpoint(step)}/{path}")
        return None if data is None else crc32c_hex(data)

    todo = [f for f in m.files if sizes.get(f"{RunLayout.checkpoint(step)}/{f.path}") == f.size]
    with ThreadPoolExecutor(8) as pool:
        return [f.path for f, got in zip(todo, pool.map(crc, [f.path for f in todo]), strict=True) if got != f.crc32c]


# ---- one measurement in a fresh process --------------------------------------------------------------


def child(what: str, method: str, root: str, run_id: str) -> dict[str, float]:
    """Run one measurement in this process; return seconds and peak memory (MiB)."""
    from support.ckpt_factory import tiny_config

    from jaxrec.adapters.checkpoints import step_files, write_manifest
    from jaxrec.adapters.store import RunStore
    from jaxrec.model.records import CheckpointManifest
    from recovery_steps import restore_latest

    store = RunStore(root, run_id)
    cfg = tiny_config(run_id=run_id)
    t = time.perf_counter()
    if what == "manifest" and method == "read-back":
        n = len(readback_step_files(store, STEP))
    elif what == "manifest":
        files = step_files(store, STEP)
        n = len(files)
        write_manifest(
            store,
            CheckpointManifest(
                step=STEP, run_id=run_id, attempt=0, config_hash=cfg.config_hash(), config=cfg.model_dump(mode="json"),
                code_version="bench", dataset_version=cfg.data.dataset_version, process_count=cfg.slice.num_hosts,
                mesh_shape={"data": cfg.slice.num_hosts}, library_versions={}, wall_time=time.time(), files=files,
            ),
        )  # fmt: skip
    elif method == "read-back":
        bad = readback_check(store, STEP)
        assert not bad, bad
        n = 0
    else:
        r = restore_latest.run(store, attempt=1)
        assert r.selection is not None and r.selection.step == STEP, r.selection
        n = 0
    return {"seconds": time.perf_counter() - t, "peak_mib": _peak_mib(), "files": n}


def measure(what: str, method: str, root: str, run_id: str, env: dict[str, str]) -> dict[str, float]:
    """``child`` in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", what, method, root, run_id],
        env={**os.environ, **env}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{what}/{method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- setup ------------------------------------------------------------------------------------------


def write_local_step(step_dir: Path, nbytes: int) -> None:
    """Four data files of ``nbytes / 4`` each (random blocks, written in pieces) and orbax's markers."""
    step_dir.joinpath("state", "ocdbt.process_0", "d").mkdir(parents=True, exist_ok=True)
    block = os.urandom(BLOCK)
    per = nbytes // FILES
    for i in range(FILES):
        with open(step_dir / "state" / "ocdbt.process_0" / "d" / f"{i:032x}", "wb") as f:
            left = per
            while left > 0:
                k = min(left, BLOCK)
                f.write(block[i : i + k] if k < BLOCK - i else block[:k])
                left -= k
    for name in ("_CHECKPOINT_METADATA", "commit_success.txt", "state/_METADATA", "data/process_0.json"):
        (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / name).write_text("{}")


BUCKET, PREFIX = "bench-bucket", "bench"


def seed_dir(data: Path, run_id: str, step_dir: Path) -> None:
    """Lay ``step_dir`` out as the emulator's ``-data`` directory (``<bucket>/<object name>``), by hard links.

    Uploading through the JSON API took minutes per GB (the emulator's request path, not the bytes); preloaded
    objects cost the emulator one read of each file at start (it computes their CRC32C and MD5 then, as GCS does
    on upload), and linking them costs no copy.
    """
    for p in sorted(step_dir.rglob("*")):
        if p.is_file():
            dst = data / BUCKET / PREFIX / "runs" / run_id / "checkpoints" / str(STEP) / p.relative_to(step_dir)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(p, dst)


class SeededEmulator:
    """fake-gcs-server (the project's emulator binary, in-memory backend) that starts with the objects of ``data``."""

    def __init__(self, data: Path):
        from workflows.local.emulator import GcsEmulator, _binary

        self.em = GcsEmulator()
        self.env = self.em.env
        self.cmd = [str(_binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                    "-port", str(self.em.port), "-external-url", self.em.url, "-log-level", "error",
                    "-data", str(data)]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.seconds = 0.0

    def __enter__(self) -> SeededEmulator:
        import urllib.error
        import urllib.request

        t = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while True:
            try:
                urllib.request.urlopen(f"{self.em.url}/storage/v1/b/{BUCKET}", timeout=5).read()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode}") from None
                time.sleep(0.1)
        self.seconds = time.perf_counter() - t
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(30)


def run(gbs: list[float], backends: list[str]) -> list[dict[str, Any]]:
    """Measure every backend x size x method; print the table and the ratios; return the rows."""
    from support.ckpt_factory import tiny_config, write_run_config

    from jaxrec.adapters.store import RunStore

    rows: list[dict[str, Any]] = []
    header = (
        f"{'backend':<8} {'GB':>5} {'method':<9} | {'manifest s':>10} {'peak MiB':>8} | {'restore-latest s':>16}"
        f" {'peak MiB':>8}"
    )
    print(
        f"checkpoint integrity vs size: {FILES} data files + 4 markers; fresh process per cell; {os.cpu_count()} CPUs"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp, contextlib.ExitStack() as stack:
        for gb in gbs:
            nbytes = int(gb * 2**30)
            src = Path(tmp) / "src"
            write_local_step(src, nbytes)
            for backend in backends:
                run_id = f"bench-{backend}-{str(gb).replace('.', 'p')}"
                cfg = tiny_config(run_id=run_id)
                env: dict[str, str] = {}
                if backend == "local":
                    root = f"{tmp}/store"
                    store = RunStore(root, run_id)
                    Path(store.url(f"checkpoints/{STEP}")).parent.mkdir(parents=True, exist_ok=True)
                    os.rename(src, store.url(f"checkpoints/{STEP}"))
                else:
                    data = Path(tmp) / "gcs-data"
                    seed_dir(data, run_id, src)
                    em = stack.enter_context(SeededEmulator(data))
                    print(f"  (emulator seeded with {gb:g} GB in {em.seconds:.1f} s)", flush=True)
                    root, env = f"gs://{BUCKET}/{PREFIX}", em.env
                    os.environ.update(env)
                    store = RunStore(root, run_id)
                write_run_config(store, cfg)
                cells = {}
                for method in ("read-back", "metadata"):
                    # The metadata manifest is the one restore-latest then checks (both methods check it).
                    cells[method] = (
                        measure("manifest", method, root, run_id, env),
                        None,
                    )
                for method in ("read-back", "metadata"):
                    cells[method] = (cells[method][0], measure("restore", method, root, run_id, env))
                for method, (m, r) in cells.items():
                    print(
                        f"{backend:<8} {gb:5.2f} {method:<9} | {m['seconds']:10.2f} {m['peak_mib']:8.0f} |"
                        f" {r['seconds']:16.2f} {r['peak_mib']:8.0f}",
                        flush=True,
                    )
                    rows.append({"backend": backend, "gb": gb, "method": method, "manifest": m, "restore": r})
                if backend == "local":
                    os.rename(store.url(f"checkpoints/{STEP}"), src)  # reused for the next backend
                else:
                    stack.close()  # the emulator and its memory go
                    shutil.rmtree(Path(tmp) / "gcs-data")
            shutil.rmtree(src, ignore_errors=True)
    print()
    lo, hi = min(gbs), max(gbs)
    print(f"ratios {hi:g} GB / {lo:g} GB (flat = 1; bytes grew {hi / lo:g}x):")
    for backend in backends:
        for method in ("read-back", "metadata"):
            a = next(r for r in rows if (r["backend"], r["gb"], r["method"]) == (backend, lo, method))
            b = next(r for r in rows if (r["backend"], r["gb"], r["method"]) == (backend, hi, method))
            print(
                f"  {backend:<6} {method:<9} manifest time x{b['manifest']['seconds'] / a['manifest']['seconds']:.2f},"
                f" restore-latest time x{b['restore']['seconds'] / a['restore']['seconds']:.2f},"
                f" restore-latest peak memory x{b['restore']['peak_mib'] / a['restore']['peak_mib']:.2f}"
                f" ({b['restore']['peak_mib']:.0f} MiB)"
            )
    return rows


def entries_growth(sizes: tuple[int, int] = (10_000, 80_000)) -> float:
    """The in-memory part of verification (the listing against the manifest) at two entry counts, best of 5 each,
    interleaved; prints and returns the time ratio (linear: the entries' ratio)."""
    from jaxrec.adapters import verify
    from jaxrec.adapters.store import ObjectInfo, RunStore
    from jaxrec.model.records import CheckpointManifest, ManifestFile

    store = RunStore(tempfile.mkdtemp(prefix="bench-entries-"), "bench")

    def timed(n: int) -> float:
        files = [ManifestFile(path=f"state/d/{i:08x}", size=1, crc32c="00000000") for i in range(n)]
        objs = [ObjectInfo(f.path, 1, 1, "00000000") for f in files]
        m = CheckpointManifest.model_construct(files=files)
        t = time.perf_counter()
        assert verify.file_problems(store, str(STEP), m, objs) == []
        return time.perf_counter() - t

    best = {n: float("inf") for n in sizes}
    for _ in range(5):
        for n in sizes:
            best[n] = min(best[n], timed(n))
    lo, hi = sizes
    ratio = best[hi] / best[lo]
    print(
        f"verification's in-memory part: {lo:,} entries {best[lo] * 1000:.1f} ms, {hi:,} entries "
        f"{best[hi] * 1000:.1f} ms: x{ratio:.2f} for x{hi / lo:g} the entries (linear: x{hi / lo:g}; quadratic: "
        f"x{(hi / lo) ** 2:g})"
    )
    return ratio


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    p.add_argument("--backends", nargs="+", default=["local", "gcs"], choices=["local", "gcs"])
    p.add_argument("--child", nargs=4, metavar=("WHAT", "METHOD", "ROOT", "RUN_ID"), help=argparse.SUPPRESS)
    p.add_argument("--entries", action="store_true", help="only how verification's time grows with the entries")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    if args.entries:
        entries_growth()
        return 0
    run(sorted(args.gb), args.backends)
    return 0


if __name__ == "__main__":
    sys.exit(main())
