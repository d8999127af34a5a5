"""Worker agents (``trainer.agent``) whose trainer is a stand-in process that does what a test's plan says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import AgentState
from trainer.agent import Agent

# A stand-in trainer: as a standby (TRAINER_STANDBY) it waits for its flags on stdin first, as the trainer does;
# it records each start (attempt, restore step, pid, whether it was started ahead), then does what its attempt's plan
# says: "exit N", "beat N" (its heartbeat says step 1, then it exits 0 after N tenths of a second), "block" (sleeps
# through SIGTERM: only SIGKILL ends it) or "sigterm N" (exits N on SIGTERM).
CHILD = r"""
import json, os, signal, sys, time
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
ahead = bool(os.environ.get("TRAINER_STANDBY"))
if ahead:
    with open(args["--out"] + "/standbys.jsonl", "a") as f:
        f.write(json.dumps({"pid": os.getpid()}) + "\n")
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    args.update(json.loads(line))
out, attempt = args["--out"], args["--attempt"]
with open(out + "/starts.jsonl", "a") as f:
    f.write(json.dumps({"attempt": int(attempt), "restore": int(args["--restore-step"]), "pid": os.getpid(),
                        "index": int(os.environ.get("JOB_COMPLETION_INDEX", "0")), "ahead": ahead}) + "\n")
plan = json.load(open(out + "/plan.json")).get(f"{os.environ.get('JOB_COMPLETION_INDEX', '0')}/{attempt}", "exit 0")
what, _, n = plan.partition(" ")
if what == "beat":  # its first step done (its heartbeat says so), then it finishes after N tenths of a second
    me = int(os.environ.get("JOB_COMPLETION_INDEX", "0"))
    beat = f"{args['--store-root']}/runs/{args['--run-id']}/attempts/{attempt}/heartbeats/{me}.json"
    os.makedirs(os.path.dirname(beat), exist_ok=True)
    json.dump({"process_index": me, "step": 1, "at": time.time()}, open(beat, "w"))
    time.sleep(int(n) / 10)
    sys.exit(0)
if what == "exit":
    sys.exit(int(n))
if what == "sigterm":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(n)))
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(out + f"/ready-{os.environ.get('JOB_COMPLETION_INDEX', '0')}-{attempt}", "w").close()
while True:
    time.sleep(0.05)
"""


def child_argv(out: Path, store_root: Path | None = None, run_id: str = "r1", gang: int = 0) -> list[str]:
    """The stand-in's command line for attempt ``gang`` (its files in ``out``; the store at ``out``/store by
    default)."""
    root = str(store_root or out / "store")
    return [sys.executable, "-c", CHILD, "--store-root", root, "--run-id", run_id, "--attempt", str(gang),
            "--restore-step", "-1", "--out", str(out)]  # fmt: skip


def spawner(index: int):
    def spawn(argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(argv, env={**(env or os.environ), "JOB_COMPLETION_INDEX": str(index)}, **kw)

    return spawn


def standbys(out: Path) -> list[int]:
    """The pids of the stand-ins started ahead (as standbys)."""
    f = out / "standbys.jsonl"
    return [json.loads(line)["pid"] for line in f.read_text().splitlines()] if f.exists() else []


def make_agent(
    out: Path, index: int = 0, store_root: Path | None = None, run_id: str = "r1", gang: int = 0, **kw
) -> Agent:
    """Worker ``index``'s agent of attempt ``gang``'s gang, its trainer the stand-in, quick to poll and to exit."""
    store = RunStore(str(store_root or out / "store"), run_id)
    kw = {"hold_s": 30.0, "poll_s": 0.05, "exit_grace_s": 1.0, "standby_look_s": 0.05, **kw}
    return Agent(store, gang, index, child_argv(out, store_root, run_id, gang), spawn=spawner(index), **kw)


def plan(tmp_path: Path, **plans: str) -> None:
    (tmp_path / "plan.json").write_text(json.dumps({k.replace("w", "").replace("_", "/"): v for k, v in plans.items()}))


def starts(tmp_path: Path) -> list[dict]:
    f = tmp_path / "starts.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def state(store: RunStore, index: int, gang: int = 0) -> AgentState | None:
    return store.read_record(RunLayout.agent_state(gang, index), AgentState)


def wait_for(cond, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for this purpose: the agent reaps its own children.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"
