"""Goodput of a local run with a failure every M steps, measured as time and split by badput category.

Step goodput = steps kept / steps computed; time goodput = productive time / wall (and uninterrupted wall / wall);
cost per failure = (wall with failures - wall without) / failures. Kill points are spread uniformly over the
checkpoint interval across several runs, not only its worst phase.
Usage: python bench/bench_goodput.py [--total 300] [--every 100] [--interval 10] [--runs 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml

from jaxrec.model.config import load_config
from jaxrec.model.totals import CATEGORIES, CATEGORY_HELP, goodput
from workflows import local
from workflows.build import render_workflow
from workflows.report import load_events, open_run


def compile_workflow(d: Path, total: int, interval: int) -> Path:
    data = yaml.safe_load(open("configs/local-cpu.yaml"))
    data["storage"]["root"] = str(d / "store")
    data["model"].update(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=16)
    data["training"].update(total_steps=total, heartbeat_timeout_s=3)
    data["checkpoint"].update(interval_steps=interval)
    data["retry"].update(default_backoff={"base_s": 0, "factor": 1, "max_s": 0})
    data["retry"]["budgets"] = {"infrastructure": 20}
    cfg = d / f"c{interval}.yaml"
    cfg.write_text(yaml.safe_dump(data))
    wf = d / f"w{interval}.yaml"
    wf.write_text(render_workflow(load_config(cfg), str(cfg)))
    return wf


def measure(wf: Path, run_id: str, inject: list[str]) -> dict:
    t0 = time.time()
    res = local.run(
        wf, local.LocalRunOptions(inject=inject, run_id=run_id, metrics_port=None, report=False), say=lambda _: None
    )
    wall = time.time() - t0
    g = goodput(load_events(open_run(res.store_url)))
    return {"status": res.status, "wall": wall, "failures": len(res.incidents), "goodput": g}


def kill_points(total: int, every: int, interval: int, run: int, runs: int) -> list[int]:
    """Kill steps of one run: one kill per ``every`` steps, its phase in the checkpoint interval spread over runs.

    Run ``r`` of ``R`` kills at ``every * j + 1 + (r * interval) // R``: over the runs the kill lands uniformly
    on every phase of the interval (just after a checkpoint ... just before the next), not only the worst one.
    """
    offset = 1 + (run * interval) // runs
    return [every * j + offset for j in range(1, total // every) if every * j + offset < total]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total", type=int, default=300)
    p.add_argument("--every", type=int, default=100, help="a worker is killed every this many steps")
    p.add_argument("--interval", type=int, default=10, help="checkpoint interval")
    p.add_argument("--runs", type=int, default=3, help="runs with failures (kill phases spread over the interval)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        wf = compile_workflow(d, a.total, a.interval)
        rows = {"no failures": measure(wf, "none", [])}
        for r in range(a.runs):
            kills = kill_points(a.total, a.every, a.interval, r, a.runs)
            rows[f"kills at {','.join(map(str, kills))}"] = measure(wf, f"kill{r}", [f"kill-worker@{k}" for k in kills])
    base = rows["no failures"]
    print(
        f"{a.total} steps, 4 local hosts, checkpoint every {a.interval}, a kill every {a.every} (SIGKILL of one "
        f"worker); {a.runs} runs with the kill phase spread uniformly over the interval"
    )
    print(
        "step goodput = steps kept / computed; time goodput = productive time / wall; vs none = uninterrupted "
        "wall / wall; cost = (wall - uninterrupted wall) / failures"
    )
    cols = ("fails", "step gp", "time gp", "vs none", "wall s", "cost s")
    print(f"{'run':28} {'status':10} " + " ".join(f"{c:>7}" for c in cols))
    costs, per_failure = [], {c: 0.0 for c in CATEGORIES}
    n_fail = 0
    for name, r in rows.items():
        g = r["goodput"]
        cost = (r["wall"] - base["wall"]) / r["failures"] if r["failures"] else 0.0
        if r["failures"]:
            costs.append(cost)
            n_fail += r["failures"]
            for c in CATEGORIES:
                per_failure[c] += g.badput[c] - base["goodput"].badput[c]
        print(
            f"{name[:28]:28} {r['status']:10} {r['failures']:5d} {g.step_goodput:7.3f} {g.time_goodput:7.3f} "
            f"{base['wall'] / r['wall']:7.3f} {r['wall']:7.1f} {cost:7.1f}"
        )
    if n_fail:
        print(
            f"mean wall-clock cost per failure: {sum(costs) / len(costs):.1f} s (target <= 6 s); where it goes, "
            "per failure (extra over the uninterrupted run):"
        )
        for c in CATEGORIES:
            print(f"  {c:22} {per_failure[c] / n_fail:6.2f} s  {CATEGORY_HELP[c]}")
    print("targets (DESIGN): step goodput >= 0.95, time goodput vs none >= 0.85, cost per failure <= 6 s")


if __name__ == "__main__":
    main()
