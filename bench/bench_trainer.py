"""Trainer benchmarks, measured side by side in one run and printed as ratios.

1. steps/s with asynchronous checkpoints every K steps vs no checkpoints vs synchronous checkpoints (runs
   interleaved, medians), the time each save blocks the training loop, and the peak RSS of a worker;
2. time from SIGKILL of one worker to the exit of the last survivor (median of a few runs);
3. time to the first step with a warm vs a cold persistent compilation cache (ONE process: on the CPU
   only process 0 of a gang writes cache entries and the cache key differs per process).

Usage: python bench/bench_trainer.py [--hosts 4] [--steps 60] [--interval 10] [--repeats 3] [--kills 3]
       [--only-checkpoints]
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

from trainer_harness import launch, read_report, tiny_config, write_config  # noqa: E402


def steady_rate(gang, index: int = 0) -> float:
    """Steps per second from the second step to the last one (compilation excluded)."""
    ts = [(e["step"], e["t"]) for e in gang.events(index) if e["event"] == "step"]
    (s0, t0), (s1, t1) = ts[1], ts[-1]
    return (s1 - s0) / (t1 - t0)


def checkpoint_modes(interval: int) -> dict[str, dict]:
    """The checkpoint sections compared: none, asynchronous and synchronous saves every ``interval`` steps."""
    return {
        "none": {"interval_steps": 10**6, "async_save": True},
        f"async every {interval}": {"interval_steps": interval, "async_save": True},
        f"sync every {interval}": {"interval_steps": interval, "async_save": False},
    }


def bench_checkpoint_overhead(work: Path, hosts: int, steps: int, interval: int, repeats: int) -> dict[str, dict]:
    """Steady steps/s of otherwise identical runs, the modes interleaved (rotated each round) ``repeats`` times.

    Returns, per mode: ``rates`` (one per run), ``blocking`` (seconds the training thread spent in each
    save, the slowest worker's), ``rss`` (peak RSS MiB of each worker of each run).
    """
    modes = checkpoint_modes(interval)
    names = list(modes)
    out: dict[str, dict] = {n: {"rates": [], "blocking": [], "rss": []} for n in names}
    run = 0
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            d = work / f"ckpt-{run}"
            cfg = tiny_config(str(d / "store"), run_id=f"bench-ckpt-{run}", hosts=hosts,
                              training={"total_steps": steps}, checkpoint={**modes[name], "keep": 3})  # fmt: skip
            store = write_config(cfg)
            gang = launch(cfg, 0, -1, d)
            codes = gang.wait(600)
            if codes != [0] * hosts:
                raise SystemExit(f"{name}: exit codes {codes}\n{gang.log(0)[-2000:]}")
            out[name]["rates"].append(steady_rate(gang))
            per_step: dict[int, float] = {}
            for i in range(hosts):
                for e in gang.events(i):
                    if e["event"] == "save_committed" and e.get("blocking_seconds") is not None:
                        per_step[e["step"]] = max(per_step.get(e["step"], 0.0), e["blocking_seconds"])
            out[name]["blocking"] += [v for k, v in per_step.items() if k < steps]  # the last save is not in the loop
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
        gang.wait_for(victim, "step", 8)
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


def bench_compile_cache(work: Path) -> dict[str, float]:
    """Seconds from worker start to the end of the first step, cold then warm cache (one process)."""
    cache = work / "xla-cache"
    out = {}
    for name in ("cold", "warm"):
        d = work / f"cache-{name}"
        cfg = tiny_config(str(d / "store"), run_id=f"bench-cache-{name}", hosts=1,
                          training={"total_steps": 3, "compilation_cache_dir": str(cache)})  # fmt: skip
        write_config(cfg)
        gang = launch(cfg, 0, -1, d)
        if gang.wait(300) != [0]:
            raise SystemExit(f"cache {name}: {gang.log(0)[-2000:]}")
        ev = {e["event"]: e for e in gang.events(0)}
        out[name] = ev["first_step"]["t"] - ev["restored"]["t"]
        out[f"{name} compile"] = ev["first_step"]["compile_seconds"]
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the three benchmarks and print their tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="runs of each checkpoint mode, interleaved")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--only-checkpoints", action="store_true", help="skip the kill and compile-cache benchmarks")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        work = Path(tmp)
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

        cache = bench_compile_cache(work)
        print("\n## time to first step (restore done -> first step done), ONE process, persistent compilation cache")
        print(f"{'cache':<6} {'seconds':>8} {'compile+run':>12}")
        for name in ("cold", "warm"):
            print(f"{name:<6} {cache[name]:>8.2f} {cache[name + ' compile']:>12.2f}")
        print(f"warm / cold = {cache['warm'] / cache['cold']:.2f} (target <= 0.5)")


if __name__ == "__main__":
    main()
