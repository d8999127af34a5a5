"""``python -m trainer.agent [--hold-s S] [--no-standby] -- TRAINER-ARGS``: a worker pod's entrypoint for level 0.

Level 0 of the recovery ladder (docs/FAILURES.md) restarts every worker's trainer in its running pod. The agent is the
container's process and runs the trainer as its child. It acts on the supervisor's ``RestartOrder`` and says where it
stands in its ``AgentState``, both in the run store, which every worker and the supervisor reach whatever else fails:

- its trainer exited 0: the agent exits 0 (the worker is done);
- its trainer failed: the agent says ``exited`` with the code and holds the pod for an order, ``--hold-s`` at most
  (then it exits with the trainer's code, and the pod fails as it would have without the agent);
- ``stop`` for a newer attempt: it SIGKILLs its trainer (a peer of a failed worker is blocked in a collective, and no
  save can be agreed without the failed one), waits until the process has exited and released its devices, says
  ``stopped``; on ``start`` (the supervisor saw every agent stopped) it runs the trainer of that attempt with the
  order's restore step: the whole gang restarts together as a new JAX process group;
- ``exit``: it ends its trainer (SIGTERM, SIGKILL after ``EXIT_GRACE_S``) and leaves with the trainer's code (the
  supervisor chose a higher level);
- SIGTERM (the pod is deleted, the node shuts down): passed to the trainer, which saves on the way out; the agent
  leaves with its code.

From its trainer's first step on (or once it fails, or a stop is ordered) the agent keeps the next trainer ready as a
standby (``STANDBY_ENV``; none with ``--no-standby``): its imports done, no device opened, waiting for its flags.
A store read that fails is no order: the agent keeps its course and reads again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jaxrec.adapters.store import DocumentError, RunLayout, RunStore, StoreUnavailable
from jaxrec.model.names import STANDBY_ENV
from jaxrec.model.records import AgentAction, AgentState, AgentStateKind, RestartOrder, WorkerHeartbeat

log = logging.getLogger("trainer.agent")

POLL_S = 0.25
"""How often the agent looks at its trainer and at the order."""
EXIT_GRACE_S = 10.0
"""SIGTERM to SIGKILL for a trainer its agent ends on an ``exit`` order (it may save on its way out)."""
WAITING_POLL_S = 0.1
"""How often an agent whose trainer has ended reads the order: the restart it waits for is imminent."""
STANDBY_LOOK_S = 1.0
"""How often an agent without a standby reads its trainer's heartbeat to see whether it has made its first step."""
HOLD_S = 60.0
"""How long a failed trainer's agent holds the pod for an order by default (``--hold-s``)."""


def exit_code(returncode: int) -> int:
    """A child's return code as a container's exit code: a death by signal N is 128 + N (137 for SIGKILL)."""
    return 128 - returncode if returncode < 0 else returncode


def with_flag(argv: Sequence[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value set to ``value`` (``--flag v`` or ``--flag=v``; appended when absent)."""
    out, i, seen = [], 0, False
    while i < len(argv):
        a = argv[i]
        if a == flag and i + 1 < len(argv):
            out += [flag, value]
            i, seen = i + 2, True
            continue
        if a.startswith(flag + "="):
            out.append(f"{flag}={value}")
            seen = True
        else:
            out.append(a)
        i += 1
    return out if seen else [*out, flag, value]


@dataclass(frozen=True)
class Target:
    """What the agent needs to know of its trainer's command line."""

    store_root: str
    run_id: str
    attempt: int
    restore_step: int


def target_of(child: Sequence[str]) -> Target:
    """The run store, run, attempt and restore step of the trainer command ``child`` (its own flags)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--store-root", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--restore-step", type=int, default=-1)
    a, _ = p.parse_known_args(list(child))
    return Target(a.store_root, a.run_id, a.attempt, a.restore_step)


class Agent:
    """One worker's agent: runs the trainer ``child`` and restarts it as the gang's ``RestartOrder`` says."""

    def __init__(
        self,
        store: RunStore,
        gang_attempt: int,
        index: int,
        child: Sequence[str],
        *,
        hold_s: float = HOLD_S,
        poll_s: float = POLL_S,
        exit_grace_s: float = EXIT_GRACE_S,
        standby_look_s: float = STANDBY_LOOK_S,
        standby: bool = True,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        spawn: Callable[..., Any] = subprocess.Popen,
    ):
        self.store, self.gang_attempt, self.index, self.child_argv = store, gang_attempt, index, list(child)
        self.hold_s, self.poll_s, self.exit_grace_s, self.standby_look_s = hold_s, poll_s, exit_grace_s, standby_look_s
        self.clock, self.sleep, self.spawn = clock, sleep, spawn
        self.proc: Any = None
        self.attempt = gang_attempt
        self.code: int | None = None
        self.terminated = False
        self.unread_said = False
        self.stopped_for: int | None = None  # the attempt this agent last said it stopped for
        self.standby: Any = None  # a trainer started ahead, its imports done, waiting for its flags on stdin
        self.standby_on = standby  # False: every restart starts a new process (``--no-standby``)
        self.next_look = 0.0  # when ``_stepping`` reads the trainer's heartbeat next

    def _say(self, state: AgentStateKind, attempt: int) -> None:
        rec = AgentState(process_index=self.index, state=state, attempt=attempt, exit_code=self.code)
        paths = [RunLayout.agent_state(self.gang_attempt, self.index)]
        if state == AgentStateKind.EXITED:  # the supervisor polls this one object between its observations
            paths.append(RunLayout.agent_wake(self.gang_attempt))
        for path in paths:
            try:
                self.store.write_record(path, rec)
            except (StoreUnavailable, OSError) as e:  # the next change says it again; the trainer's report stands
                log.warning("agent %d: could not record %s: %s", self.index, state.value, e)
                return

    def _order(self) -> RestartOrder | None:
        try:
            return self.store.read_record(RunLayout.restart_order(self.gang_attempt), RestartOrder)
        except (StoreUnavailable, DocumentError, OSError) as e:
            if not self.unread_said:
                log.warning("agent %d: the restart order is unreadable (%s); reading it again", self.index, e)
                self.unread_said = True
            return None

    def _start(self, attempt: int, restore_step: int) -> None:
        flags = {"--attempt": str(attempt), "--restore-step": str(restore_step)}
        self.attempt, self.code = attempt, None
        ahead, self.standby = self.standby, None
        if ahead is not None and ahead.poll() is None:
            try:
                ahead.stdin.write((json.dumps(flags) + "\n").encode())
                ahead.stdin.close()
                self.proc = ahead
            except (BrokenPipeError, OSError):  # it ended meanwhile: start one the usual way
                self.proc = None
        if self.proc is None:
            argv = self.child_argv
            for flag, value in flags.items():
                argv = with_flag(argv, flag, value)
            self.proc = self.spawn(argv)
        self._say(AgentStateKind.RUNNING, attempt)
        how = "its standby" if self.proc is ahead else "a new process"
        log.info(
            "agent %d: trainer of attempt %d started (%s, restore step %d)", self.index, attempt, how, restore_step
        )

    def _prestart(self) -> None:
        """Start the next trainer ahead (``STANDBY_ENV``), in case a restart in place is ordered.

        Its imports run while the restart is decided and the old trainers stop; it opens no device before its flags
        come (``_start``).
        """
        if self.standby is None and self.standby_on:
            env = {**os.environ, STANDBY_ENV: "1"}
            self.standby = self.spawn(self.child_argv, stdin=subprocess.PIPE, env=env)

    def _drop_standby(self) -> None:
        """End a trainer started ahead for a restart that is not coming."""
        ahead, self.standby = self.standby, None
        if ahead is not None:
            with contextlib.suppress(ProcessLookupError):
                ahead.kill()
            ahead.wait()

    def _reap(self) -> bool:
        """True when the trainer has exited (its code kept)."""
        if self.proc is None:
            return True
        rc = self.proc.poll()
        if rc is None:
            return False
        self.proc, self.code = None, exit_code(rc)
        return True

    def _end_trainer(self, grace_s: float) -> None:
        """SIGTERM the trainer, SIGKILL it after ``grace_s`` (0: at once), and wait until it has exited."""
        if self.proc is None:
            return
        if grace_s > 0:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                self.proc.send_signal(signal.SIGTERM)
        bound = self.clock() + grace_s
        while not self._reap():
            if self.clock() >= bound:
                with contextlib.suppress(ProcessLookupError):  # it has just exited
                    self.proc.kill()
                self.proc.wait()
                self._reap()
                return
            self.sleep(min(self.poll_s, 0.1))

    def terminate(self, *_: Any) -> None:
        """SIGTERM to the agent: pass it to the trainer (which saves on its way out); leave with its code."""
        self.terminated = True
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):  # it has just exited
                self.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Run the trainer and act on orders until there is nothing left to run; returns the exit code.

        A standby is kept ready from the trainer's first step on (``_stepping``), and ended with the agent.
        """
        try:
            return self._run()
        finally:
            self._drop_standby()

    def _stepping(self) -> bool:
        """Whether the running trainer has made its first step (its heartbeat says so), read every few seconds.

        From then on its start-up no longer competes with a standby's imports.
        """
        if self.proc is None or self.standby is not None or self.clock() < self.next_look:
            return False
        self.next_look = self.clock() + self.standby_look_s
        try:
            beat = self.store.read_record(RunLayout.heartbeat(self.attempt, self.index), WorkerHeartbeat)
        except (StoreUnavailable, DocumentError, OSError):
            return False
        return beat is not None and beat.step is not None

    def _run(self) -> int:
        first = target_of(self.child_argv)
        self._start(self.gang_attempt, first.restore_step)
        held_since: float | None = None  # when the agent began to wait for an order
        while True:
            if self.standby_on and self._stepping():
                self._prestart()
            if self.terminated:
                if self.proc is not None:
                    self.proc.wait()
                    self._reap()
                return self.code if self.code is not None else 143
            if self.proc is not None and self._reap():
                self._say(AgentStateKind.EXITED, self.attempt)
                if self.code == 0:
                    return 0
                log.info("agent %d: trainer of attempt %d exited %s", self.index, self.attempt, self.code)
                held_since = self.clock()
                self._prestart()  # while the supervisor decides: the next trainer's imports are under way
            order = self._order()
            if order is not None and order.action == AgentAction.EXIT:
                self._end_trainer(self.exit_grace_s)
                log.info("agent %d: ordered to exit (%s)", self.index, order.reason)
                return self.code if self.code is not None else 143
            if order is not None and order.attempt > self.attempt:
                if order.action == AgentAction.STOP:
                    self._prestart()
                if self.proc is not None:
                    log.info("agent %d: stopping attempt %d for %d (%s)", self.index, self.attempt, order.attempt,
                             order.reason)  # fmt: skip
                    self._end_trainer(0)
                if order.action == AgentAction.START:
                    self._start(order.attempt, order.restore_step)
                    held_since = None
                elif self.stopped_for != order.attempt:  # stopped: the hold now waits for START
                    self._say(AgentStateKind.STOPPED, order.attempt)
                    self.stopped_for, held_since = order.attempt, self.clock()
            if self.proc is None and held_since is not None and self.clock() - held_since >= self.hold_s:
                log.info("agent %d: no order for %.0f s; leaving with the trainer's code", self.index, self.hold_s)
                return self.code if self.code is not None else 1
            if self.proc is None:
                self.sleep(min(self.poll_s, WAITING_POLL_S))
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):  # its exit is seen at once, the order within poll_s
                self.proc.wait(timeout=self.poll_s)


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The agent's own flags, and the trainer's command: this interpreter's ``-m trainer``, the flags after ``--``."""
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit(
            "usage: python -m trainer.agent [--hold-s S] [--no-standby] -- TRAINER-ARGS (python -m trainer's flags)"
        )
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m trainer.agent", description=__doc__.splitlines()[0])
    p.add_argument("--hold-s", type=float, default=HOLD_S, help="How long a failed trainer's pod waits for an order.")
    p.add_argument("--no-standby", action="store_true", help="Start no trainer ahead: each restart is a new process.")
    return p.parse_args(argv[:cut]), [sys.executable, "-m", "trainer", *argv[cut + 1 :]]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the agent of this pod's worker (``JOB_COMPLETION_INDEX``); returns the exit code for the container."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args, child = parse(sys.argv[1:] if argv is None else argv)
    t = target_of(child)
    index = int(os.environ.get("JOB_COMPLETION_INDEX", "0") or 0)
    agent = Agent(RunStore(t.store_root, t.run_id), t.attempt, index, child, hold_s=args.hold_s,
                  standby=not args.no_standby)  # fmt: skip
    signal.signal(signal.SIGTERM, agent.terminate)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
