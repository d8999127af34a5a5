"""Trainer benchmarks, measured side by side in one run and printed as ratios.

1. steps/s with asynchronous checkpoints every K steps vs no checkpoints vs synchronous checkpoints (runs
   interleaved, medians), the time each save blocks the training loop, and the peak RSS of a worker;
2. time from SIGKILL of one worker to the exit of the last survivor (median of a few runs);
3. time to the first step with a warm vs a cold persistent compilation cache, for the whole gang (the
   slowest process decides when the gang's first step is done), with each process's cache hits.

Usage: python bench/bench_trainer.py [--hosts 4] [--steps 60] [--interval 10] [--repeats 3] [--kills 3]
       [--cache-repeats 2] [--only-checkpoints | --only-cache]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.trainer_harness import launch, read_report, tiny_config, write_config  # noqa: E402

from recovery_steps.kernel.records import EventKind  # noqa: E402


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
                    if e.event == EventKind.SAVE_COMMITTED and e.blocking_seconds is not None:
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
    a = p.parse_args(argv)
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
