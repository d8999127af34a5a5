"""How late each stall kind is detected and how long the stop takes, on the local JobSet stand-in.

For each stall kind one local slice of ``--hosts`` idle processes (no JAX: the decision, not the
trainer, is measured) is supervised by train-segment's own supervisor (the one that runs on GKE) over the
Kubernetes API the local cluster serves (``recovery_steps.kube_gang.KubeGang``, as on GKE):

- ``capacity``: the last worker is never placed (a Pending pod, no room): deadline ``startup_deadline_s``;
- ``configuration``: the last worker waits in ``ImagePullBackOff``: deadline ``image_pull_deadline_s``;
- ``hang``: every worker wrote one heartbeat (step 1) and then nothing: deadline ``hang_timeout_s``
  after that heartbeat;
- ``node-lost``: the last worker is frozen (SIGSTOP) and its host marked lost (its pod Terminating): deadline
  ``force_delete_grace_s`` (a pod Terminating that long on a lost node), and its process is "force-deleted"
  (SIGKILL) ``force_delete_grace_s`` after the stop began.

It prints, per kind, the deadline, how late the verdict came after it, that lateness as a fraction of
the supervisor's watch interval (target <= 1: "within its deadline plus one watch interval"), and the
stop (verdict to every process gone), all from the supervision record the supervisor wrote.

    .venv/bin/python bench/bench_supervision.py [--hosts 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jaxrec.adapters.kube import make_api_client
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import SupervisionConfig, load_config
from jaxrec.model.records import WorkerHeartbeat
from recovery_steps.kube_gang import KubeGang
from recovery_steps.train_segment import Supervisor, SupervisorIO
from workflows.local.executor import LocalExecutor
from workflows.local.slices import IMAGE_PULL, UNSCHEDULABLE, LocalSlice, WorkerProc

REPO = Path(__file__).resolve().parents[1]
DEADLINES = SupervisionConfig(startup_deadline_s=2, image_pull_deadline_s=2, hang_timeout_s=3, compile_grace_s=60,
                              force_delete_grace_s=1, heartbeat_interval_s=1, watch_interval_s=0.5)  # fmt: skip
IDLE = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, lambda *a: exit(143)); time.sleep(600)",
]


def one(kind: str, hosts: int, root: Path) -> tuple[float, float, float]:
    """Supervise one slice stalled as ``kind``; return (deadline, detected - deadline, stop seconds)."""
    cfg = load_config(REPO / "configs" / "local-cpu.yaml")
    cfg = cfg.model_copy(update={"supervision": DEADLINES, "slice": cfg.slice.model_copy(update={"hosts": hosts})})
    store = RunStore(str(root), cfg.run_id)
    ex = LocalExecutor(repo_root=REPO, work_dir=root / "work", grace_seconds=3)
    sl = LocalSlice(f"bench-{kind}", 0, IDLE, str(REPO), root / "logs", grace_seconds=3)
    sl.workers = [WorkerProc(i, {}) for i in range(hosts)]
    last = hosts - 1
    if kind == "capacity":
        sl.withheld[last] = UNSCHEDULABLE
    elif kind == "configuration":
        sl.withheld[last] = IMAGE_PULL
    for w in sl.workers:
        if w.index not in sl.withheld:
            sl.spawn(w)
    ex.controllers.adopt(sl)  # the supervisor re-attaches to this slice (its ensure finds it)
    start = time.time()
    if kind == "hang":
        for i in range(hosts):
            store.write_json(RunLayout.heartbeat(0, i), WorkerHeartbeat(process_index=i, step=1, at=start).model_dump())
    if kind == "node-lost":
        sl.signal_worker(last, signal.SIGSTOP)
        sl.lost[last] = start
    deadline = {"capacity": sl.created_at + DEADLINES.startup_deadline_s,
                "configuration": sl.created_at + DEADLINES.image_pull_deadline_s,
                "hang": start + DEADLINES.hang_timeout_s,
                "node-lost": start + DEADLINES.force_delete_grace_s}[kind]  # fmt: skip
    manifest = {"kind": "JobSet", "metadata": {"name": sl.jobset}}
    gang = KubeGang(make_api_client(ex.controllers.url), cfg.namespace, sl.jobset)
    try:
        record = Supervisor(cfg, 0, gang, store, io=SupervisorIO(say=lambda _line: None)).run(manifest)
    finally:
        ex.controllers.close()
    assert record.outcome == "stalled" and record.stall_kind == kind, record
    assert record.stopped_at is not None and all(w.returncode is not None for w in sl.workers if w.proc), record
    return deadline - sl.created_at, record.detected_at - deadline, record.stopped_at - record.detected_at


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"{'kind':<14} {'deadline s':>10} {'late s':>8} {'late / watch interval':>22} {'stop s':>7}")
    for kind in ("capacity", "configuration", "hang", "node-lost"):
        rows = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                rows.append(one(kind, args.hosts, Path(d)))
        dl = statistics.median(r[0] for r in rows)
        late = statistics.median(r[1] for r in rows)
        stop = statistics.median(r[2] for r in rows)
        print(f"{kind:<14} {dl:>10.2f} {late:>8.3f} {late / DEADLINES.watch_interval_s:>22.3f} {stop:>7.2f}")
    print(f"(medians of {args.repeats}; watch interval {DEADLINES.watch_interval_s:g} s; target: late / interval <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
