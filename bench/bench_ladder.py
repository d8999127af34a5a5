"""The recovery ladder side by side: the same kill recovered at level 0 (in place) and by the full path.

One local job (4 CPU processes), a worker's trainer SIGKILLed at the same step, run in rounds one after the other:
``retry.in_place_budget`` 0 (a new JobSet: settle, classify-failure, backoff, provision-slice, restore-latest, new
pods), 2 with ``retry.in_place_standby`` off (every trainer restarted in its running pod as a new process: what a
kubelet restart of the container gives at best) and 2 (the agents' standbys take the restart). Each run's incident
record split into its phases, on one clock from the kill: detected, stopped, the next processes started, restored,
first step, back at the pre-failure step. The floor of a restart is what any attempt pays once its processes start
(trainer start, restore, cached compile: the full path's first step less its started; level 0's trainers were
started ahead, as standbys). Target: level 0's first step within the floor plus 2 s of the kill.

Usage: python bench/bench_ladder.py [--pairs 2] [--kill-at 12] [--total 40]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from jaxrec.model.config import load_config
from jaxrec.model.records import Incident
from workflows import local
from workflows.build import render_workflow

PHASES = ("detected", "stopped", "started", "restored", "first step", "recovered")
NEW_PROCESS = "new process"
"""Level 0 with no standby (``retry.in_place_standby`` off): every restart a new process in the running pod, which is
what a kubelet restart of the container (``restartPolicyRules``, JobSet's ``InPlaceRestart``) gives at best: a
container adds its runtime's create and start and, from its second restart, the kubelet's crash-loop back-off."""


def compile_workflow(d: Path, total: int, in_place: int, standby: bool = True) -> Path:
    """The local job shrunk for the bench, restarts in place allowed ``in_place`` times (0: the full path), the
    agents keeping a standby trainer or not (``retry.in_place_standby``)."""
    data = yaml.safe_load(open("configs/local-cpu.yaml"))
    name = f"ladder-{in_place}" + ("" if standby else "-new")
    data["run_id"] = name
    data["storage"]["root"] = str(d / "store")
    data["training"].update(total_steps=total)
    data["checkpoint"].update(interval_steps=5)
    data["retry"].update(in_place_budget=in_place, default_backoff={"base_s": 1, "factor": 1, "max_s": 1})
    data["retry"]["in_place_standby"] = standby
    cfg = d / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(data))
    wf = d / f"{name}.wf.yaml"
    wf.write_text(render_workflow(load_config(cfg), str(cfg)))
    return wf


def phases(inc: Incident) -> dict[str, float | None]:
    """Seconds from the kill to each phase of the incident (None: not recorded)."""
    t0 = inc.injected_at or inc.detected_at or 0.0
    at = (inc.detected_at, inc.stopped_at, inc.workers_started_at, inc.restored_at, inc.first_step_at,
          inc.recovered_at)  # fmt: skip
    return {k: (v - t0 if v is not None else None) for k, v in zip(PHASES, at, strict=True)}


def measure(wf: Path, run_id: str, kill_at: int) -> dict:
    """One run with the kill; its status, wall time, and the first incident's phases."""
    t0 = time.time()
    res = local.run(
        wf,
        local.LocalRunOptions(inject=[f"kill-worker@{kill_at}"], run_id=run_id, metrics_port=None, report=False),
        say=lambda _: None,
    )
    inc = res.incidents[0] if res.incidents else None
    return {"status": res.status, "wall": time.time() - t0, "phases": phases(inc) if inc else {}}


def _mean(runs: list[dict], key: str) -> float | None:
    vals = [r["phases"].get(key) for r in runs]
    vals = [v for v in vals if v is not None]
    return statistics.mean(vals) if vals else None


def _fmt(v: float | None) -> str:
    return f"{v:7.1f}" if v is not None else "      -"


def report(by_level: dict[str, list[dict]]) -> None:
    """The phases of every run and their means; the floor, what level 0 adds to it, and the speed-up."""
    print(f"{'run':<18}{'status':<11}" + "".join(f"{p:>11}" for p in PHASES))
    for name, runs in by_level.items():
        for i, r in enumerate(runs):
            row = "".join(f"{_fmt(r['phases'].get(p)):>11}" for p in PHASES)
            print(f"{name + f' #{i + 1}':<18}{r['status']:<11}{row}")
    print("(seconds after the kill)")
    means = {name: {p: _mean(runs, p) for p in PHASES} for name, runs in by_level.items()}
    for name, m in means.items():
        started, first, back = m["started"], m["first step"], m["recovered"]
        if started is None or first is None or back is None:
            print(f"{name}: incomplete incidents")
            continue
        print(f"{name}: kill to back at the pre-failure step {back:.1f} s; kill to the next processes started "
              f"{started:.1f} s; from there to the first step {first - started:.1f} s")  # fmt: skip
    zero, full = means.get("level 0", {}), means.get("full path", {})
    new = means.get(NEW_PROCESS, {})
    if zero.get("recovered") and full.get("recovered"):
        print(f"full path / level 0, kill to back at the pre-failure step: {full['recovered'] / zero['recovered']:.2f}")
    if zero.get("recovered") and new.get("recovered"):
        print(f"{NEW_PROCESS} / level 0 (its standby), kill to back at the pre-failure step: "
              f"{new['recovered'] / zero['recovered']:.2f}")  # fmt: skip
    if zero.get("first step") and full.get("first step") and full.get("started"):
        # The floor is what a restart pays once its processes start, measured on the full path: level 0's standbys
        # start before the kill, so its own "started" is not where its start-up began.
        floor = full["first step"] - full["started"]
        over = zero["first step"] - floor
        print(f"level 0: kill to first step {zero['first step']:.1f} s = the floor {floor:.1f} s + {over:.1f} s "
              f"(target: within 2 s): {'met' if over <= 2 else 'not met'}")  # fmt: skip


def main() -> None:
    """Run the pairs and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2, help="rounds of runs (full path, a new process, level 0)")
    p.add_argument("--kill-at", type=int, default=12, help="the step at which a worker's trainer is SIGKILLed")
    p.add_argument("--total", type=int, default=40, help="steps of each run")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        wfs = {
            "full path": compile_workflow(d, a.total, 0),
            NEW_PROCESS: compile_workflow(d, a.total, 2, standby=False),
            "level 0": compile_workflow(d, a.total, 2),
        }
        by_level: dict[str, list[dict]] = {k: [] for k in wfs}
        for pair in range(a.pairs):
            for name, wf in wfs.items():
                by_level[name].append(measure(wf, f"{name.replace(' ', '-')}-{pair}", a.kill_at))
        report(by_level)


if __name__ == "__main__":
    main()
