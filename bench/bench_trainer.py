"""Trainer benchmarks, measured side by side in one run and printed as ratios.

1. steps/s with asynchronous checkpoints every K steps vs no checkpoints vs synchronous checkpoints (runs
   interleaved, medians), the time each save blocks the training loop, and the peak RSS of a worker;
2. time from SIGKILL of one worker to the exit of the last survivor (median of a few runs);
3. time to the first step with a warm vs a cold persistent compilation cache, for the whole gang (the
   slowest process decides when the gang's first step is done), with each process's cache hits.

4. (``--loop``) the trainer against the bare ``jax.jit`` step loop of the same model (the same step function,
   data iterator and batch assembly, no hooks, no telemetry, no saves, no host read of the loss until the end):
   steps/s, tokens/s, TFLOP/s and MFU on this machine's accelerator (a gang of one; the CPU where there is none),
   for a tiny, a 134.6M and a 269M model; then the two larger models with a save every ``--save-every`` steps
   against none: the steps/s kept, the time each save cost the loop (measured) against the ``blocking_seconds``
   the trainer reported, and each worker's peak host memory.

Usage: python bench/bench_trainer.py [--hosts 4] [--steps 60] [--interval 10] [--repeats 3] [--kills 3]
       [--cache-repeats 2] [--only-checkpoints | --only-cache]
       python bench/bench_trainer.py --loop [--models tiny,134.6M,269M] [--loop-steps 300] [--save-every 100]
              [--steps-ahead 16] [--saves-only] [--pairs 3]
       python bench/bench_trainer.py --save-probe [--models 134.6M] [--loop-steps 300] [--save-every 100]
       python bench/bench_trainer.py --host-copy [--models 134.6M,269M]

5. (``--host-copy``) what a save's copy of the model's state into each host memory kind costs: the transfer the
   step after a save waits for on the device where no second copy fits beside the step (``HOST_MEMORY_KINDS``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.trainer_harness import jax_platform, launch, read_report, tiny_config, write_config  # noqa: E402

from jaxrec.model.records import EventKind  # noqa: E402


def steady_rate(gang, index: int = 0) -> float:
    """Steps per second from the second step to the last one (compilation excluded)."""
    ts = [(e.step, e.t) for e in gang.events(index) if e.event == EventKind.STEP]
    (s0, t0), (s1, t1) = ts[1], ts[-1]
    return (s1 - s0) / (t1 - t0)


def checkpoint_modes(interval: int, steps: int) -> dict[str, dict]:
    """The checkpoint sections compared: none, asynchronous and synchronous saves every ``interval`` steps.

    "none" saves only the last step, after the loop (the config refuses an interval beyond the run).
    """
    return {
        "none": {"interval_steps": steps, "async_save": True},
        f"async every {interval}": {"interval_steps": interval, "async_save": True},
        f"sync every {interval}": {"interval_steps": interval, "async_save": False},
    }


def bench_checkpoint_overhead(work: Path, hosts: int, steps: int, interval: int, repeats: int) -> dict[str, dict]:
    """Steady steps/s of otherwise identical runs, the modes interleaved (rotated each round) ``repeats`` times.

    Returns, per mode: ``rates`` (one per run), ``blocking`` (seconds the training thread spent in each
    save, the slowest worker's), ``rss`` (peak RSS MiB of each worker of each run).
    """
    modes = checkpoint_modes(interval, steps)
    names = list(modes)
    out: dict[str, dict] = {n: {"rates": [], "blocking": [], "parts": [], "rss": []} for n in names}
    run = 0
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            d = work / f"ckpt-{run}"
            cfg = tiny_config(str(d / "store"), run_id=f"bench-ckpt-{run}", hosts=hosts,
                              training={"total_steps": steps, "compile_grace_s": 600},
                              checkpoint={**modes[name], "keep": 3})  # fmt: skip
            store = write_config(cfg)
            gang = launch(cfg, 0, -1, d)
            codes = gang.wait(600)
            if codes != [0] * hosts:
                raise SystemExit(f"{name}: exit codes {codes}\n{gang.log(0)[-2000:]}")
            out[name]["rates"].append(steady_rate(gang))
            per_step: dict[int, float] = {}
            parts: dict[int, dict[str, float]] = {}
            for i in range(hosts):
                for e in gang.events(i):
                    if e.event == EventKind.SAVE_COST and e.blocking_seconds is not None:
                        if e.blocking_seconds >= per_step.get(e.step, -1.0):
                            per_step[e.step] = e.blocking_seconds
                            parts[e.step] = e.blocking_parts or {}
            # The last save is not in the loop: it is waited for before the exit.
            out[name]["blocking"] += [v for k, v in per_step.items() if k < steps]
            out[name]["parts"] += [v for k, v in parts.items() if k < steps]
            out[name]["rss"] += [(read_report(store, 0, i) or {}).get("peak_rss_mib") or 0.0 for i in range(hosts)]
            run += 1
    return out


def bench_kill(work: Path, hosts: int, runs: int) -> list[tuple[int, float, list[int | None]]]:
    """(victim, seconds from SIGKILL to the last survivor's exit, exit codes) per run."""
    out = []
    for r in range(runs):
        victim = [1, 0, hosts - 1][r % 3]
        d = work / f"kill-{r}"
        cfg = tiny_config(str(d / "store"), run_id=f"bench-kill-{r}", hosts=hosts,
                          training={"total_steps": 1000, "step_delay_s": 0.02})  # fmt: skip
        write_config(cfg)
        gang = launch(cfg, 0, -1, d)
        gang.wait_for(victim, EventKind.STEP, 8)
        killed = gang.signal(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        ends = {}
        while len(ends) < hosts and time.monotonic() < deadline:
            for i, p in enumerate(gang.procs):
                if i not in ends and p.poll() is not None:
                    ends[i] = time.time()
            time.sleep(0.005)
        codes = gang.wait(1)
        last = max(t for i, t in ends.items() if i != victim)
        out.append((victim, last - killed, codes))
    return out


def bench_compile_cache(work: Path, hosts: int, repeats: int) -> list[dict[str, dict]]:
    """Cold then warm persistent compilation cache, ``repeats`` pairs, each pair with a new cache directory.

    Per run and process: seconds from worker start and from joining the gang (``initialized``) to the end
    of the first step, the restore and step-compile phases (overlapped), and the cache hits/requests of
    the compilations before the first step (``first_step`` event).
    """
    out = []
    for r in range(repeats):
        cache = work / f"xla-cache-{r}"
        pair: dict[str, dict] = {}
        for name in ("cold", "warm"):
            d = work / f"cache-{r}-{name}"
            cfg = tiny_config(str(d / "store"), run_id=f"bench-cache-{r}-{name}", hosts=hosts,
                              training={"total_steps": 3, "compilation_cache_dir": str(cache),
                                        "compile_grace_s": 600},
                              checkpoint={"interval_steps": 3})  # fmt: skip
            write_config(cfg)
            gang = launch(cfg, 0, -1, d)
            if gang.wait(300) != [0] * hosts:
                raise SystemExit(f"cache {name}: {gang.log(0)[-2000:]}")
            per = []
            for i in range(hosts):
                ev = {e.event: e for e in gang.events(i)}
                first, compiled = ev[EventKind.FIRST_STEP], ev.get(EventKind.COMPILED)
                per.append({"from_start": first.t - ev[EventKind.STARTED].t,
                            "from_init": first.t - ev[EventKind.INITIALIZED].t,
                            "restore": ev[EventKind.RESTORED].restore_seconds or 0.0,
                            "compile": (compiled.compile_seconds if compiled else None) or 0.0,
                            "hits": first.cache_hits, "requests": first.cache_requests})  # fmt: skip
            pair[name] = {"per_process": per, "gang_from_init": max(p["from_init"] for p in per),
                          "gang_from_start": max(p["from_start"] for p in per)}  # fmt: skip
        out.append(pair)
    return out


# The models of the loop bench: the tiny one of configs/local-tpu.yaml, and two that fill a v5e chip's step with
# matrix work (d_model 1024, seq 256, batch 64; 8 layers and a 32k vocabulary, 16 layers and a 64k one).
LOOP_MODELS: dict[str, dict] = {
    "tiny": {"model": {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024, "seq_len": 128},
             "batch": 32},
    "134.6M": {"model": {"vocab_size": 32768, "d_model": 1024, "n_layers": 8, "n_heads": 8, "d_ff": 4096,
                         "seq_len": 256}, "batch": 64},
    "269M": {"model": {"vocab_size": 65536, "d_model": 1024, "n_layers": 16, "n_heads": 8, "d_ff": 4096,
                       "seq_len": 256}, "batch": 64},
}  # fmt: skip
# Dense bf16 peak of one chip by JAX's device_kind (Cloud TPU docs, "TPU versions"); MFU is left out elsewhere.
PEAK_FLOPS = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12}
WARMUP_STEPS = 10


def loop_config(
    root: str, name: str, steps: int, save_every: int | None, accelerator: bool, cache: str, steps_ahead: int = 1
):
    """A gang of one training model ``name`` for ``steps`` steps, saving every ``save_every`` (None: at the end),
    dispatching ``steps_ahead`` steps beyond the one it reads."""
    m = LOOP_MODELS[name]
    return tiny_config(root, run_id=f"bench-loop-{name.replace('.', '-').lower()}", hosts=1, share_compile_cache=False,
                       slice={"local_devices": "accelerator" if accelerator else "cpu"},
                       model=m["model"], data={"global_batch_size": m["batch"], "num_records": 4 * m["batch"]},
                       training={"total_steps": steps, "compile_grace_s": 900, "hang_timeout_s": 600,
                                 "compilation_cache_dir": cache, "steps_ahead": steps_ahead},
                       checkpoint={"interval_steps": save_every or steps, "keep": 2})  # fmt: skip


def _bare_setup(config_json: str):
    """The config's compiled step, initial state, batch source and stop flags, as the trainer builds them."""
    import jax

    from jaxrec.model.config import parse_config
    from trainer import compile_cache, train_state
    from trainer import data as data_lib

    cfg = parse_config(json.loads(config_json))
    compile_cache.enable(cfg.training.compilation_cache_dir, platform=jax.devices()[0].platform, process_count=1)
    task = cfg.task.spec().build(cfg.task_options())
    tr = train_state.build(cfg, train_state.make_mesh(), task)
    source = data_lib.open_source(task, cfg.data)
    it = data_lib.make_iterator(cfg.data, source.examples, data_lib.DataPosition(cfg.data.seed, 0, 0), 0, 1)
    state = tr.init_fn(0)
    flags = train_state.stop_flags(tr, 0)

    def batch():
        return train_state.global_batch(tr, next(it), 1)

    compiled = tr.step_fn.lower(state, batch(), flags).compile()
    for _ in range(WARMUP_STEPS):
        state, loss, _stop = compiled(state, batch(), flags)
    jax.block_until_ready(loss)
    return compiled, state, batch, flags


def bare_loop(config_json: str, steps: int) -> dict:
    """The bare step loop of the config in ``config_json`` (run in a process of its own): its steady rate."""
    import jax

    compiled, state, batch, flags = _bare_setup(config_json)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    t0 = time.perf_counter()
    for _ in range(steps):
        state, loss, _stop = compiled(state, batch(), flags)
    float(loss)
    elapsed = time.perf_counter() - t0
    params = sum(x.size for x in jax.tree.leaves(state["params"]))
    dev = jax.devices()[0]
    return {"rate": steps / elapsed, "flops": float((cost or {}).get("flops", 0.0)), "params": int(params),
            "device": f"{dev.platform}:{dev.device_kind}", "kind": dev.device_kind}  # fmt: skip


SAVE_PROBES: dict[str, tuple[str, int | None, float]] = {
    # name: (what each save does, how many steps behind the loop reads the loss (None: only at the end), the GIL's
    # switch interval in seconds)
    "none": ("none", None, 0.005),
    "none, loss read 1 step behind": ("none", 1, 0.005),
    "device-to-host copy on a thread": ("d2h", None, 0.005),
    "orbax on a saver thread": ("orbax", None, 0.005),
    "orbax on a saver thread, loss 1 behind": ("orbax", 1, 0.005),
    "orbax on a saver thread, loss 1 behind, GIL 0.5 ms": ("orbax", 1, 0.0005),
    "orbax + file digests, loss 1 behind": ("orbax+digests", 1, 0.005),
    "orbax on a saver thread, loss 4 behind": ("orbax", 4, 0.005),
    "orbax on a saver thread, loss 16 behind": ("orbax", 16, 0.005),
}
"""The bare loop with each part of a save added (``--save-probe``): where a save's cost to the loop goes."""


def bare_saves(config_json: str, steps: int, every: int) -> dict:
    """The bare loop of the config with each of ``SAVE_PROBES`` in turn, in one process (one compile).

    Each probe runs ``steps`` steps and starts a save (its kind) at every ``every``-th step from ``every // 2`` on,
    each on a snapshot of the state taken as the trainer takes it (a jitted on-device copy); orbax with the
    trainer's handler and options. Returns, per probe: steps/s, saves, and the slowest iteration of the loop.
    """
    import shutil
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import orbax.checkpoint as ocp

    from jaxrec.adapters.checkpoints import CRC_THREADS, stream_digests
    from trainer import checkpointing as ck

    compiled, state, batch, flags = _bare_setup(config_json)
    snapshot = ck._snapshot_fn(state).lower(state).compile()
    ck.configure_orbax()
    root = Path(tempfile.mkdtemp(prefix="bench-save-probe-"))
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True, create=True)
    mgr = ocp.CheckpointManager(root, options=opts, item_handlers={"state": ocp.PyTreeCheckpointHandler(
        use_compression=False)})  # fmt: skip
    saver = ThreadPoolExecutor(1)
    counter = iter(range(1, 1_000_000))

    def orbax_save(snap, digests: bool) -> None:
        n = next(counter)
        mgr.save(n, args=ocp.args.Composite(state=ocp.args.PyTreeSave(snap, save_args=ck._save_args(snap))),
                 force=True)  # fmt: skip
        if digests:
            mgr.wait_until_finished()
            files = [f for f in (root / str(n)).rglob("*") if f.is_file()]
            with ThreadPoolExecutor(CRC_THREADS) as pool:
                list(pool.map(stream_digests, files))

    orbax_save(snapshot(state), False)  # orbax's first save sets itself up: not any probe's cost
    mgr.wait_until_finished()
    out = {}
    for probe, (kind, lag, switch) in SAVE_PROBES.items():
        sys.setswitchinterval(switch)
        pending, losses, saves, slowest = [], collections.deque(), 0, 0.0
        t0 = last = time.perf_counter()
        for i in range(1, steps + 1):
            state, loss, _stop = compiled(state, batch(), flags)
            if lag is not None:
                losses.append(loss)
                if len(losses) > lag:
                    float(losses.popleft())
            if kind != "none" and i % every == every // 2:
                snap = snapshot(state)
                saves += 1
                if kind == "d2h":
                    pending.append(saver.submit(jax.device_get, snap))
                else:
                    pending.append(saver.submit(orbax_save, snap, kind == "orbax+digests"))
            t = time.perf_counter()
            slowest, last = max(slowest, t - last), t
        float(loss)
        elapsed = time.perf_counter() - t0
        for f in pending:
            f.result(timeout=600)
        mgr.wait_until_finished()
        out[probe] = {"rate": steps / elapsed, "steps": steps, "saves": saves, "slowest_iteration_s": slowest,
                      "lag": lag}  # fmt: skip
    sys.setswitchinterval(0.005)
    saver.shutdown()
    mgr.close()
    shutil.rmtree(root, ignore_errors=True)  # a few copies of the model's state
    return out


def print_save_probe(name: str, every: int, probes: dict[str, dict]) -> None:
    """One model's save-probe table: each probe's steps/s against the bare loop's and its loss per save."""
    print(f"\n## {name}: where a save's cost goes (the bare loop, a save every {every} steps of each kind; kept and "
          "lost against the loop without saves that reads the loss as far behind, or never)")  # fmt: skip
    print(f"{'probe':<52} {'st/s':>7} {'kept':>6} {'lost s/save':>12} {'slowest iteration s':>20}")
    for probe, r in probes.items():
        n = r["saves"]
        same = [x for x in probes.values() if x["saves"] == 0 and x["lag"] == r["lag"]]
        base = (same or [probes["none"]])[0]["rate"]
        lost = (1 / r["rate"] - 1 / base) * r["steps"] / n if n else 0.0
        print(f"{probe:<52} {r['rate']:>7.2f} {r['rate'] / base:>6.3f} {lost:>12.3f} {r['slowest_iteration_s']:>20.3f}")


def host_copies(name: str, repeats: int = 3) -> dict:
    """Model ``name``'s state, as float32 arrays of its matrices' shapes three times over (parameters and Adam's
    two moments: 3.22 GB for the 269M model, whose trainer state is 3.2 GB), copied to each host memory kind the
    device has and fetched as numpy, ``repeats`` times each: the seconds until the copy is on the host."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from trainer.checkpointing import HOST_MEMORY_KINDS

    m = LOOP_MODELS[name]["model"]
    d, ff, layers = m["d_model"], m["d_ff"], m["n_layers"]
    shapes = [(m["vocab_size"], d)] + [(d, d)] * 4 * layers + [(d, ff), (ff, d)] * layers + [(d,)] * 4 * layers
    state = {f"{c}-{i}": jnp.full(s, float(i % 7), jnp.float32) for c in range(3) for i, s in enumerate(shapes)}
    jax.block_until_ready(state)
    have = {mem.kind for mem in jax.devices()[0].addressable_memories()}
    out: dict = {"bytes": sum(x.nbytes for x in jax.tree.leaves(state)), "kinds": {}}
    for kind in (k for k in HOST_MEMORY_KINDS if k in have):
        shardings = jax.tree.map(lambda x, k=kind: x.sharding.with_memory_kind(k), state)
        took = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            copy = jax.block_until_ready(jax.device_put(state, shardings, may_alias=False))
            took.append(time.perf_counter() - t0)
            del copy
        out["kinds"][kind] = took
    t0 = time.perf_counter()
    fetched = [np.asarray(x) for x in jax.tree.leaves(state)]  # each array's first fetch (numpy keeps it after)
    out["kinds"]["numpy (device_get)"] = [time.perf_counter() - t0]
    del fetched
    return out


def print_host_copies(name: str, r: dict) -> None:
    """One model's table: each host memory kind's copy of the state, first and later, in seconds and GB/s."""
    gb = r["bytes"] / 1e9
    print(f"\n## {name}: the state ({gb:.2f} GB) copied to the host's memory, by kind")
    print(f"{'memory kind':<20} {'first s':>8} {'later s (median)':>17} {'GB/s (later)':>13}")
    for kind, took in r["kinds"].items():
        later = statistics.median(took[1:]) if len(took) > 1 else took[0]
        print(f"{kind:<20} {took[0]:>8.3f} {later:>17.3f} {gb / later:>13.2f}")


def run_bare(cfg, steps: int, save_probe_every: int | None = None) -> dict:
    """``bare_loop`` of ``cfg`` in a child process (one program at a time may hold a chip); with
    ``save_probe_every``, ``bare_saves`` instead."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if cfg.slice.local_devices == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, __file__, "--bare", cfg.model_dump_json(), "--loop-steps", str(steps)]
    if save_probe_every:
        cmd += ["--bare-saves", "--save-every", str(save_probe_every)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"bare loop: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_trainer(cfg, work: Path) -> dict:
    """The trainer on ``cfg`` as a gang of one: steady steps/s after warm-up, each save's blocking_seconds, RSS."""
    store = write_config(cfg)
    gang = launch(cfg, 0, -1, work)
    codes = gang.wait(900)
    if codes != [0]:
        raise SystemExit(f"trainer: exit codes {codes}\n{gang.log(0)[-3000:]}")
    events = gang.events(0)
    steps = [(e.step, e.t) for e in events if e.event == EventKind.STEP and e.step > WARMUP_STEPS]
    (s0, t0), (s1, t1) = steps[0], steps[-1]
    total = cfg.training.total_steps

    def saves(kind: EventKind) -> list:
        return [e for e in events if e.event == kind and s0 < e.step < s1 and e.step != total]

    span = saves(EventKind.SAVE_COST)
    blocking = [e.blocking_seconds or 0.0 for e in span]
    if span:  # the last save in the span is waited for by the final one, after the span: not the span's cost
        from trainer.checkpointing import COMMIT_WAIT_PART

        blocking[-1] -= (span[-1].blocking_parts or {}).get(COMMIT_WAIT_PART, 0.0)
    report = read_report(store, 0, 0) or {}
    return {"rate": (s1 - s0) / (t1 - t0), "span": (s0, s1), "elapsed": t1 - t0, "blocking": blocking,
            "reads": steps, "windows_of": [e.step for e in span],
            "rss": report.get("peak_rss_mib") or 0.0,
            "save_s": [e.save_seconds for e in saves(EventKind.SAVE_COMMITTED) if e.save_seconds is not None],
            "parts": [e.blocking_parts or {} for e in span]}  # fmt: skip


def brief(run: dict) -> dict:
    """A ``run_trainer`` result without its per-step reads, to print."""
    return {k: v for k, v in run.items() if k != "reads"}


def window_loss(reads: list[tuple[int, float]], save_steps: list[int], rate: float) -> dict[str, float]:
    """Where a run's lost time sits: for the steps before its first save and from each save's step to the next
    save's, the seconds they took beyond their count at ``rate`` (the run without saves); the windows add up to
    the run's whole loss, so each save's figure is comparable with the ``blocking_seconds`` it reported."""
    out: dict[str, float] = {}
    for lo, hi, name in zip([None, *save_steps], [*save_steps, None], ["before", *map(str, save_steps)], strict=True):
        window = [(s, t) for s, t in reads if (lo is None or s >= lo) and (hi is None or s <= hi)]
        if len(window) > 1:
            (s0, t0), (s1, t1) = window[0], window[-1]
            out[name] = round(t1 - t0 - (s1 - s0) / rate, 3)
    return out


def bench_loop(
    work: Path,
    models: list[str],
    steps: int,
    save_every: int,
    accelerator: bool,
    steps_ahead: int = 1,
    saves_only: bool = False,
    pairs: int = 1,
) -> None:
    """Trainer vs bare loop for each model, then save every ``save_every`` vs none for the larger ones
    (``saves_only``: the second part alone), in ``pairs`` pairs of runs one after the other."""
    cache = str(work / "xla-cache")
    rows, saves = [], []
    for name in models:
        if saves_only and name == "tiny":
            continue
        for pair in range(pairs if name != "tiny" else 1):
            cfg = loop_config(str(work / f"{name}-none-{pair}" / "store"), name, steps + WARMUP_STEPS, None,
                              accelerator, cache, steps_ahead)  # fmt: skip
            none = run_trainer(cfg, work / f"{name}-none-{pair}")
            if not saves_only and pair == 0:
                bare = run_bare(cfg, steps)
                rows.append((name, cfg, bare, none))
                print(f"measured {name}: bare {bare}, trainer {brief(none)}", flush=True)
            if name != "tiny":
                cfg_s = loop_config(str(work / f"{name}-save-{pair}" / "store"), name, steps + WARMUP_STEPS,
                                    save_every, accelerator, cache, steps_ahead)  # fmt: skip
                saves.append((name, none, run_trainer(cfg_s, work / f"{name}-save-{pair}")))
                print(f"measured {name} saving every {save_every}: {brief(saves[-1][2])}", flush=True)
    if rows:
        print_loop_table(rows, steps, steps_ahead)
    if saves:
        print_save_table(saves, save_every)


def print_loop_table(rows: list[tuple], steps: int, steps_ahead: int) -> None:
    """The trainer against the bare loop, per model."""
    print(f"\n## the trainer vs the bare jit step loop, a gang of one on {rows[0][2]['device']} "
          f"({steps} steps after {WARMUP_STEPS} of warm-up; no save inside the measured span; the trainer "
          f"dispatching {steps_ahead} steps ahead)")  # fmt: skip
    print(f"{'model':<8} {'params':>8} {'bare st/s':>10} {'trainer st/s':>13} {'ratio':>6} {'tokens/s':>10} "
          f"{'TFLOP/s':>8} {'MFU':>6} {'peak RSS MiB':>13}")  # fmt: skip
    for name, cfg, bare, none in rows:
        tokens = cfg.data.global_batch_size * cfg.model.seq_len
        tflops = bare["flops"] * none["rate"] / 1e12
        peak = PEAK_FLOPS.get(bare["kind"])
        mfu = f"{tflops * 1e12 / peak:.1%}" if peak and bare["flops"] else "-"
        print(f"{name:<8} {bare['params'] / 1e6:>7.1f}M {bare['rate']:>10.2f} {none['rate']:>13.2f} "
              f"{none['rate'] / bare['rate']:>6.3f} {tokens * none['rate']:>10.0f} {tflops:>8.1f} {mfu:>6} "
              f"{none['rss']:>13.0f}")  # fmt: skip
    print("target: trainer / bare >= 0.97 on the two larger models, >= 0.90 on the tiny one; MFU >= 55% (134.6M)")


def print_save_table(saves: list[tuple], save_every: int) -> None:
    """A save every ``save_every`` steps against none, per model: kept, lost per save, blocking_seconds."""
    print(f"\n## a save every {save_every} steps vs none (asynchronous saves; measured loss per save = extra "
          "seconds of the run with saves / saves in the span; 'from 1st': the same from the first save's step on, "
          "without the steps before it, where the two runs differ by their own spread alone)")  # fmt: skip
    print(f"{'model':<8} {'none st/s':>10} {'saving st/s':>12} {'kept':>6} {'saves':>6} {'lost s/save':>12} "
          f"{'blocking_s':>11} {'reported/lost':>14} {'lost from 1st':>14} {'reported/that':>14}")  # fmt: skip
    for name, none, saving in saves:
        n = len(saving["blocking"])
        lost, reported = save_loss(none, saving)
        share = reported / lost if lost > 0 else float("nan")
        windows = window_loss(saving["reads"], saving["windows_of"], none["rate"])
        after = sum(v for k, v in windows.items() if k != "before") / n if n else float("nan")
        print(f"{name:<8} {none['rate']:>10.2f} {saving['rate']:>12.2f} {saving['rate'] / none['rate']:>6.3f} "
              f"{n:>6} {lost:>12.3f} {reported:>11.3f} {share:>14.2f} {after:>14.3f} "
              f"{reported / after if after > 0 else float('nan'):>14.2f}")  # fmt: skip
        print(f"{name}: seconds lost, before the first save and from each save to the next: {windows}")
    for name in dict.fromkeys(n for n, _, _ in saves):
        mine = [(none, saving) for n, none, saving in saves if n == name]
        if len(mine) > 1:  # one pair's loss is within the runs' own spread: the mean over pairs is the figure
            kept = statistics.mean(saving["rate"] / none["rate"] for none, saving in mine)
            losses = [save_loss(none, saving) for none, saving in mine]
            lost, reported = (statistics.mean(x) for x in zip(*losses, strict=True))
            spread = max(none["rate"] for none, _ in mine) / min(none["rate"] for none, _ in mine) - 1
            print(f"{name}: mean of {len(mine)} pairs: kept {kept:.3f}, lost {lost:.3f} s a save, reported "
                  f"{reported:.3f} s ({reported / lost if lost > 0 else float('nan'):.2f}); the runs without saves "
                  f"differ by {spread:.1%}")  # fmt: skip
    print("target: kept >= 0.97 (134.6M), >= 0.95 (269M); blocking_seconds within 10% of the measured loss")
    for name, _none, saving in saves:
        if saving["save_s"]:
            print(f"{name}: a save takes {statistics.median(saving['save_s']):.2f} s from its start to its commit "
                  f"(median of {len(saving['save_s'])}); the loop's share of it, by part:")  # fmt: skip
        if saving["parts"]:
            print_blocking_parts(saving["parts"])


def save_loss(none: dict, saving: dict) -> tuple[float, float]:
    """The seconds a save cost the run with saves against the one without (measured), and what it reported."""
    n = len(saving["blocking"])
    if not n:
        return float("nan"), float("nan")
    span = saving["span"][1] - saving["span"][0]
    return (saving["elapsed"] - span / none["rate"]) / n, statistics.mean(saving["blocking"])


def has_accelerator() -> bool:
    """Whether JAX finds an accelerator here (asked in a child process, which lets the chip go when it ends)."""
    rc, platform = jax_platform()
    return rc == 0 and platform != "cpu"


def print_blocking_parts(parts: list[dict[str, float]]) -> None:
    """Median of each part of a save's blocking time (the slowest worker's save, per step)."""
    names = sorted({k for p in parts for k in p}, key=lambda k: -statistics.median(p.get(k, 0.0) for p in parts))
    for k in names:
        vals = [p.get(k, 0.0) for p in parts]
        print(f"  {k:<44} {statistics.median(vals):>7.4f} s (max {max(vals):.4f})")


def main(argv: list[str] | None = None) -> None:
    """Run the three benchmarks and print their tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="runs of each checkpoint mode, interleaved")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--cache-repeats", type=int, default=2, help="cold/warm compilation cache pairs")
    p.add_argument("--only-checkpoints", action="store_true", help="skip the kill and compile-cache benchmarks")
    p.add_argument("--only-cache", action="store_true", help="only the compilation-cache benchmark")
    p.add_argument("--loop", action="store_true", help="only the trainer vs bare loop and save-cost benchmark")
    p.add_argument("--models", default="tiny,134.6M,269M", help="the --loop models, comma-separated")
    p.add_argument("--loop-steps", type=int, default=300, help="measured steps of each --loop run")
    p.add_argument("--save-every", type=int, default=100, help="the --loop save interval")
    p.add_argument("--steps-ahead", type=int, default=16, help="the --loop trainer's training.steps_ahead")
    p.add_argument("--cpu", action="store_true", help="--loop on the CPU even where there is an accelerator")
    p.add_argument("--saves-only", action="store_true", help="--loop: only the save cost (no bare loop, no tiny)")
    p.add_argument("--pairs", type=int, default=1, help="--loop: pairs of runs without and with saves, per model")
    p.add_argument(
        "--save-probe",
        action="store_true",
        help="only the bare loop with each part of a save added (--models, --loop-steps, --save-every)",
    )
    p.add_argument("--host-copy", action="store_true", help="only the copy of each model's state to host memory")
    p.add_argument("--bare", help=argparse.SUPPRESS)  # internal: the bare loop of this config JSON
    p.add_argument("--bare-saves", action="store_true", help=argparse.SUPPRESS)  # internal: with SAVE_PROBES
    a = p.parse_args(argv)
    if a.bare:
        out = bare_saves(a.bare, a.loop_steps, a.save_every) if a.bare_saves else bare_loop(a.bare, a.loop_steps)
        print(json.dumps(out))
        return
    if a.host_copy:  # in this process: one program at a time may hold a chip, and nothing else runs
        for name in a.models.split(","):
            print_host_copies(name, host_copies(name))
        return
    if a.save_probe:
        with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
            accelerator = not a.cpu and has_accelerator()
            for name in a.models.split(","):
                cfg = loop_config(str(Path(tmp) / name / "store"), name, a.loop_steps, None, accelerator,
                                  str(Path(tmp) / "xla-cache"))  # fmt: skip
                print_save_probe(name, a.save_every, run_bare(cfg, a.loop_steps, a.save_every))
        return
    if a.loop:
        with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
            accelerator = not a.cpu and has_accelerator()
            bench_loop(Path(tmp), a.models.split(","), a.loop_steps, a.save_every, accelerator, a.steps_ahead,
                       a.saves_only, a.pairs)  # fmt: skip
        return
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        work = Path(tmp)
        if a.only_cache:
            print_cache(bench_compile_cache(work, a.hosts, a.cache_repeats), a.hosts)
            return
        res = bench_checkpoint_overhead(work, a.hosts, a.steps, a.interval, a.repeats)
        med = {name: statistics.median(r["rates"]) for name, r in res.items()}
        base = med["none"]
        print(f"\n## steps/s, {a.hosts} local processes, {a.steps} steps, tiny model (steady state, compile "
              f"excluded; modes interleaved, {a.repeats} runs each, medians)")  # fmt: skip
        print(f"{'checkpoints':<16} {'steps/s':>8} {'vs none':>8} {'runs':>20} {'save blocks loop s':>19}")
        for name, r in res.items():
            runs = " ".join(f"{x:.2f}" for x in r["rates"])
            block = f"{statistics.median(r['blocking']):.3f}" if r["blocking"] else "-"
            print(f"{name:<16} {med[name]:>8.2f} {med[name] / base:>8.3f} {runs:>20} {block:>19}")
        print("target: async / none >= 0.98")
        for name, r in res.items():
            if r["parts"]:
                print(f"blocking time of one save, {name}, by part (medians over saves):")
                print_blocking_parts(r["parts"])
        rss = [x for r in res.values() for x in r["rss"]]
        print(f"peak RSS of a worker: max {max(rss):.0f} MiB, median {statistics.median(rss):.0f} MiB "
              "(target <= 1024 MiB)")  # fmt: skip

        if a.only_checkpoints:
            return
        kills = bench_kill(work, a.hosts, a.kills)
        print(f"\n## SIGKILL of one worker -> last survivor exited ({a.hosts} processes, heartbeat timeout 5 s)")
        print(f"{'victim':>6} {'seconds':>8}  exit codes")
        for victim, secs, codes in kills:
            print(f"{victim:>6} {secs:>8.2f}  {codes}")
        print(f"median {statistics.median(s for _, s, _ in kills):.2f} s (target <= 3 s; <= 10 s when only "
              "heartbeats or the watchdog can tell)")  # fmt: skip

        print_cache(bench_compile_cache(work, a.hosts, a.cache_repeats), a.hosts)


def print_cache(pairs: list[dict[str, dict]], hosts: int) -> None:
    """The compilation-cache table: per run, the gang's time to first step and each process's cache hits."""
    print(f"\n## time to first step, {hosts} processes, persistent compilation cache cold vs warm")
    print(f"{'run':<8} {'joined->1st step':>17} {'start->1st step':>16}  "
          "per process: joined->1st step s [restore s | step compile s] (cache hits/requests)")  # fmt: skip
    for r, pair in enumerate(pairs):
        for name in ("cold", "warm"):
            x = pair[name]
            per = " ".join(f"{p['from_init']:.2f}[{p['restore']:.2f}|{p['compile']:.2f}]({p['hits']}/{p['requests']})"
                           for p in x["per_process"])  # fmt: skip
            print(f"{name}-{r:<3} {x['gang_from_init']:>17.2f} {x['gang_from_start']:>16.2f}  {per}")
    ratio = statistics.median(p["warm"]["gang_from_init"] / p["cold"]["gang_from_init"] for p in pairs)
    ratio_start = statistics.median(p["warm"]["gang_from_start"] / p["cold"]["gang_from_start"] for p in pairs)
    print(f"warm / cold, whole gang (its slowest process): joined->first step {ratio:.2f} (target <= 0.5); "
          f"start->first step {ratio_start:.2f} (imports and jax.distributed start-up are not cached)")  # fmt: skip


if __name__ == "__main__":
    main()
