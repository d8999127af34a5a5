"""``train-segment``: create (or re-attach to) the attempt's JobSet, supervise it until it is over, then stop it.

What it renders, watches, decides and records, and its arguments: docs/FAILURES.md ("When an attempt is over: the
supervisor") and docs/CONTRACTS.md. If its own pod is lost (evicted, node drained) Argo retries it; the retry finds
the attempt's JobSet and re-attaches instead of creating a second gang. It reports ``step/total_steps`` through
Argo's progress file (``ARGO_PROGRESS_FILE``, argo docs "Progress").

Destructive acts and their evidence (``supervise``): the JobSet is deleted once the attempt's verdict is in the
store, or when the run lease is held in another namespace or cluster; a pod is force-deleted only while
Terminating on a node the snapshot shows lost. A heartbeat or API read that fails is never a silent or absent
worker: while it fails only terminal facts end the attempt, every stall clock counts from when it reads again, and
after ``supervision.STALE_VIEW_LIMIT_S`` the step exits 69 with the gang left as it is. A JobSet with neither Job
nor pod is no stall either (its controller has not acted): after ``supervision.JOBSET_UNACTED_LIMIT_S`` the same.

Exit codes: 0 succeeded; 1 the attempt failed or stalled; 2 configuration (no pinned config or a bad one, a
manifest override that is bad, the Kubernetes API refuses with 4xx); 69 transient (the API answers 429/5xx or cannot
be reached, the view or a heartbeat stays unreadable for minutes, no controller acts on the JobSet, the run store
cannot be read or written): the gang is left as it is and the retry re-attaches.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jaxrec.adapters import cli
from jaxrec.adapters.checkpoints import newest_complete_step
from jaxrec.adapters.documents import read_ledger
from jaxrec.adapters.store import AttemptRef, DocumentError, RunLayout, RunStore, first_line, store_errors
from jaxrec.model.config import JobConfig
from jaxrec.model.contract import AttemptOutcome, ExitCode
from jaxrec.model.gang import Gang
from jaxrec.model.jobset import HOST_SUSPECT, SAME_POOL_TRIES, JobSetParams, Placement, jobset_manifest, ladder
from jaxrec.model.outputs import SegmentOutputs
from jaxrec.model.records import SupervisionRecord, WorkerHeartbeat, WorkerSupervision, now, startup_attempts
from jaxrec.model.snapshot import (
    TRAINER_CONTAINER,
    ClusterSnapshot,
    ContainerState,
    NodeEvidence,
    PodEvidence,
    PodPhase,
    gang_pool,
)
from recovery_steps.in_place import AGENT_WATCH_S, WAKE_POLL_S, LevelZero, Restarted, current_attempt, restarts_line
from recovery_steps.kube_gang import KubeGang
from recovery_steps.retry import advanced
from recovery_steps.step import PIN_FIX, Step, StepError, api_error, api_failures, k8s_client, load_run_config
from recovery_steps.step import main as step_main
from recovery_steps.supervision import (
    JOBSET_UNACTED_LIMIT_S,
    MISSING_PODS_GRACE_S,
    STALE_VIEW_LIMIT_S,
    HeartbeatRead,
    Observation,
    ReadState,
    Verdict,
    WaitClock,
    WorkerProgress,
    decide,
    read_clock,
    startup_seconds,
    view_clock,
    wait_clock,
)

log = logging.getLogger(__name__)

# A heartbeat read that takes this long was retried through refusals or a slow store (a read answers in tens of
# milliseconds): it counts as a failed read for the hang clock (``read_clock``), which starts again once reads are
# quick again.
SLOW_HEARTBEAT_READ_S = 5.0
# How long the stop waits, beyond the pods' own termination grace, before it reports pods left over.
STOP_SLACK_S = 30


class AlreadyDecided(Exception):
    """An earlier try of this step already decided the attempt (its record is ``record``)."""

    def __init__(self, record: SupervisionRecord):
        super().__init__(record.reason)
        self.record = record


class GangGone(Exception):
    """The attempt's JobSet is not there, but the store shows its gang ran: never created again.

    A re-attaching supervisor (its pod lost, the retry late) that finds no JobSet reads "absent" only as "never
    created" when nothing of the attempt is in the store; heartbeats or exit reports of the attempt are positive
    evidence that its gang was created and is gone (completed and cleaned away, or deleted by someone else), and a
    second gang of the same attempt would start again from the attempt's restore step.
    """

    def __init__(self, reports: list[Any], unreadable: int):
        super().__init__(f"{len(reports)} exit report(s)" + (f", {unreadable} unreadable" if unreadable else ""))
        self.reports = reports


def recorded_verdict(store: RunStore, attempt: int) -> SupervisionRecord | None:
    """The attempt's supervision verdict (succeeded, failed or stalled) if a supervisor recorded one."""
    rec = store.read_record(RunLayout.supervision(attempt), SupervisionRecord)
    if rec is not None and rec.decided:
        return rec
    return None


# --- from the snapshot to the observation (pure) ---------------------------------------------------


def _trainer(p: PodEvidence) -> ContainerState | None:
    return next((c for c in p.containers if c.name == TRAINER_CONTAINER), None)


# --- the supervisor ------------------------------------------------------------------------------


def read_heartbeats(
    store: RunStore, attempt: int, hosts: int, last: Mapping[int, WorkerHeartbeat] | None = None
) -> tuple[list[WorkerHeartbeat], dict[int, str]]:
    """Every worker's newest heartbeat, and why each unreadable one could not be read.

    A heartbeat that cannot be read now (torn, of another schema, the store or its credentials unreachable) is
    the last one read (``last``) and is named in the errors: a store outage is not a worker that stopped stepping,
    and never escapes the supervision loop. A worker with no readable heartbeat yet has none.

    One call takes a bounded time: each read is retried for ``SLOW_HEARTBEAT_READ_S`` at most, and once the store
    failed one read, the workers after it are not read this round (the last beat read stands for each, named as
    unread), so an outage costs one bounded read, not one per host.
    """
    last = last or {}
    quick = store.bounded(SLOW_HEARTBEAT_READ_S)
    out, failed = [], {}
    outage: str | None = None
    for i in range(hosts):
        if outage is not None:
            beat, failed[i] = last.get(i), f"not read this round: {outage}"
            if beat is not None:
                out.append(beat)
            continue
        began = time.monotonic()
        try:
            beat = quick.read_record(RunLayout.heartbeat(attempt, i), WorkerHeartbeat)
        except (DocumentError, *store_errors()) as e:
            log.warning("heartbeat of worker %d unreadable (keeping the last one read): %s", i, e)
            beat, failed[i] = last.get(i), f"{type(e).__name__}: {e}"
            if not isinstance(e, DocumentError):  # the store's failure, not this worker's document: read no more
                outage = f"the store failed worker {i}'s read ({type(e).__name__})"
        took = time.monotonic() - began
        if i not in failed and took >= SLOW_HEARTBEAT_READ_S:
            # The storage client retried its way through refusals (429, 5xx) or the store was slow: the worker's
            # own heartbeat writes, to the same store, were held as long. Its silence says nothing meanwhile.
            failed[i] = f"the store answered this read after {took:.1f} s (retried or slow): writes were held too"
        if beat is not None:
            out.append(beat)
    return out, failed


class Progress:
    """One log line per change of the gang's state, and Argo's progress file."""

    def __init__(self, hosts: int, total_steps: int, progress_file: str | None, say: Callable[[str], None]):
        self.hosts, self.total, self.file, self.say = hosts, total_steps, progress_file, say
        self.seen: dict[str, Any] = {}

    def _note(self, key: str, value: Any, line: str) -> None:
        if value is not None and self.seen.get(key) != value:
            self.seen[key] = value
            self.say(line)

    def update(self, obs: Observation, verdict: Verdict) -> None:
        """Log what changed since the last call; rewrite the progress file when the step moved."""
        scheduled = sum(1 for p in obs.pods if p.node is not None)
        running = sum(1 for p in obs.pods if p.phase == PodPhase.RUNNING)
        self._note("scheduled", scheduled, f"workers scheduled {scheduled}/{self.hosts}")
        self._note("running", running, f"workers running {running}/{self.hosts}")
        steps = [b.step for b in obs.progress if b.step is not None]
        step = min(steps) if len(steps) == self.hosts else None
        if step is not None and step != self.seen.get("step") and self.file:
            with contextlib.suppress(OSError):
                Path(self.file).write_text(f"{step}/{self.total}")
        self._note("step", step, f"step {step}")
        if obs.view is not None:
            line = (
                "the cluster view is current again: stall clocks count from now"
                if obs.view.ok
                else f"the cluster view is not current ({obs.view.error}): no stall is judged until it is"
            )
            self._note("view", (obs.view.ok, obs.view.since), line)
        if verdict.over:
            self._note("verdict", verdict.state, f"{verdict.state.value}: {verdict.reason}")

    def checkpoint(self, step: int | None) -> None:
        """Log a newly committed checkpoint."""
        self._note("checkpoint", step, f"checkpoint {step}")


def worker_records(obs: Observation, beats: Sequence[WorkerHeartbeat], hosts: int) -> list[WorkerSupervision]:
    """Per worker: pod, node, scheduled/started/first-step times, last step and last state."""
    pods = {p.index: p for p in obs.pods if p.index is not None}
    by_beat = {b.process_index: b for b in beats}
    nodes = {n.name: n for n in obs.nodes}
    out = []
    for i in range(hosts):
        p, b = pods.get(i), by_beat.get(i)
        sched = p.condition("PodScheduled") if p else None
        out.append(
            WorkerSupervision(
                index=i,
                pod=p.name if p else None,
                node=p.node if p else None,
                scheduled_at=sched.at if sched is not None and sched.status == "True" else None,
                started_at=p.running_since if p else None,
                first_step_at=b.first_step_at if b else None,
                last_step=b.step if b else None,
                last_state=_pod_line(p, nodes.get(p.node) if p and p.node else None) if p else "no pod",
            )
        )
    return out


def _pod_line(p: PodEvidence, n: NodeEvidence | None) -> str:
    parts: list[str] = [p.phase or PodPhase.PENDING]
    if p.waiting_reason:
        parts.append(f"waiting {p.waiting_reason}")
    if p.exit_code is not None:
        parts.append(f"exit {p.exit_code} {p.terminated_reason or ''}".strip())
    if p.deleted_at is not None:
        parts.append("Terminating")
    sched = p.condition("PodScheduled")
    if sched is not None and sched.status == "False":
        parts.append(f"unschedulable: {sched.message or sched.reason}")
    if n is not None:
        parts.append(
            f"node {n.name} "
            + ("gone" if not n.found else "unreachable" if n.unreachable else "Ready" if n.ready else "NotReady")
        )
    return ", ".join(parts)


def evidence_lines(obs: Observation) -> list[str]:
    """Each pod's and node's last state, and each unreadable heartbeat, one line each (recorded before the stop)."""
    nodes = {n.name: n for n in obs.nodes}
    lines = [
        f"pod {p.name} ({p.label}): {_pod_line(p, nodes.get(p.node) if p.node else None)}"
        for p in sorted(obs.pods, key=lambda p: p.name)
    ]
    for n in obs.nodes:
        state = "gone" if not n.found else f"Ready={n.ready}" + (" unreachable" if n.unreachable else "")
        lines.append(f"node {n.name}: {state}")
    return lines + [
        f"heartbeat of worker {r.index}: unreadable for {obs.now - r.since:.0f} s (not taken as absent or silent): "
        f"{r.error}"
        for r in obs.unreadable
    ]


@dataclass(frozen=True)
class SupervisorIO:
    """The supervisor's clock and where it speaks: its log line and Argo's progress file (None: none)."""

    clock: Callable[[], float] = time.time
    say: Callable[[str], None] = log.info
    progress_file: str | None = None


def earlier_startup(store: RunStore, attempt: int) -> float | None:
    """The longest start-up (every worker running to every first step) of the run's latest earlier attempts.

    As their supervisors recorded it; None when none is known. A record that cannot be read adds nothing: the
    configured grace then stands alone.
    """
    seen = []
    for a in startup_attempts(attempt):
        try:
            rec = store.read_record(RunLayout.supervision(a), SupervisionRecord)
        except (DocumentError, *store_errors()) as e:  # a failed read leaves the configured grace as it is
            log.info("start-up of attempt %d not read (%s): the configured compile grace stands", a, e)
            continue
        took = startup_seconds(rec) if rec is not None else None
        if took is not None:
            seen.append(took)
    return max(seen) if seen else None


class Supervisor:
    """Supervises one attempt's gang, over the port ``model.gang.Gang``, until the decision says it is over."""

    def __init__(
        self,
        cfg: JobConfig,
        attempt: int,
        gang: Gang,
        store: RunStore,
        *,
        io: SupervisorIO = SupervisorIO(),
        renew: Callable[[float], LeaseLoss | None] | None = None,
        level0: LevelZero | None = None,
    ):
        self.cfg, self.attempt, self.gang, self.store = cfg, attempt, gang, store
        self.renew = renew
        self.clock = io.clock
        self.hosts = cfg.slice.num_hosts
        self.progress = Progress(self.hosts, cfg.training.total_steps, io.progress_file, io.say)
        self.say = io.say
        self.waits: dict[str, WaitClock] = {}
        self.lost_seen: dict[str, float] = {}
        self.created_at = self.clock()
        self.reattached = False
        self.beats: dict[int, WorkerHeartbeat] = {}
        self.reads: dict[int, HeartbeatRead] = {}
        self.view: ReadState | None = None  # how the cluster view stands once an observation failed (view_clock)
        self.unacted_since: float | None = None  # when this supervisor first saw the JobSet with no Job and no pod
        self.unacted_said = False
        self.startup_before_s = earlier_startup(store, attempt)
        self.gang_attempt = attempt  # the attempt the JobSet was created for; ``attempt`` is the one it runs now
        self.level0 = level0
        self.restarted: Restarted | None = None  # the restart in place that began the current attempt
        self.restarted_at: float | None = None

    def ensure_jobset(self, manifest: Mapping[str, Any]) -> None:
        """Create the attempt's JobSet, or re-attach when it already exists (the supervisor's pod was lost).

        Raises:
            AlreadyDecided: The JobSet is gone and this attempt's verdict is in the store: an earlier try of
                this step decided and stopped it (never create a second gang for a decided attempt).
        """
        existing = self.gang.find()
        if existing is None:
            decided = recorded_verdict(self.store, self.attempt)
            if decided is not None:
                raise AlreadyDecided(decided)
            self._never_ran()
            if self.gang.create(manifest) is not None:
                self.say(f"created JobSet {self.gang.name}")
                return
            existing = self.gang.find()
        if existing is not None and existing.attempt not in (None, str(self.attempt)):
            raise StepError(
                ExitCode.CONFIGURATION,
                f"JobSet {self.gang.name} exists but belongs to attempt {existing.attempt}, not "
                f"{self.attempt}: provision-slice must delete it first",
            )
        self.reattached = True
        self.created_at = (existing.created_at if existing else None) or self.clock()
        self.say(f"re-attached to JobSet {self.gang.name} (it already exists: not creating a second gang)")
        if self.level0 is not None and (now := current_attempt(self.store, self.gang_attempt)) != self.attempt:
            self.say(f"its trainers run attempt {now} (restarted in place): supervising that one")
            self.attempt, self.restarted_at, self.startup_before_s = now, self.clock(), earlier_startup(self.store, now)

    def _never_ran(self) -> None:
        """Raise ``GangGone`` when the store holds exit reports of this attempt.

        Every worker writes one on any exit it lives to make: a gang deleted by someone else leaves its SIGTERMed
        workers' reports. A read that fails raises too: it is no evidence that the gang never ran.
        """
        from jaxrec.adapters.documents import read_worker_reports

        reports, unreadable = read_worker_reports(self.store, self.attempt)
        if reports or unreadable:
            raise GangGone(reports, len(unreadable))

    def observe(self) -> tuple[Observation, list[WorkerHeartbeat]]:
        """The attempt now: the decision's input (the gang's snapshot with the supervisor's clocks), the heartbeats."""
        snap = self.gang.observe()
        now = snap.taken_at
        waits: dict[str, WaitClock] = {}
        for p in snap.pods:
            c = _trainer(p)
            # The clock of a pod's current pull or creation failure: kept while the same failure repeats, started
            # again when it changes, dropped once the container starts.
            clock = wait_clock(self.waits.get(p.name), c.waiting_reason, c.waiting_message, now) if c else None
            if clock is not None:
                waits[p.name] = clock
        self.waits = waits
        # When each lost node was first seen lost: the grace counts from it when the node's Ready condition gives no
        # time (the Node is gone). A node seen healthy again starts over.
        for n in snap.nodes:
            if n.lost:
                self.lost_seen.setdefault(n.name, now)
            else:
                self.lost_seen.pop(n.name, None)
        self.view = view_clock(self.view, snap.unreadable, now)
        beats = self.read_beats(now)
        self._bound_blindness(now)
        self._bound_unacted(snap, now)
        return self.observation(snap, beats), beats

    def _bound_blindness(self, now: float) -> None:
        """Exit 69 once the view or a worker's heartbeat has been unreadable for ``STALE_VIEW_LIMIT_S``."""
        failing = [("the cluster view", self.view), *((f"worker {i}'s heartbeat", r) for i, r in self.reads.items())]
        for what, r in failing:
            if r is not None and not r.ok and now - r.since >= STALE_VIEW_LIMIT_S:
                raise StepError(
                    ExitCode.TRANSIENT,
                    f"{what} has been unreadable for {now - r.since:.0f} s ({r.error}): not deciding on a stale "
                    f"view; JobSet {self.gang.name} is left running for the retry to re-attach",
                )

    def _bound_unacted(self, snap: ClusterSnapshot, now: float) -> None:
        """Exit 69 once the JobSet has had no Job and no pod for ``JOBSET_UNACTED_LIMIT_S`` of this supervisor's watch.

        ``decide`` judges no stall on such a JobSet: its controller has not acted on it.
        """
        unacted = snap.live_jobset is not None and not snap.jobs and not snap.pods
        if not unacted or snap.unreadable:
            self.unacted_since, self.unacted_said = None, False
            return
        since = self.unacted_since = now if self.unacted_since is None else self.unacted_since
        if not self.unacted_said and now - since >= max(self.cfg.supervision.startup_deadline_s, MISSING_PODS_GRACE_S):
            self.unacted_said = True
            self.say(
                f"JobSet {self.gang.name} has had no Job for {now - since:.0f} s: the JobSet controller has not "
                f"acted on it yet; no stall is judged before it does (transient after {JOBSET_UNACTED_LIMIT_S:g} s)"
            )
        if now - since >= JOBSET_UNACTED_LIMIT_S:
            raise StepError(
                ExitCode.TRANSIENT,
                f"JobSet {self.gang.name} has had no Job for {now - since:.0f} s: the JobSet controller has not "
                "acted on it (is it running? kubectl -n jobset-system get pods); left for the retry to re-attach",
            )

    def observation(self, snap: ClusterSnapshot, beats: Sequence[WorkerHeartbeat]) -> Observation:
        """The decision's input from one snapshot of the gang and the heartbeats in the store.

        With the supervisor's clocks: each pod's clock of its current pull or creation failure (``wait_clock``),
        when each lost node was first seen lost, and the workers whose heartbeat reads failed (``read_clock``).
        """
        js = snap.live_jobset
        return Observation(
            now=snap.taken_at,
            expected_workers=self.hosts,
            created_at=self.restarted_at or (js.created_at if js else None) or self.created_at,
            snapshot=snap,
            waits=dict(self.waits),
            lost_seen=dict(self.lost_seen),
            progress=tuple(
                WorkerProgress(
                    index=b.process_index,
                    step=b.step,
                    at=b.at,
                    first_step_at=b.first_step_at,
                    saving=b.saving,
                    phase=b.phase,
                    step_seconds=b.step_seconds,
                )
                for b in beats
            ),
            reads=tuple(r for _, r in sorted(self.reads.items())),
            view=self.view,
            startup_before_s=self.startup_before_s,
            ended=tuple(self.level0.ended(self.attempt)) if self.level0 is not None else (),
        )

    def read_beats(self, now: float) -> list[WorkerHeartbeat]:
        """The heartbeats now (an unreadable one: the last read), and each worker's reads since one failed."""
        beats, failed = read_heartbeats(self.store, self.attempt, self.hosts, self.beats)
        self.beats = {b.process_index: b for b in beats}
        reads = {i: read_clock(self.reads.get(i), i, failed.get(i), now) for i in range(self.hosts)}
        self.reads = {i: r for i, r in reads.items() if r is not None}
        return beats

    def supervise(self) -> tuple[Verdict, Observation, list[WorkerHeartbeat]]:
        """Observe and decide on every change and at least every ``watch_interval_s`` until the attempt is over."""
        interval = self.cfg.supervision.watch_interval_s
        if self.level0 is not None:  # a trainer's exit changes no pod: the agents' states are read this often
            interval = min(interval, AGENT_WATCH_S)
        while True:
            lost = self.renew(self.clock()) if self.renew is not None else None
            if lost is not None:
                self.lease_lost(lost)
            obs, beats = self.observe()
            verdict = decide(obs, self.cfg.supervision)
            self.progress.update(obs, verdict)
            ckpts = [b.checkpoint_step for b in beats if b.checkpoint_step is not None]
            self.progress.checkpoint(max(ckpts) if ckpts else None)
            if verdict.over:
                return verdict, obs, beats
            self.pause(interval)

    def pause(self, interval: float) -> None:
        """Until the next decision: ``interval`` seconds, a change the watchers saw, or an agent's wake (level 0)."""
        if self.level0 is None:
            self.gang.wait(interval)
            return
        end = time.monotonic() + interval
        while (left := end - time.monotonic()) > 0:
            if self.gang.wait(min(WAKE_POLL_S, left)) or self.level0.woken():
                return

    def lease_lost(self, lost: LeaseLoss) -> None:
        """End the segment (exit 2) once another workflow holds the run.

        The gang is deleted only when that holder is in another namespace or cluster (``lease.holder_elsewhere``),
        where it cannot see or adopt this gang.
        """
        if not lost.elsewhere:
            left = f"JobSet {self.gang.name} is left to the run's holder (it adopts the gang or decides on it)"
            raise StepError(ExitCode.CONFIGURATION, f"{lost.line}; {left}")
        self.say(f"{lost.line}: deleting this Workflow's gang, the run is held in another namespace or cluster")
        self.gang.delete()
        raise StepError(ExitCode.CONFIGURATION, f"{lost.line}; this Workflow's JobSet was deleted")

    def _record(self, verdict: Verdict, obs: Observation, beats: Sequence[WorkerHeartbeat]) -> SupervisionRecord:
        ckpts = [b.checkpoint_step for b in beats if b.checkpoint_step is not None]
        r = self.restarted
        return SupervisionRecord(
            attempt=self.attempt,
            jobset=self.gang.name,
            outcome=verdict.state,
            stall_kind=verdict.kind.value if verdict.kind else None,
            reason=verdict.reason,
            worker=verdict.worker,
            created_at=self.restarted_at or self.created_at,
            reattached=self.reattached,
            detected_at=self.clock(),
            last_step=max((b.step for b in beats if b.step is not None), default=None),
            checkpoint_step=max(ckpts) if ckpts else None,
            workers=worker_records(obs, beats, self.hosts),
            evidence=evidence_lines(obs),
            snapshot=obs.snapshot,
            placement=f"level 0: {r.placement.why}" if r is not None and r.attempt == self.attempt else None,
        )

    def _restart_in_place(self, record: SupervisionRecord, snap: ClusterSnapshot) -> bool:
        """Level 0 after a failed attempt (``in_place.LevelZero``): True when the gang now runs the next attempt."""
        if self.level0 is None or record.outcome == AttemptOutcome.SUCCEEDED:
            return False
        r = self.level0.restart(self.attempt, record, snap)
        if r is None:
            return False
        stopped = record.model_copy(update={"stopped_at": r.stopped_at})
        self.store.write_record(RunLayout.supervision(self.attempt), stopped)
        self.attempt, self.restarted, self.restarted_at = r.attempt, r, self.clock()
        self.beats, self.reads = {}, {}
        self.startup_before_s = earlier_startup(self.store, r.attempt)
        return True

    def run(self, manifest: Mapping[str, Any]) -> SupervisionRecord:
        """Create or re-attach, supervise until over (restarting in place where level 0 may), stop, and record.

        Returns the supervision record of the attempt the segment ended with.
        """
        self.ensure_jobset(manifest)
        try:
            self.gang.start()
            while True:
                verdict, obs, beats = self.supervise()
                record = self._record(verdict, obs, beats)
                detected = record.detected_at
                # The verdict is in the store before anything is stopped: a supervisor that cannot report does not
                # act (its retry re-attaches to the gang and decides again), and one lost during the stop leaves
                # its verdict for the retry (``recorded_verdict``) instead of a deleted gang it would re-create.
                self.store.write_record(RunLayout.supervision(self.attempt), record)
                if not self._restart_in_place(record, obs.snapshot):
                    break
            if verdict.state != AttemptOutcome.SUCCEEDED:
                record = self.stop_attempt(record, obs.snapshot)
            else:
                record = record.model_copy(update={"stopped_at": detected})
            # After the stop: a worker that got SIGTERM saved its step on the way out.
            newest = newest_complete_step(self.store)
            if newest is not None and (record.checkpoint_step is None or newest > record.checkpoint_step):
                record = record.model_copy(update={"checkpoint_step": newest})
            return record
        finally:
            self.gang.close()

    def stop_attempt(self, record: SupervisionRecord, snap: ClusterSnapshot) -> SupervisionRecord:
        """Delete the JobSet; force-delete pods stuck Terminating on a lost node; wait for the pods to go."""
        started = self.clock()
        self.say(f"stopping the attempt: deleting JobSet {self.gang.name}")
        self.gang.delete()
        grace = self.cfg.supervision.force_delete_grace_s
        pod_grace = max((p.grace_s or 30 for p in snap.pods), default=30)
        bound = started + grace + pod_grace + STOP_SLACK_S
        forced: list[str] = []
        while True:
            obs, _ = self.observe()
            if not obs.pods:
                return record.model_copy(update={"stopped_at": self.clock(), "force_deleted": forced})
            now = self.clock()
            nodes = {n.name: n for n in obs.nodes}
            for p in obs.pods:
                n = nodes.get(p.node) if p.node else None
                if p.name not in forced and n is not None and n.lost and now - started >= grace:
                    # The kubelet of a lost node never confirms the kill; the pod would stay Terminating
                    # until the Node object is deleted (GKE-NOTES: taint manager, pod GC, jobset#576).
                    self.say(f"force-deleting pod {p.name}: Terminating on node {p.node}, which is lost")
                    self.gang.force_delete(p.name)
                    forced.append(p.name)
            if now >= bound:
                left = ", ".join(p.name for p in obs.pods)
                self.say(f"pods still present after {now - started:.0f} s: {left}")
                evidence = [*record.evidence, f"pods left after stop: {left}"]
                return record.model_copy(update={"force_deleted": forced, "evidence": evidence})
            self.gang.wait(min(1.0, self.cfg.supervision.watch_interval_s))


# --- the step program ----------------------------------------------------------------------------


def load_manifest(text: str) -> dict[str, Any]:
    """The ``--jobset-manifest`` override (JSON or YAML), a JobSet as ``model.jobset`` renders one; else StepError."""
    try:
        manifest = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1} column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise StepError(
            ExitCode.CONFIGURATION, f"--jobset-manifest: not JSON or YAML ({problem}{at}); pass the rendered JobSet"
        ) from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("kind") != "JobSet"
        or not (manifest.get("metadata") or {}).get("name")
    ):
        raise StepError(ExitCode.CONFIGURATION, "--jobset-manifest: expected a JobSet with metadata.name")
    return manifest


def segment_params(args: argparse.Namespace) -> JobSetParams:
    """The attempt's JobSet parameters from the step's arguments (``parser``), as ``jobset_manifest`` takes them."""
    return JobSetParams(
        name=args.jobset_name,
        run_id=args.run_id,
        store_root=args.store_root,
        attempt=str(args.attempt),
        restore_step=str(args.restore_step),
        coordinator_port=str(args.coordinator_port),
        metrics_port=str(args.metrics_port),
    )


def segment_manifest(cfg: JobConfig, jobset: JobSetParams | str, config_url: str) -> dict[str, Any]:
    """The attempt's JobSet: rendered from the pinned config, or the ``--jobset-manifest`` override as given.

    ``cfg`` is the run's pinned config (read from ``config_url``), ``jobset`` the attempt's parameters or the
    override's text.

    Raises:
        StepError: Configuration (exit 2): the override is not a JobSet, or the pinned config renders none.
    """
    if isinstance(jobset, str):
        return load_manifest(jobset)
    try:
        return jobset_manifest(cfg, jobset)
    except (KeyError, ValueError) as e:  # an unknown TPU type, a value the JobSet cannot carry
        raise StepError(
            ExitCode.CONFIGURATION,
            f"{config_url}: the pinned config renders no JobSet ({type(e).__name__}: {e}); {PIN_FIX}",
        ) from None


@dataclass(frozen=True)
class LeaseLoss:
    """The run lease is another's now: the line saying so, and whether its holder is elsewhere."""

    line: str
    elsewhere: bool


def lease_renewal(
    store: RunStore, holder: str, ttl_s: float, say: Callable[[str], None], namespace: str | None = None
) -> Callable[[float], LeaseLoss | None]:
    """A per-loop call that renews the run lease when due; it returns the loss when the lease was lost.

    ``namespace`` is where this supervisor runs; its cluster is the one its own lease named when last renewed.
    """
    from recovery_steps import lease

    state: dict[str, Any] = {"next_at": 0.0, "cluster": None}

    def renew(at: float) -> LeaseLoss | None:
        r = lease.renew_if_due(store, holder, ttl_s, at, next_at=state["next_at"])
        state["next_at"] = r.next_at
        if r.line:
            say(r.line)
        if r.status == lease.RenewStatus.RENEWED and r.lease is not None:
            state["cluster"] = r.lease.cluster or state["cluster"]
        if r.status != lease.RenewStatus.LOST:
            return None
        elsewhere = lease.holder_elsewhere(r.lease, namespace, state["cluster"])
        return LeaseLoss(r.line or "the run lease is lost", elsewhere)

    return renew


def outputs_of(record: SupervisionRecord, restarted: str = "") -> SegmentOutputs:
    """The step's declared outputs from its supervision record (``restarted``: ``in_place.restarts_line``)."""
    return SegmentOutputs(
        outcome=record.outcome,
        stall_kind=record.stall_kind or "",
        reason=record.reason,
        last_step=record.last_step if record.last_step is not None else -1,
        checkpoint_step=record.checkpoint_step if record.checkpoint_step is not None else -1,
        placement=record.placement or "",
        restarted_in_place=restarted,
    )


# A gang factory: the port's adapter for this attempt, from the run's config, the manifest, the clock and the log.
GangFactory = Callable[[JobConfig, Mapping[str, Any], Callable[[], float], Callable[[str], None]], Gang]


def kube_gang(api_client: Any = None, k8s_host: str | None = None) -> GangFactory:
    """The Kubernetes adapter's factory (the client is built when the step runs: nothing at import time)."""

    def make(cfg: JobConfig, manifest: Mapping[str, Any], clock: Callable[[], float], say: Callable[[str], None]):
        client = api_client if api_client is not None else k8s_client(k8s_host)
        meta = manifest["metadata"]
        ns = meta.get("namespace") or cfg.namespace
        return KubeGang(client, ns, meta["name"], clock=clock, say=say, expected_pods=cfg.slice.num_hosts)

    return make


def run(
    ref: AttemptRef,
    jobset: JobSetParams | str,
    output_dir: Path,
    *,
    gang: GangFactory | None = None,
    io: SupervisorIO = SupervisorIO(),
    holder: str | None = None,
) -> SupervisionRecord:
    """Supervise attempt ``ref.attempt`` of the run to its end; write the record and the outputs.

    ``jobset``: the attempt's JobSet parameters, rendered with the run's pinned config (``segment_manifest``), or
    the text of a manifest override.
    ``gang`` builds the world's adapter (default: the Kubernetes one, ``kube_gang()``); ``io``: the supervisor's
    clock, log line and progress file.
    ``holder`` (the Workflow's uid) renews the run lease while the segment runs (``lease.renew_if_due``): a
    segment outlives the lease's TTL. A lease another Workflow holds now ends the segment (exit 2); it deletes its
    gang only when that holder is in another namespace or cluster (``lease.holder_elsewhere``).

    Raises:
        StepError: The attempt cannot be supervised (its ``code`` is the exit code).
    """
    attempt, say = ref.attempt, io.say
    cfg = load_run_config(ref.store_root, ref.run_id)
    store = ref.store()
    where = None
    if isinstance(jobset, JobSetParams):
        where = next_placement(store, attempt, say)
        jobset = dataclasses.replace(jobset, prefer_pool=where.prefer, avoid_pool=where.avoid)
    manifest = segment_manifest(cfg, jobset, store.url(RunLayout.CONFIG))
    port = (gang or kube_gang())(cfg, manifest, io.clock, say)
    renew = lease_renewal(store, holder, cfg.retry.lease_ttl_s, say, cfg.namespace) if holder else None
    level0 = None
    if cfg.retry.in_place_budget > 0:
        level0 = LevelZero(cfg, ref, port.name, clock=io.clock, wait=port.wait, say=say)
    sup = Supervisor(cfg, attempt, port, store, io=io, renew=renew, level0=level0)
    try:
        record = sup.run(manifest)
    except AlreadyDecided as done:
        say(f"attempt {attempt} was decided by an earlier try of this step ({done.record.outcome}); its JobSet is gone")
        record = done.record
    except GangGone as gone:
        record = gone_record(manifest["metadata"]["name"], attempt, cfg.slice.num_hosts, gone)
        say(f"{record.reason}: not creating a second gang for attempt {attempt}")
    except api_failures() as e:
        hint = "; retried in place (the retry re-attaches to a gang already created)"
        raise api_error(e, transient_hint=hint) from None
    # The placement this try rendered is the gang's only where this try created it; an earlier try's record keeps its.
    if where is not None and record.placement is None and not record.reattached:
        record = record.model_copy(update={"placement": f"level {where.level}: {where.why}"})
    store.write_record(RunLayout.supervision(record.attempt), record)
    restarted = ""
    if level0 is not None:
        try:
            restarted = restarts_line(read_ledger(store), record.jobset)
        except (*store_errors(), DocumentError) as e:  # an output, not a decision: say it and go on
            restarted = f"(the ledger cannot be read: {first_line(e)})"
    outputs_of(record, restarted).write(output_dir)
    return record


def next_placement(store: RunStore, attempt: int, say: Callable[[str], None] = log.info) -> Placement:
    """Where attempt ``attempt``'s gang asks to run, from the last attempts' classes and their supervisors' last views.

    Nothing is preferred for the first attempt, or when those records cannot be read (a preference is never worth
    a failed step).
    """
    if attempt <= 0:
        return Placement(1, why="the run's first attempt: no pool preferred")
    try:
        ledger = read_ledger(store)
        sup = store.read_record(RunLayout.supervision(attempt - 1), SupervisionRecord)
    except (*store_errors(), DocumentError) as e:
        why = (
            f"the run's ledger or attempt {attempt - 1}'s supervision cannot be read ({first_line(e)}): none preferred"
        )
        say(f"placement, level 1: {why}")
        return Placement(1, why=why)
    closed = {a.attempt: a for a in (ledger.attempts if ledger else [])}
    (pool, healthy), last = gang_pool(sup.snapshot if sup else None), closed.get(attempt - 1)
    failed_here = 0  # attempts in a row that failed on this pool, of a class a host may cause, without progress
    for a in range(attempt - 1, max(attempt - SAME_POOL_TRIES, 0) - 1, -1):
        rec = closed.get(a)
        if rec is None or rec.failure_class not in HOST_SUSPECT or advanced(rec):
            break
        if a != attempt - 1 and _pool_of(store, a) != pool:
            break
        failed_here += 1
    chosen = ladder(last.failure_class if last else None, pool, healthy, failed_here)
    say(f"placement, level {chosen.level}: {chosen.why}")
    return chosen


def _pool_of(store: RunStore, attempt: int) -> str | None:
    """The node pool attempt ``attempt`` ran on, as its supervisor last saw it; None when unknown or unreadable."""
    try:
        sup = store.read_record(RunLayout.supervision(attempt), SupervisionRecord)
    except (*store_errors(), DocumentError):
        return None
    return gang_pool(sup.snapshot if sup else None)[0]


def gone_record(jobset: str, attempt: int, hosts: int, gone: GangGone) -> SupervisionRecord:
    """The verdict on an attempt whose gang ran and is gone.

    Succeeded when every worker reported exit 0, else failed: the JobSet was deleted by someone else before the
    attempt ended.
    """
    ok = sorted({r.process_index for r in gone.reports if r.exit_code == ExitCode.OK})
    if len(ok) >= hosts:
        outcome = AttemptOutcome.SUCCEEDED
        reason = f"every worker succeeded ({len(ok)}/{hosts}), as their exit reports say; the JobSet is gone"
    else:
        outcome = AttemptOutcome.FAILED
        reason = (
            f"the attempt's JobSet is gone after its gang ran ({gone}; {len(ok)}/{hosts} workers reported exit 0): "
            "deleted by someone else"
        )
    at = now()
    return SupervisionRecord(
        attempt=attempt, jobset=jobset, outcome=outcome, reason=reason, detected_at=at, stopped_at=at
    )


def record_failure(args: argparse.Namespace, e: StepError) -> None:
    """The step's failure record: the reason the attempt could not be supervised, where classify-failure reads it."""
    rec = SupervisionRecord(
        attempt=args.attempt,
        jobset="",
        outcome=AttemptOutcome.ERROR,
        exit_code=int(e.code),
        reason=str(e),
        detected_at=now(),
    )
    try:
        RunStore(args.store_root, args.run_id).write_record(RunLayout.supervision(args.attempt), rec)
    except store_errors() as err:
        print(f"train-segment: could not record the error in the run store: {err}", file=sys.stderr)


class Terminated(BaseException):
    """SIGTERM reached the supervisor (a BaseException: no handler of the loop swallows it)."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def left_behind(store_root: str, run_id: str, attempt: int) -> str:
    """One line for a supervisor stopped by SIGTERM: what it leaves and who takes it over."""
    with contextlib.suppress(Exception):
        decided = recorded_verdict(RunStore(store_root, run_id), attempt)
        if decided is not None:
            return (
                f"SIGTERM after the verdict on attempt {attempt} ({decided.outcome}: {decided.reason}); its stop may "
                "be unfinished: a retry finds the verdict, provision-slice deletes what is left"
            )
    return (
        f"SIGTERM: the gang of attempt {attempt} is left running without a verdict; a retry of this step "
        "re-attaches to it, classify-failure has it supervised again, and the exit handler of a stopped run "
        "deletes it"
    )


# The attempt's parameters the JobSet is rendered with, beyond the run, store root and attempt (``segment_params``).
RENDER_FLAGS = ("--jobset-name", "--restore-step", "--coordinator-port", "--metrics-port")


class _SegmentParser(cli.StepArgumentParser):
    """The step's parser: the JobSet's parameters are required unless ``--jobset-manifest`` overrides it."""

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        missing = [f for f in RENDER_FLAGS if getattr(ns, f[2:].replace("-", "_")) is None]
        if ns.jobset_manifest is None and missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")
        return ns


def parser() -> argparse.ArgumentParser:
    """The step's arguments."""
    ap = _SegmentParser(prog="python -m recovery_steps.train_segment", description=__doc__.split("\n")[0])
    ap.add_argument("--store-root", required=True, type=cli.store_root)
    ap.add_argument("--run-id", required=True, type=cli.run_id)
    ap.add_argument("--attempt", type=cli.attempt, required=True)
    ap.add_argument("--jobset-name", type=cli.k8s_name, help="the attempt's JobSet name (provision-slice's output)")
    ap.add_argument(
        "--restore-step", type=cli.bounded_int(-1, 2**31 - 1, "a step"), help="the step to restore (-1: fresh start)"
    )
    ap.add_argument("--coordinator-port", type=cli.bounded_int(0, 65535, "a port"), help="the JAX coordinator port")
    ap.add_argument("--metrics-port", type=cli.bounded_int(0, 65535, "a port"), help="worker 0's metrics port")
    ap.add_argument(
        "--jobset-manifest",
        default=None,
        help="override: create this JobSet manifest (JSON or YAML, or @FILE) as given instead of rendering it from "
        "the run's pinned config (tests; the generated Workflow never passes it)",
    )
    ap.add_argument("--output-dir", type=cli.output_dir, default=Path("/tmp/outputs"))
    ap.add_argument(
        "--k8s-host", default=None, type=cli.http_url, help="Kubernetes API URL (default: in-cluster config)"
    )
    ap.add_argument("--holder", default=None, help="the Workflow's uid: renew the run lease while the segment runs")
    return ap


def act(
    args: argparse.Namespace,
    *,
    gang: GangFactory | None = None,
    progress_file: str | None = None,
    say: Callable[[str], None] = log.info,
) -> tuple[int, str]:
    """Supervise the attempt; exit 0 when it succeeded, 1 when it failed or stalled, and the outputs line.

    A SIGTERM (``argo stop``, a drain, an eviction) ends the step with 143 and one line saying what it leaves.
    """
    jobset: JobSetParams | str = args.jobset_manifest if args.jobset_manifest is not None else segment_params(args)
    if isinstance(jobset, str) and jobset.startswith("@"):
        try:
            jobset = Path(jobset[1:]).read_text()
        except OSError as e:
            raise StepError(ExitCode.CONFIGURATION, f"--jobset-manifest: {e.strerror or e}", record=False) from None
    try:
        record = run(
            AttemptRef.of(args),
            jobset,
            args.output_dir,
            gang=gang or kube_gang(k8s_host=args.k8s_host),
            io=SupervisorIO(say=say, progress_file=progress_file),
            holder=args.holder,
        )
    except Terminated:
        line = left_behind(args.store_root, args.run_id, args.attempt)
        raise StepError(128 + signal.SIGTERM, line, record=False) from None
    if record.outcome == AttemptOutcome.SUCCEEDED:
        return int(ExitCode.OK), " ".join(f"{k}={v}" for k, v in SegmentOutputs.read(args.output_dir).files().items())
    # The line a user reads first: the node's message in the Argo UI (recovery_steps.step.say_why).
    kind = f" ({record.stall_kind})" if record.stall_kind else ""
    return int(ExitCode.ATTEMPT_FAILED), f"attempt {record.attempt} {record.outcome}{kind}: {record.reason}"


def step(**act_kw: Any) -> Step:
    """The step program (``act_kw``: the world's gang factory, the progress file and the log, for ``act``)."""
    # The verdict is written before the stop: after a store failure a retry re-attaches to a gang still there, or
    # finds the verdict (exit 69, transient).
    return Step("train-segment", parser, functools.partial(act, **act_kw), SegmentOutputs, record_failure)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    # `argo stop`/`argo terminate`, a drain or an eviction SIGTERMs this pod: say what is left behind.
    signal.signal(signal.SIGTERM, _terminated)
    return step_main(step(progress_file=os.environ.get("ARGO_PROGRESS_FILE")), argv)


if __name__ == "__main__":
    sys.exit(main())
