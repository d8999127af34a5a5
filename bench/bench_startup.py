"""Start-up of a restarted gang against its floor, measured side by side in one run.

A restarted attempt spends most of its recovery before the first step: starting the processes, importing
JAX and the libraries, joining the gang, restoring, compiling (from the warm cache). Part of that is the
recovery machinery's own work (config and manifest checks, the restore, barriers, hooks); the rest is what
any process running this model on this gang must do. This benchmark measures both on the same config and
the same warm compilation cache, interleaved:

* **trainer**: ``python -m trainer`` restoring the step-10 checkpoint, from process start to the first step
  done (the slowest process decides when the gang's first step is done);
* **floor**: a bare worker of the same gang (``--floor-worker``): the same imports (orbax included), the
  coordinator wait and ``jax.distributed.initialize``, the same step function built, lowered and compiled
  from the same cache, then one step on a zero state; no restore, no checks, no hooks. The trainer's
  restore is part of the difference; its seconds are printed beside it.

It prints each one's median wall time, the per-worker CPU seconds (on a machine with fewer cores than
workers, start-up is CPU-bound: wall >= workers x CPU / cores), and the ratio floor / trainer.

Usage: python bench/bench_startup.py [--hosts 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def floor_worker(store_root: str, run_id: str, out: str) -> None:
    """One bare worker: imports, join, build + lower + compile the step, one step; writes its timings to ``out``."""
    import numpy as np

    from jaxrec.adapters.documents import read_run_config
    from jaxrec.adapters.store import RunStore
    from trainer import compile_cache
    from trainer.decisions import coordinator_to_wait_for, local_identity
    from trainer.lifecycle import wait_for_listener

    ident = local_identity(os.environ)
    store = RunStore(store_root, run_id)
    cfg = read_run_config(store)
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", cfg.slice.devices_per_host)
    addr = coordinator_to_wait_for(os.environ, ident)
    if addr is not None:
        wait_for_listener(addr, 60)
    jax.distributed.initialize(ident.coordinator_address, ident.num_processes, ident.process_id,
                               initialization_timeout=60, heartbeat_timeout_seconds=10)  # fmt: skip
    directory = compile_cache.cache_dir(cfg, store)
    assert directory is not None, "the benchmark needs the compilation cache on"
    cache = compile_cache.enable(directory, platform="cpu", process_count=jax.process_count())

    import orbax.checkpoint  # noqa: F401 - a restarted worker reads its checkpoint with it

    from trainer import data as data_lib
    from trainer import train_state
    from trainer.ahead import abstract_inputs

    task = cfg.task.spec().build(cfg.task_options())
    source = data_lib.open_source(task, cfg.data)
    tr = train_state.build(cfg, train_state.make_mesh(), task)
    pi, pc = jax.process_index(), jax.process_count()
    local = data_lib.build_dataset(cfg.data, source.examples, cfg.data.seed, pi, pc)[0]
    compiled = tr.step_fn.lower(tr.abstract_state, *abstract_inputs(tr, local, pc)).compile()
    state = jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, a.sharding, lambda idx: np.zeros(a.shape, a.dtype)[idx]),
        tr.abstract_state,
    )
    batch = train_state.global_batch(tr, local, pc)
    flags = train_state.stop_flags(tr, 0)
    jax.block_until_ready(compiled(state, batch, flags))
    hits = cache.hits if cache is not None else None
    Path(out).write_text(json.dumps({"t": time.time(), "cpu_s": time.process_time(), "cache_hits": hits}))
    os._exit(0)  # as the trainer leaves: no distributed shutdown barrier


def _launch_floor(cfg, work: Path, tag: str) -> tuple[float, list[subprocess.Popen], list[Path]]:
    from support.trainer_harness import free_port, gang_env

    port, n = free_port(), cfg.slice.num_hosts
    procs, outs = [], []
    t0 = time.time()
    for i in range(n):
        out = work / f"floor-{tag}-{i}.json"
        outs.append(out)
        cmd = [sys.executable, str(Path(__file__)), "--floor-worker", cfg.storage.root, cfg.run_id, str(out)]
        procs.append(subprocess.Popen(cmd, env=gang_env(port, i, n, work / f"floor-events-{tag}"), cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))  # fmt: skip
    return t0, procs, outs


def run_floor(cfg, work: Path, tag: str) -> dict:
    """Wall seconds from spawning the bare gang to its last process's first step, and per-worker CPU."""
    t0, procs, outs = _launch_floor(cfg, work, tag)
    codes = [p.wait(300) for p in procs]
    if codes != [0] * len(procs):
        raise SystemExit(f"floor gang exited {codes}")
    rows = [json.loads(o.read_text()) for o in outs]
    return {"wall": max(r["t"] for r in rows) - t0, "cpu": [r["cpu_s"] for r in rows],
            "hits": [r["cache_hits"] for r in rows]}  # fmt: skip


def run_trainer(cfg, work: Path, attempt: int) -> dict:
    """Wall seconds from spawning the trainer gang (restoring step 10) to its last first step, and CPU."""
    from support.trainer_harness import launch

    from jaxrec.model.records import EventKind

    gang = launch(cfg, attempt, 10, work)
    codes = gang.wait(300)
    if codes != [0] * cfg.slice.num_hosts:
        raise SystemExit(f"trainer gang exited {codes}\n{gang.log(0)[-2000:]}")
    hosts = range(cfg.slice.num_hosts)
    firsts = [next(e for e in gang.events(i) if e.event == EventKind.FIRST_STEP) for i in hosts]
    restored = [next(e for e in gang.events(i) if e.event == EventKind.RESTORED) for i in hosts]
    return {"wall": max(e.t for e in firsts) - gang.started, "cpu": [e.cpu_s for e in firsts],
            "hits": [e.cache_hits for e in firsts],
            "restore": max(e.restore_seconds or 0.0 for e in restored)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--floor-worker", nargs=3, metavar=("STORE_ROOT", "RUN_ID", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.floor_worker:
        floor_worker(*a.floor_worker)
        return
    from support.trainer_harness import launch, tiny_config, write_config

    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        work = Path(tmp)
        cfg = tiny_config(str(work / "store"), run_id="bench-startup", hosts=a.hosts, share_compile_cache=False,
                          training={"total_steps": 12, "compile_grace_s": 600},
                          checkpoint={"interval_steps": 10, "async_save": True, "keep": 3})  # fmt: skip
        write_config(cfg)
        first = launch(cfg, 0, -1, work)  # writes the step-10 checkpoint and warms the cache
        if first.wait(600) != [0] * a.hosts:
            raise SystemExit(f"first attempt failed\n{first.log(0)[-2000:]}")
        runs: dict[str, list[dict]] = {"floor": [], "trainer": []}
        for r in range(a.repeats):
            order = ["floor", "trainer"] if r % 2 == 0 else ["trainer", "floor"]
            for kind in order:
                res = run_floor(cfg, work, str(r)) if kind == "floor" else run_trainer(cfg, work, r + 1)
                runs[kind].append(res)
                print(f"  run {r} {kind:8s} spawn -> first step {res['wall']:5.2f} s, CPU per worker "
                      f"{statistics.mean(res['cpu']):.2f} s, cache hits {res['hits']}", flush=True)  # fmt: skip
    cores = os.cpu_count() or 1
    print(f"\nstart-up of a restarted gang of {a.hosts} workers on {cores} cores ({a.repeats} runs each, medians):")
    med = {}
    for kind, rs in runs.items():
        wall = statistics.median(r["wall"] for r in rs)
        cpu = statistics.median(statistics.mean(r["cpu"]) for r in rs)
        med[kind] = wall
        bound = a.hosts * cpu / min(cores, a.hosts)
        print(f"  {kind:8s} spawn -> first step {wall:5.2f} s; CPU per worker {cpu:.2f} s "
              f"(CPU-bound at {bound:.2f} s: workers x CPU / cores)")  # fmt: skip
    restore = statistics.median(r["restore"] for r in runs["trainer"])
    print(f"  of the trainer's: the restore (slowest worker) {restore:.2f} s")
    print(f"  floor / trainer: {med['floor'] / med['trainer']:.2f} (1.0: the recovery machinery adds nothing)")
    print(f"  machinery's own share: {med['trainer'] - med['floor']:.2f} s of {med['trainer']:.2f} s")


if __name__ == "__main__":
    main()
