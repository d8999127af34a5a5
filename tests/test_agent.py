"""The worker pod's agent (``trainer.agent``): it runs real child processes and acts on the run store's orders."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.agents import alive, child_argv, make_agent, plan, standbys, starts, state, wait_for

from jaxrec.adapters.store import RunLayout
from jaxrec.model.records import AgentAction, AgentState, AgentStateKind, RestartOrder
from trainer.agent import exit_code, target_of, with_flag


def _running(agent) -> tuple[threading.Thread, dict[str, int]]:
    """The agent run on a thread; its exit code lands in the box under "code"."""
    box: dict[str, int] = {}
    t = threading.Thread(target=lambda: box.__setitem__("code", agent.run()))
    t.start()
    return t, box


def test_exit_codes_and_flags():
    assert exit_code(-signal.SIGKILL) == 137 and exit_code(-signal.SIGTERM) == 143 and exit_code(42) == 42
    assert with_flag(["a", "--attempt", "3", "b"], "--attempt", "4") == ["a", "--attempt", "4", "b"]
    assert with_flag(["--attempt=3"], "--attempt", "4") == ["--attempt=4"]
    assert with_flag(["x"], "--restore-step", "7") == ["x", "--restore-step", "7"]
    t = target_of(["python", "-m", "trainer", "--store-root", "/s", "--run-id", "r", "--attempt", "2"])
    assert (t.store_root, t.run_id, t.attempt, t.restore_step) == ("/s", "r", 2, -1)


def test_a_trainer_that_finishes_ends_the_agent_with_zero(tmp_path):
    plan(tmp_path, w0_0="exit 0")
    agent = make_agent(tmp_path)
    assert agent.run() == 0
    s = state(agent.store, 0)
    assert s is not None and (s.state, s.attempt, s.exit_code) == (AgentStateKind.EXITED, 0, 0)


def test_a_standby_is_kept_ready_from_the_trainers_first_step_and_goes_with_the_agent(tmp_path):
    plan(tmp_path, w0_0="beat 30")
    agent = make_agent(tmp_path)
    t, box = _running(agent)
    (ahead,) = wait_for(lambda: standbys(tmp_path))  # while the trainer still runs
    assert alive(ahead) and len(starts(tmp_path)) == 1
    t.join(20)
    assert box == {"code": 0} and not alive(ahead)  # the trainer finished: its standby ended with the agent


def test_a_failed_trainer_holds_the_pod_for_an_order_then_leaves_with_its_code(tmp_path):
    plan(tmp_path, w0_0="exit 42")
    agent = make_agent(tmp_path, hold_s=0.6)
    t0 = time.monotonic()
    assert agent.run() == 42
    assert time.monotonic() - t0 >= 0.6  # it held the pod, waiting for the supervisor
    s = state(agent.store, 0)
    assert s is not None and (s.state, s.exit_code) == (AgentStateKind.EXITED, 42)
    assert len(starts(tmp_path)) == 1
    # The gang's one wake object says so too: what the supervisor polls between its decisions.
    wake = agent.store.read_record(RunLayout.agent_wake(0), AgentState)
    assert wake == s


def test_an_unreadable_order_is_no_order(tmp_path):
    plan(tmp_path, w0_0="exit 42")
    agent = make_agent(tmp_path, hold_s=0.5)
    order = tmp_path / "store" / "runs" / "r1" / RunLayout.restart_order(0)
    order.parent.mkdir(parents=True, exist_ok=True)
    order.write_text("{not json")
    assert agent.run() == 42  # it kept its course: held, then left with the trainer's code
    assert len(starts(tmp_path)) == 1


@pytest.mark.parametrize("standby", [True, False], ids=["standby", "no-standby"])
def test_the_gang_restarts_in_place_together_once_every_old_trainer_has_exited(tmp_path, standby):
    # Worker 1's trainer fails; worker 0's is blocked (as in a collective) and ignores SIGTERM: only SIGKILL ends it.
    plan(tmp_path, w0_0="block", w1_0="exit 42", w0_1="exit 0", w1_1="exit 0")
    agents = [make_agent(tmp_path, i, standby=standby) for i in range(2)]
    codes: dict[int, int] = {}
    threads = [threading.Thread(target=lambda a=a: codes.__setitem__(a.index, a.run())) for a in agents]
    for t in threads:
        t.start()
    store = agents[0].store
    wait_for(lambda: (s := state(store, 1)) is not None and s.state == AgentStateKind.EXITED)
    assert state(store, 1).exit_code == 42
    wait_for(lambda: (tmp_path / "ready-0-0").exists())
    blocked = next(s["pid"] for s in starts(tmp_path) if s["index"] == 0)
    store.write_record(RunLayout.restart_order(0), RestartOrder(action=AgentAction.STOP, attempt=1, restore_step=20))
    stopped = wait_for(lambda: all((s := state(store, i)) and s.state == AgentStateKind.STOPPED for i in range(2)))
    assert stopped
    assert not alive(blocked)  # SIGKILLed after the grace, and reaped before the agent said it stopped
    assert state(store, 0).attempt == 1 and state(store, 0).exit_code == 137
    assert len(starts(tmp_path)) == 2  # nothing restarted before START
    store.write_record(RunLayout.restart_order(0), RestartOrder(action=AgentAction.START, attempt=1, restore_step=20))
    for t in threads:
        t.join(20)
    assert codes == {0: 0, 1: 0}
    again = [s for s in starts(tmp_path) if s["attempt"] == 1]
    assert sorted((s["index"], s["restore"]) for s in again) == [(0, 20), (1, 20)]
    if not standby:  # --no-standby: each a new process, as a container restart starts one
        assert not any(s["ahead"] for s in again) and standbys(tmp_path) == []
        return
    # Each was started ahead (the failed worker's as its trainer exited, its peer's at the stop order), its imports
    # done while the old trainers stopped, and ran once its flags came.
    assert all(s["ahead"] for s in again) and {s["pid"] for s in again} == set(standbys(tmp_path))


def test_an_exit_order_ends_the_trainer_and_leaves_with_its_code(tmp_path):
    plan(tmp_path, w0_0="sigterm 143")
    agent = make_agent(tmp_path)
    t, box = _running(agent)
    wait_for(lambda: (tmp_path / "ready-0-0").exists())
    agent.store.write_record(RunLayout.restart_order(0), RestartOrder(action=AgentAction.EXIT, attempt=0))
    t.join(20)
    assert box == {"code": 143}


def test_a_failed_trainers_standby_goes_with_an_exit_order(tmp_path):
    """The agent of a failed trainer starts the next one ahead; the supervisor chooses the full path: it goes."""
    plan(tmp_path, w0_0="exit 42")
    agent = make_agent(tmp_path)
    t, box = _running(agent)
    (ahead,) = wait_for(lambda: standbys(tmp_path))
    agent.store.write_record(RunLayout.restart_order(0), RestartOrder(action=AgentAction.EXIT, attempt=0))
    t.join(20)
    assert box == {"code": 42} and not alive(ahead)
    assert len(starts(tmp_path)) == 1  # it never ran


def test_sigterm_to_the_agent_reaches_the_trainer_and_its_code_is_the_pods(tmp_path):
    plan(tmp_path, w0_0="sigterm 143")
    from trainer import agent as agent_mod

    # The agent's own command line, its child this test's stand-in in place of ``python -m trainer``.
    script = (
        "import sys; from trainer import agent; parse = agent.parse; "
        "agent.parse = lambda argv: (parse(argv)[0], sys.argv[sys.argv.index('--') + 1:]); sys.exit(agent.main())"
    )
    argv = [sys.executable, "-c", script, "--hold-s", "30", "--", *child_argv(tmp_path)]
    assert agent_mod.parse(["--", "--attempt", "1"])[1][-4:] == ["-m", "trainer", "--attempt", "1"]
    proc = subprocess.Popen(argv, env={**os.environ, "JOB_COMPLETION_INDEX": "0"})
    try:
        wait_for(lambda: (tmp_path / "ready-0-0").exists())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 143
    finally:
        proc.kill()
        proc.wait()
    child = starts(tmp_path)[0]["pid"]
    assert not alive(child)


def test_the_agent_refuses_a_command_line_without_a_trainer():
    with pytest.raises(SystemExit, match="usage"):
        from trainer.agent import parse

        parse(["--hold-s", "3"])


def test_the_trainer_as_a_standby_runs_with_the_flags_it_is_sent_or_not_at_all(tmp_path):
    """``python -m trainer`` started ahead (``STANDBY_ENV``) waits for its flags on stdin: with none it ends
    without running; with a line it runs as that attempt (here its report says why it stops: no config)."""
    from jaxrec.model.names import STANDBY_COMM, STANDBY_ENV

    argv = [sys.executable, "-m", "trainer", "--store-root", str(tmp_path), "--run-id", "r", "--attempt", "0"]
    env = {**os.environ, STANDBY_ENV: "1", "JOB_COMPLETION_INDEX": "0"}
    waiting = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)
    try:
        # While it waits it is named so that what looks for "the trainer" of a pod (the drill, the local kill)
        # passes it over: its command line is the trainer's.
        wait_for(lambda: Path(f"/proc/{waiting.pid}/comm").read_text().strip() == STANDBY_COMM, 60)
        waiting.stdin.close()
        assert waiting.wait(120) == 0 and not (tmp_path / "runs").exists()
    finally:
        waiting.kill()
        waiting.wait()
    flags = json.dumps({"--attempt": "3", "--restore-step": "7"}).encode() + b"\n"
    ran = subprocess.run(argv, input=flags, env=env, capture_output=True, timeout=120)
    assert ran.returncode == 2, ran.stderr[-2000:]
    assert (tmp_path / "runs" / "r" / "attempts" / "3" / "workers" / "0.json").exists()
    assert not (tmp_path / "runs" / "r" / "attempts" / "0").exists()
