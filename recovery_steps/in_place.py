"""Level 0 of the recovery ladder: the segment's supervisor restarts every trainer in its running pod.

When, how and what it costs: docs/FAILURES.md, "Level 0, restarting in place". The supervisor classifies as
classify-failure would (``recovery_steps.closing``, ``classify``), asks the one ladder (``model.jobset.ladder``) for
the rung and, at level 0 with the class's retry allowed (``retry.decide``), orders the agents to stop
(``RestartOrder`` STOP), closes the attempt and chooses the step meanwhile, then orders them to start (START).
Anything else (a pod ended, a host lost, a class no restart answers, a budget spent, agents that did not stop in
time) tells the agents to exit with their trainers' codes and goes the full way round: the segment ends, and
classify-failure closes the attempt (the gang's newest one: the order names it).

Destructive acts and their evidence: a trainer is stopped only on the supervisor's verdict of a failed attempt,
recorded first; nothing is deleted here (quarantine is restore-latest's, with its evidence).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jaxrec.adapters import restore
from jaxrec.adapters.store import AttemptRef, DocumentError, RunLayout, RunStore, store_errors
from jaxrec.model.config import JobConfig
from jaxrec.model.contract import AttemptOutcome, Backend, Decision
from jaxrec.model.jobset import InPlace, Placement, ladder
from jaxrec.model.records import (
    AgentAction,
    AgentState,
    AgentStateKind,
    AttemptRecord,
    Ledger,
    RestartOrder,
    SupervisionRecord,
)
from jaxrec.model.snapshot import ClusterSnapshot, PodPhase, gang_pool
from recovery_steps.attempts import checkpoint_step_before
from recovery_steps.classify import Verdict, classify
from recovery_steps.closing import ClosingAttempt, close_attempt
from recovery_steps.evidence import Evidence, exited_agents, gather_reports, read_agents
from recovery_steps.retry import advanced, decide

log = logging.getLogger(__name__)

AGENT_WATCH_S = 1.0
"""With restarts in place, the supervisor decides at least this often (``supervision.watch_interval_s`` when
shorter): a trainer that exits in a pod its agent keeps changes no pod, so no watch event wakes the supervisor; its
agent's state, in the run store, is read on each decision."""
WAKE_POLL_S = 0.1
"""How often, between its decisions, the supervisor reads the agents' wake (``RunLayout.agent_wake``): one object
whatever the gang's size, so that a trainer's exit is acted on within this instead of a decision's interval."""
STOP_BOUND_S = 20.0
"""How long the supervisor waits for every agent to say its SIGKILLed trainer has exited (a process in an
uninterruptible wait, a driver's, ends only when that wait does)."""


def current_attempt(store: RunStore, gang_attempt: int) -> int:
    """The attempt gang ``gang_attempt`` is at: the one its supervisor's last order names, else its own.

    START names the attempt the trainers run, EXIT the one to close (the one whose trainers exit); a STOP not yet
    followed by START is a restart that did not complete (its supervisor was lost between the two): the gang is
    still at the attempt before it, whose trainers were stopped, and which is not closed yet.

    Raises what the store raises: a read that failed is no evidence that no restart was ordered.
    """
    order = store.read_record(RunLayout.restart_order(gang_attempt), RestartOrder)
    if order is None:
        return gang_attempt
    return max(gang_attempt, order.attempt - 1 if order.action == AgentAction.STOP else order.attempt)


def in_place_facts(ledger: Ledger | None, snap: ClusterSnapshot, hosts: int, budget: int, tries: int) -> InPlace:
    """What the ladder's level 0 needs: the gang still running, the restarts in a row without progress, the budget."""
    pods = [p for p in snap.pods if not p.ended]
    running = len(pods) == hosts == len(snap.pods) and all(p.phase == PodPhase.RUNNING for p in pods)
    attempts = ledger.attempts if ledger else []
    row = 0
    for a in reversed(attempts):
        if a.level != 0 or advanced(a):
            break
        row += 1
    used = sum(1 for a in attempts if a.level == 0)
    return InPlace(running=running, row=row, left=budget - used, tries=tries)


def restarts_line(ledger: Ledger | None, jobset: str) -> str:
    """The restarts in place of the gang ``jobset``, from the ledger: ``attempt 0 (class: reason) -> 1; ...``."""
    done = [a for a in (ledger.attempts if ledger else []) if a.level == 0 and a.jobset == jobset]
    line = "attempt {0} ({1}: {2}) -> {3}"
    return "; ".join(line.format(a.attempt, a.failure_class or "unclassified", a.reason, a.attempt + 1) for a in done)


@dataclass(frozen=True)
class Restarted:
    """A restart in place done: the attempt the gang runs now, the step it restores, and the rung's reason."""

    attempt: int
    restore_step: int
    placement: Placement
    verdict: Verdict
    stopped_at: float  # when every agent had said its old trainer exited


class LevelZero:
    """Level 0 for one segment's gang: the JobSet ``jobset`` created for attempt ``gang.attempt``."""

    def __init__(
        self,
        cfg: JobConfig,
        gang: AttemptRef,
        jobset: str,
        *,
        clock: Callable[[], float],
        wait: Callable[[float], None],
        say: Callable[[str], None],
    ):
        self.cfg, self.ref, self.store, self.gang_attempt, self.jobset = cfg, gang, gang.store(), gang.attempt, jobset
        self.clock, self.wait, self.say = clock, wait, say
        self.hosts = cfg.slice.num_hosts
        self.wake_seen: tuple[int, int, float] | None = None

    def woken(self) -> bool:
        """Whether an agent has said a trainer exited since the last look (a read that fails: not yet)."""
        try:
            rec = self.store.read_record(RunLayout.agent_wake(self.gang_attempt), AgentState)
        except (DocumentError, *store_errors()):
            return False
        key = None if rec is None else (rec.process_index, rec.attempt, rec.at)
        changed, self.wake_seen = key != self.wake_seen, key
        return changed and key is not None

    def ended(self, attempt: int) -> list[AgentState]:
        """The agents that saw attempt ``attempt``'s trainer exit."""
        return exited_agents(self.store, self.gang_attempt, self.hosts, attempt)

    def _order(self, action: AgentAction, attempt: int, restore_step: int = -1, reason: str = "") -> None:
        order = RestartOrder(action=action, attempt=attempt, restore_step=restore_step, reason=reason)
        self.store.write_record(RunLayout.restart_order(self.gang_attempt), order)

    def evidence(self, attempt: int, record: SupervisionRecord, snap: ClusterSnapshot) -> Evidence:
        """Attempt ``attempt``'s evidence as classify-failure gathers it, the cluster's part from the snapshot."""
        ev = Evidence(
            backend=Backend.of(self.cfg.slice),
            attempt=attempt,
            jobset=snap.jobset,
            jobs=list(snap.jobs),
            pods=list(snap.pods),
            nodes=list(snap.nodes),
            supervision=record,
            agents=self.ended(attempt),
        )
        return gather_reports(self.store, attempt, ev)

    def restart(self, attempt: int, record: SupervisionRecord, snap: ClusterSnapshot) -> Restarted | None:
        """Restart the gang in place after attempt ``attempt``'s failure, or None: the full path follows.

        Whatever is not level 0 orders the agents to exit with their trainers' codes first.
        """
        ev = self.evidence(attempt, record, snap)
        verdict = classify(ev)
        ledger = self.store.read_record(RunLayout.LEDGER, Ledger)
        r = self.cfg.retry
        facts = in_place_facts(ledger, snap, self.hosts, r.in_place_budget, r.in_place_tries)
        pool, healthy = gang_pool(snap)
        where = ladder(verdict.failure_class, pool, healthy, 0, facts)
        if where.level == 0:
            base = AttemptRecord(
                attempt=attempt,
                outcome=AttemptOutcome.FAILED,
                failure_class=verdict.failure_class,
                checkpoint_step_before=checkpoint_step_before(self.store, attempt),
                checkpoint_step_after=record.checkpoint_step,
            )
            d = decide(ledger.attempts if ledger else [], base, r)
            if d.decision != Decision.RETRY:
                where = Placement(1, why=f"the retry policy stops here ({d.reason})")
        if where.level != 0:
            self.say(f"attempt {attempt}: {verdict.failure_class.value}, not restarted in place: {where.why}")
            self._order(AgentAction.EXIT, attempt, reason=where.why)
            return None
        nxt = attempt + 1
        self.say(f"attempt {attempt}: {verdict.failure_class.value} ({verdict.reason}); level 0: {where.why}")
        ordered = self.clock()
        self._order(AgentAction.STOP, nxt, reason=f"attempt {attempt}: {verdict.reason}")
        ref = AttemptRef(self.ref.store_root, self.ref.run_id, attempt)
        # No Workflow is named: a restart in place nests its Workflow no deeper (the hand-over counts those that do).
        closing = ClosingAttempt(ref, self.jobset)
        # While the agents stop their trainers: the attempt is closed and the step chosen, each a few store reads
        # and writes. Both may be done again: a stop that does not complete sends the gang the full way round,
        # whose classify-failure closes the same attempt again (the ledger keeps one entry per attempt) and whose
        # restore-latest chooses again. A step committed while the trainers stop is newer than the one chosen: the
        # next trainers set it aside (never restore it half), and the restore loses its steps, nothing else.
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="level0") as pool:
            closed = pool.submit(close_attempt, self.store, self.cfg, closing, ev, verdict, self.clock, level=0)
            choice = pool.submit(restore.run, self.store, nxt)
            late = self._await_stopped(nxt)
            stopped_at = self.clock()
            closed.result()
            chosen = choice.result()
        if late:
            why = f"worker {', '.join(map(str, late))} did not stop within {STOP_BOUND_S:g} s"
            self.say(f"attempt {attempt}: the restart in place did not complete ({why}); the gang is recreated")
            self._order(AgentAction.EXIT, attempt, reason=why)
            return None
        self.say(
            f"attempt {attempt}: every trainer stopped {stopped_at - ordered:.2f} s after the order, the attempt "
            f"closed and the step chosen {self.clock() - ordered:.2f} s after it"
        )
        if chosen.code != 0 or chosen.selection is None:
            why = f"no step to restore ({(chosen.message or f'exit {chosen.code}').splitlines()[0]})"
            self.say(f"attempt {nxt}: {why}; the gang is recreated")
            self._order(AgentAction.EXIT, nxt, reason=why)
            return None
        step = chosen.selection.step
        self._order(AgentAction.START, nxt, step, reason=f"attempt {attempt}: {verdict.reason}")
        self.say(f"attempt {nxt}: every trainer restarted in its pod from step {step} (level 0)")
        return Restarted(nxt, step, where, verdict, stopped_at)

    def _await_stopped(self, attempt: int) -> list[int]:
        """Wait until every agent says it stopped for ``attempt``; the workers that did not, once the bound passed."""
        bound = self.clock() + STOP_BOUND_S
        while True:
            states = read_agents(self.store, self.gang_attempt, self.hosts)
            done = {a.process_index for a in states if a.state == AgentStateKind.STOPPED and a.attempt == attempt}
            late = [i for i in range(self.hosts) if i not in done]
            if not late or self.clock() >= bound:
                return late
            self.wait(0.1)
