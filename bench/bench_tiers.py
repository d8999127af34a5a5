"""Checkpoint tiers: steps lost and restore time per failure by tier against GCS-only; the local tier's steady cost.

One run of this script measures, side by side, on the GCS emulator (the run store is gs://), for each model size:

* GCS-only (``checkpoint.interval_steps`` = N) with a worker killed at each kill point;
* the same GCS interval plus the local tiers (every k steps, one peer copy), with a kill (parts from the
  hosts' own disks), ``lose-host`` (the killed host's part from its peer) and ``lose-slice`` (GCS);
* uninterrupted runs with and without the local tiers, alternating, steps not paced: seconds per step (median
  over the run's steps, after the first), the steady cost of the local saves. The failure runs pace their steps
  (0.1 s) so that a local save and its peer copy land between two kill points as they would between slow steps.

Per failure: steps lost (restored step vs the step at the failure), restore seconds (the slowest worker's
``restore_seconds``: runtime ready to state restored, the parts read and checked or the GCS step read), and
recovery seconds (failure to back at the pre-failure step). Kill points are spread over the GCS interval.

Usage: python bench/bench_tiers.py [--d-model 64 256] [--total 40] [--interval 10] [--local 2] [--kills 13 17]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from jaxrec.adapters.store import RunLayout
from jaxrec.model.config import load_config
from jaxrec.model.records import EventKind, TierRecord
from workflows import local
from workflows.build import render_workflow
from workflows.report import load_events, open_run

REPO = Path(__file__).resolve().parent.parent


def _store(res: local.LocalRunResult):
    """The run's store: the copy the emulator run left on disk (the emulator is gone once the run ends)."""
    return open_run(res.local_copy or res.store_url)


def compile_workflow(
    d: Path, name: str, d_model: int, total: int, interval: int, local_every: int | None, pace: float = 0.1
) -> Path:
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["run_id"] = name
    data["slice"]["hosts"] = 2
    data["model"].update(d_model=d_model, n_layers=2, n_heads=4, d_ff=4 * d_model, seq_len=32)
    data["training"].update(total_steps=total, heartbeat_timeout_s=3, step_delay_s=pace)
    data["checkpoint"].update(interval_steps=interval, keep=3)
    if local_every:
        data["checkpoint"]["local"] = {"interval_steps": local_every, "keep": 2, "peers": 1}
    data["retry"].update(default_backoff={"base_s": 0, "factor": 1, "max_s": 0})
    data["retry"]["budgets"] = {"infrastructure": 20}
    cfg = d / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(data))
    wf = d / f"{name}-wf.yaml"
    wf.write_text(render_workflow(load_config(cfg), str(cfg)))
    return wf


def run(wf: Path, run_id: str, inject: list[str]) -> tuple[local.LocalRunResult, float]:
    t0 = time.time()
    res = local.run(
        wf,
        local.LocalRunOptions(inject=inject, run_id=run_id, gcs_emulator=True, metrics_port=None, report=False),
        say=lambda _: None,
    )
    return res, time.time() - t0


def per_failure(res: local.LocalRunResult) -> list[dict]:
    """Steps lost, restore and recovery seconds, tier and the bytes restored, for each incident of ``res``."""
    store = _store(res)
    events = load_events(store)
    out = []
    for inc in res.incidents:
        nxt = inc.attempt + 1
        restores = [e.restore_seconds or 0 for e in events if e.event == EventKind.RESTORED and e.attempt == nxt]
        tiers = store.read_record(RunLayout.tier_record(nxt), TierRecord)
        out.append(
            {
                "lost": inc.steps_lost,
                "restore_s": max(restores, default=float("nan")),
                "recovery_s": inc.recovery_seconds,
                "tier": tiers.tier if tiers else "gcs",
            }
        )
    return out


def step_seconds(res: local.LocalRunResult) -> float:
    """Median seconds between consecutive steps of process 0 (the first step, with its compile, left out)."""
    steps = sorted(
        e.t
        for e in load_events(_store(res))
        if e.event == EventKind.STEP and e.process_index == 0 and (e.step or 0) > 1
    )
    return statistics.median(b - a for a, b in zip(steps, steps[1:], strict=False))


def step_bytes(res: local.LocalRunResult) -> int:
    """Bytes of the newest GCS checkpoint step of ``res`` (its manifest's files)."""
    from jaxrec.adapters.checkpoints import newest_complete_step
    from jaxrec.model.records import CheckpointManifest

    store = _store(res)
    step = newest_complete_step(store)
    m = store.read_record(RunLayout.checkpoint_manifest(step), CheckpointManifest) if step is not None else None
    return sum(f.size for f in m.files) if m else 0


def part_bytes(res: local.LocalRunResult) -> int:
    """Bytes of process 0's newest local part (its ``state.bin``) in the run's host directories."""
    bins = sorted(res.work_dir.glob("hosts/*/*/steps/*/part-0/state.bin"), key=lambda p: int(p.parent.parent.name))
    return bins[-1].stat().st_size if bins else 0


def _row(label: str, rows: list[dict]) -> str:
    lost = [r["lost"] for r in rows if r["lost"] is not None]
    rest = [r["restore_s"] for r in rows]
    rec = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    tiers = ",".join(sorted({r["tier"] or "-" for r in rows}))
    mean = statistics.mean
    return (f"  {label:34} {tiers:10} {mean(lost) if lost else float('nan'):6.1f} "
            f"{mean(rest):9.2f} {mean(rec) if rec else float('nan'):10.2f}   {len(rows)}")  # fmt: skip


def bench_size(d: Path, d_model: int, args: argparse.Namespace) -> None:
    gcs = compile_workflow(d, f"g{d_model}", d_model, args.total, args.interval, None)
    tiers = compile_workflow(d, f"t{d_model}", d_model, args.total, args.interval, args.local)
    # Steady runs are not paced: the local saves compete with the steps for the host as they would on a slice.
    gcs_free = compile_workflow(d, f"gs{d_model}", d_model, args.total, args.interval, None, pace=0)
    tiers_free = compile_workflow(d, f"ts{d_model}", d_model, args.total, args.interval, args.local, pace=0)
    pairs = []  # (GCS-only, with local tiers), run alternately so that load drifts hit both alike
    for i in range(args.steady_runs):
        g, _ = run(gcs_free, f"g{d_model}-steady{i}", [])
        t, _ = run(tiers_free, f"t{d_model}-steady{i}", [])
        pairs.append((g, t))
    size, part = step_bytes(pairs[0][0]), part_bytes(pairs[0][1])
    print(f"\nd_model {d_model}: GCS step {size / 2**20:.2f} MiB, a host's local part {part / 2**20:.2f} MiB")
    ratios = [step_seconds(t) / step_seconds(g) for g, t in pairs]
    sg = statistics.median(step_seconds(g) for g, _ in pairs)
    st = statistics.median(step_seconds(t) for _, t in pairs)
    print(f"  steady (median of {len(pairs)} alternating pairs, steps not paced): s/step GCS-only "
          f"{sg:.4f}, with local tiers {st:.4f}; paired ratios {', '.join(f'{r:.2f}' for r in ratios)}")  # fmt: skip
    if args.kills:
        print(f"  {'scenario':34} {'tier':10} {'lost':>6} {'restore s':>9} {'recovery s':>10}   n")
    cases = [
        ("GCS only, kill-worker", gcs, "kill-worker"),
        ("local tiers, kill-worker", tiers, "kill-worker"),
        ("local tiers, lose-host", tiers, "lose-host"),
        ("local tiers, lose-slice", tiers, "lose-slice"),
    ]
    for label, wf, scenario in cases if args.kills else []:
        rows = []
        for k in args.kills:
            res, _ = run(wf, f"{wf.stem[:4]}-{scenario[:6]}-{k}", [f"{scenario}@{k}"])
            if res.status != "Succeeded":
                print(f"  {label}: run at kill {k} ended {res.status}")
            rows += per_failure(res)
        print(_row(label, rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, nargs="+", default=[64, 256])
    p.add_argument("--total", type=int, default=40)
    p.add_argument("--interval", type=int, default=10, help="GCS checkpoint interval (steps)")
    p.add_argument("--local", type=int, default=2, help="local tier interval (steps)")
    p.add_argument("--kills", type=int, nargs="*", default=[13, 17], help="kill steps (none: steady runs only)")
    p.add_argument("--steady-runs", type=int, default=3, help="uninterrupted runs of each kind, alternating")
    args = p.parse_args()
    print(f"GCS every {args.interval} steps; local every {args.local}, one peer copy; kills at {args.kills}; "
          f"expected steps lost per failure (arith, async saves aside): GCS-only about the kill's distance past the "
          f"last GCS step, local about its distance past the last local step")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the emulator runs leave their copies under ./.local-runs
        for d_model in args.d_model:
            bench_size(Path(tmp), d_model, args)


if __name__ == "__main__":
    main()
