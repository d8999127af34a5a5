"""Failure injection for local runs: ``--inject SCENARIO[@STEP]``.

Scenarios act on the worker processes of a local slice when the trainer's events show a worker at
STEP, or set ``TRAINER_FAULT`` so that the trainer injects the fault into itself.
"""

from __future__ import annotations

import logging
import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxrec.adapters.store import RunStore
from jaxrec.model.config import LocalTierConfig
from jaxrec.model.records import EventKind, WorkerEvent, now
from workflows.faults import FAULTS, act, corrupt_newest_checkpoint, flip_middle
from workflows.local.cluster import SliceHooks
from workflows.local.engine import NodePhase
from workflows.local.events import EventTail, Injected, max_step
from workflows.local.slices import LocalSlice

log = logging.getLogger(__name__)


SCENARIO_TABLE = tuple(f for f in FAULTS if f.trigger is not None)  # the faults a local run rehearses
SCENARIOS = {s.name: s.does for s in SCENARIO_TABLE}
FAULT_ROWS = {s.name: s for s in SCENARIO_TABLE}
HOST_FAULTS = tuple(s.name for s in SCENARIO_TABLE if s.trigger == "hosts")
_WATCHED = tuple(s.name for s in SCENARIO_TABLE if s.trigger == "watch")
# Faults of the first attempt only that the slice itself plays (no worker process is signalled).
_WITHHELD = {s.name: s.withheld for s in SCENARIO_TABLE if s.trigger == "withhold"}


@dataclass
class Injection:
    """One requested fault and whether it fired."""

    scenario: str
    step: int
    fired: list[Injected] = field(default_factory=list)
    # Without @STEP the fault waits for the attempt's first committed checkpoint as well as its step:
    # an asynchronous commit can still be in flight at the step, most of all on a loaded machine.
    after_commit: bool = False
    # A host fault's kill waits until the newest local step at or before STEP has landed, every part on its own
    # host and on its peers (a loaded machine can be a step or two behind the pacing), up to LOCAL_WAIT_S.
    after_local: bool = False
    reached_at: float | None = None  # when a worker first reported STEP


# How long a host fault's kill waits, past its step, for that step's local and peer parts to land (a save the
# trainer skipped because the previous one still ran never lands: the kill goes ahead and says so).
LOCAL_WAIT_S = 30.0


def parse_injections(specs: list[str], interval: int) -> tuple[list[Injection], list[str]]:
    """Parse ``SCENARIO[@STEP]`` options; return the injections and one problem line per bad option.

    Without ``@STEP`` a scenario fires after the first checkpoint (interval + interval/2, and not before
    a checkpoint of the attempt committed), or at the second checkpoint for ``kill-during-save``.
    """
    out, problems = [], []
    for spec in specs:
        name, _, step_s = spec.partition("@")
        if name not in SCENARIOS:
            problems.append(f"--inject {spec}: unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
            continue
        if step_s:
            if not step_s.isdigit() or int(step_s) < 1:
                problems.append(f"--inject {spec}: STEP must be a positive integer (e.g. {name}@15)")
                continue
            out.append(Injection(name, int(step_s)))
        elif name == "kill-during-save":
            out.append(Injection(name, 2 * interval))
        else:
            out.append(Injection(name, interval + max(1, interval // 2), after_commit=True))
    names = [i.scenario for i in out]
    if "corrupt-latest" in names and not any(n in names for n in (*_WATCHED, "kill-during-save", "app-bug")):
        corrupt = next(i for i in out if i.scenario == "corrupt-latest")
        out.append(Injection("kill-worker", corrupt.step, after_commit=corrupt.after_commit))
    # Each host fault is one failure: a kill at its step, then the fault on the hosts before the next attempt.
    out += [
        Injection("kill-worker", i.step, after_commit=i.after_commit, after_local=True)
        for i in out
        if i.scenario in HOST_FAULTS
    ]
    return out, problems


class Hosts:
    """The local slice's nodes: which node each worker runs on, and each node's local directory (``hosts/<node>``).

    A replaced host is a new node with an empty directory (the old one is deleted, as a lost VM's local SSD is).
    """

    def __init__(self, directory: Path):
        self.dir = directory
        self.nodes: list[str] = []
        self._new = 0

    def placement(self, hosts: int) -> list[str]:
        """The node of each worker of the next attempt."""
        if len(self.nodes) != hosts:
            self.nodes = [f"local-host-{i}" for i in range(hosts)]
        return list(self.nodes)

    def replace(self, worker: int) -> str:
        """Worker ``worker``'s host is lost: delete its directory, put the worker on a new node."""
        old = self.nodes[worker]
        shutil.rmtree(self.dir / old, ignore_errors=True)
        self._new += 1
        self.nodes[worker] = f"local-host-new{self._new}"
        return f"host {old} of worker {worker} lost (its disk with it); the worker comes back on {self.nodes[worker]}"

    def swap(self, a: int, b: int) -> str:
        """Workers ``a`` and ``b`` come back on each other's nodes."""
        self.nodes[a], self.nodes[b] = self.nodes[b], self.nodes[a]
        return f"worker {a} now runs on {self.nodes[a]}, worker {b} on {self.nodes[b]}"

    def corrupt_own_part(self, worker: int) -> str:
        """Flip bytes in the middle of the newest part ``worker`` wrote to its own node's disk."""
        own = sorted(
            self.dir.glob(f"{self.nodes[worker]}/*/steps/*/part-{worker}/state.bin"),
            key=lambda p: int(p.parent.parent.name),
        )
        if not own:
            return f"no part of worker {worker} on {self.nodes[worker]} to damage"
        target = own[-1]
        target.write_bytes(flip_middle(target.read_bytes()))
        return f"damaged {target.relative_to(self.dir)} (same size)"


class Injector(SliceHooks):
    """Fires the requested faults on the local slices of a run (shared by every workflow run of it)."""

    def __init__(
        self,
        injections: list[Injection],
        events: EventTail,
        store: Callable[[], RunStore],
        on_delete: Callable[[], None] | None = None,
        say: Callable[[str], None] = print,
        hosts_dir: Path | None = None,
        local_tier: LocalTierConfig | None = None,
    ):
        self.injections = injections
        self.local_tier = local_tier  # the run's checkpoint.local: a host fault's kill waits for its parts
        self.hosts = Hosts(hosts_dir or Path("hosts"))
        self.events = events
        self.store = store
        self.on_delete = on_delete
        self.say = say
        self._first_attempt: int | None = None
        self._slices_seen = 0
        self.corrupted: list[str] = []
        self.cluster: Any = None  # the drill's view of the local cluster's API (``connect``): the verbs that act there
        # Preempted slices and when their node's shutdown window ends (the kill after the notice).
        self.kill_at: list[tuple[LocalSlice, float]] = []

    def connect(self, api: str, namespace: str) -> None:
        """Act through the local cluster's API at ``api``, its client built now (not when a fault fires)."""
        from jaxrec.adapters.kube import make_api_client
        from workflows import drill

        self.cluster = drill.Cluster(make_api_client(host=api), namespace)

    @property
    def fired(self) -> list[Injected]:
        """Every fault fired so far."""
        return [f for i in self.injections for f in i.fired]

    def _pending(self, scenario: str) -> Injection | None:
        return next((i for i in self.injections if i.scenario == scenario and not i.fired), None)

    def extra_env(self, attempt: int) -> dict[str, str]:
        """``TRAINER_FAULT`` (and what else the row sets) for the faults the trainer injects into itself."""
        self._slices_seen += 1
        faults: list[str] = []
        env: dict[str, str] = {}
        for i in self.injections:
            if self._in_trainer(i):
                row = FAULT_ROWS[i.scenario]
                faults.append(f"{row.trainer_fault}@{i.step}")
                env.update(row.trainer_env)
        if faults:
            env["TRAINER_FAULT"] = ",".join(faults)
        return env

    def withheld(self, attempt: int, hosts: int) -> dict[int, str]:
        """``stuck-pending`` / ``image-pull``: the last worker of the first attempt is never started."""
        if self._first_attempt is None:
            self._first_attempt = attempt
        if attempt != self._first_attempt:
            return {}
        out = {}
        for i in self.injections:
            if i.scenario in _WITHHELD and not i.fired:
                i.fired.append(Injected(i.scenario, attempt, now()))
                self.say(f"inject: worker {hosts - 1} of attempt {attempt} is never started ({_WITHHELD[i.scenario]})")
                out[hosts - 1] = _WITHHELD[i.scenario]
        return out

    def placement(self, attempt: int, hosts: int) -> list[str]:
        """The node of each worker (the host faults replace and swap them)."""
        return self.hosts.placement(hosts)

    def on_tick(self, sl: LocalSlice) -> None:
        """Fire the step-triggered scenarios once a worker of this slice has reached their step."""
        self.events.poll()
        for preempted, at in self.kill_at:
            if preempted is sl and now() >= at:
                for w in sl.workers:
                    if w.returncode is None and w.proc is not None and w.proc.poll() is None:
                        self.say(f"inject: shutdown window over: SIGKILL worker {w.index}")
                        sl.signal_worker(w.index, signal.SIGKILL)
        pending = [i for i in self.injections if i.scenario in _WATCHED and not i.fired]
        if not pending or sl.first_failure_index is not None:
            return
        since = (sl.workers[0].started_at or 0) - 1
        # The slice's trainers run its attempt, or the newest one they were restarted in place as (level 0).
        ours = [e for e in self.events.events if e.attempt >= sl.attempt and e.t >= since]
        attempt = max((e.attempt for e in ours), default=sl.attempt)
        mine = [e for e in ours if e.attempt == attempt]
        step = max_step(mine)
        if step is None:
            return
        committed = any(e.event == EventKind.SAVE_COMMITTED for e in mine)
        for inj in pending:
            if step >= inj.step and (committed or not inj.after_commit) and self._parts_landed(inj, sl, mine):
                self._fire(inj, sl, step, attempt)

    def _parts_landed(self, inj: Injection, sl: LocalSlice, mine: list[WorkerEvent]) -> bool:
        """Whether a host fault's kill may fire.

        It may once the newest local step at or before its step is on every host that holds a copy of it, or once
        LOCAL_WAIT_S passed since the step was reached (then it says what is missing).
        """
        if not inj.after_local:
            return True
        tier = self.local_tier
        if tier is None or not tier.interval_steps:
            return True
        target = inj.step - inj.step % tier.interval_steps
        hosts = len(sl.workers)
        want = hosts * (1 + min(tier.peers, hosts - 1))
        got = sum(1 for e in mine if e.event == EventKind.LOCAL_SAVED and e.step == target)
        if target <= 0 or got >= want:
            return True
        inj.reached_at = inj.reached_at or now()
        if now() - inj.reached_at < LOCAL_WAIT_S:
            return False
        self.say(f"inject: {got} of {want} local and peer parts of step {target} landed in {LOCAL_WAIT_S:.0f} s")
        return True

    def _fire(self, inj: Injection, sl: LocalSlice, step: int, attempt: int) -> None:
        """Act on ``sl`` for the watched fault ``inj`` with its row's verb, at ``step`` of ``attempt``."""
        inj.fired.append(Injected(inj.scenario, attempt, now()))
        self.say(f"inject: {act(LocalScene(self, sl, step), FAULT_ROWS[inj.scenario])}")

    def shutdown_window(self) -> float:
        """The run's ``slice.preemption_window_s`` (30 s, the Spot notice, when the config cannot be read)."""
        from jaxrec.adapters.documents import read_run_config

        try:
            return float(read_run_config(self.store()).slice.preemption_window_s)
        except Exception as e:  # noqa: BLE001 - the rehearsal goes on with the Spot default
            log.warning("preempt: cannot read the run config (%s); assuming a 30 s window", e)
            return 30.0

    def _in_trainer(self, i: Injection) -> bool:
        """Whether the trainers of the slice seen last inject ``i`` into themselves (its row says which attempts)."""
        row = FAULT_ROWS[i.scenario]
        return row.trainer_fault is not None and (row.every_attempt or self._slices_seen == 1)

    def after_slice(self, sl: LocalSlice, phase: NodePhase) -> None:
        """Note the trainer-side faults; ``corrupt-latest``: damage the newest checkpoint after a failure."""
        if phase == NodePhase.SUCCEEDED:
            return
        failed = sl.first_failure_index is not None
        if failed:
            at = sl.workers[sl.first_failure_index].ended_at or now()
            for i in self.injections:
                # A silent hang is noted below, when the supervisor found it.
                if self._in_trainer(i) and i.scenario != "silent-hang":
                    i.fired.append(Injected(i.scenario, sl.attempt, at))
        if self._slices_seen == 1 and (hang := self._pending("silent-hang")) is not None:
            # The hang began at the last heartbeat the supervisor saw; record when it was detected.
            hang.fired.append(Injected("silent-hang", sl.attempt, sl.detected_at or now()))
        # One host fault per failed attempt, in the order given.
        inj = next((i for i in self.injections if i.scenario in HOST_FAULTS and not i.fired), None)
        if failed and inj is not None:
            inj.fired.append(Injected(inj.scenario, sl.attempt, now()))
            self.say(f"inject: {inj.scenario}: {act(LocalScene(self, sl), FAULT_ROWS[inj.scenario])}")
        if (inj := self._pending("corrupt-latest")) is not None:
            inj.fired.append(Injected("corrupt-latest", sl.attempt, now()))
            self.say(f"inject: {act(LocalScene(self, sl), FAULT_ROWS[inj.scenario])}")


@dataclass
class LocalScene:
    """A running local attempt as the faults' verbs (``workflows.faults.Verbs``) act on it.

    The victim is the slice's last worker; ``step`` the step at which a watched fault fired.
    """

    injector: Injector
    sl: LocalSlice
    step: int | None = None

    @property
    def victim(self) -> int:
        """The worker a fault on one worker hits: the last one."""
        return len(self.sl.workers) - 1

    def _pid(self) -> int | None:
        return self.sl.workers[self.victim].pid

    def kill_trainer(self) -> str:
        """SIGKILL the victim's trainer process (its container's, or its agent's child)."""
        pid = self.sl.kill_trainer(self.victim)
        return f"SIGKILL worker {self.victim}'s trainer (pid {pid}) at step {self.step}"

    def _on_the_api(self) -> Any:
        """The drill's scene of this attempt on the local cluster's API: its verbs act there as on a cluster."""
        from workflows import drill

        if self.injector.cluster is None:
            raise RuntimeError("the injector is connected to no API to act through")
        store = self.injector.store()
        target = drill.Target({}, self.sl.namespace, store.run_id, store.root)
        return drill.scene(self.injector.cluster, store, target, "", self.sl.attempt, now() + LOCAL_WAIT_S)

    def delete_pod(self) -> str:
        """Delete the victim's pod through the local cluster's API, as the drill does on a cluster."""
        return f"{self._on_the_api().delete_pod()} through the API at step {self.step} (its kubelet sends SIGTERM)"

    def drain_node(self) -> str:
        """Cordon the victim's node, evict the run's pods on it through the local cluster's API, as the drill does."""
        return f"{self._on_the_api().drain_node()} through the API at step {self.step}"

    def restart_trainer(self) -> str:
        """Kill the victim and start it again alone (a container restart)."""
        self.sl.restart(self.victim)
        return f"killed worker {self.victim} at step {self.step} and started it again alone"

    def preempt(self) -> str:
        """SIGTERM every worker; SIGKILL those left at the end of the node's shutdown window."""
        window = self.injector.shutdown_window()
        for w in self.sl.workers:
            self.sl.signal_worker(w.index, signal.SIGTERM)
        # The node goes away at the end of its shutdown window, whatever the pods' grace says
        # (GKE docs "Spot VMs": the notice is 30 s, non-system pods get its first 15 s by default).
        self.injector.kill_at.append((self.sl, now() + window))
        return f"SIGTERM to every worker at step {self.step} (preemption notice; killed after {window} s)"

    def freeze_trainer(self) -> str:
        """SIGSTOP the victim."""
        self.sl.signal_worker(self.victim, signal.SIGSTOP)
        return f"SIGSTOP worker {self.victim} (pid {self._pid()}) at step {self.step}"

    def lose_node(self) -> str:
        """The victim's host goes silent: its process frozen, its node unreachable, its pod Terminating."""
        self.sl.signal_worker(self.victim, signal.SIGSTOP)
        self.sl.lost[self.victim] = now()
        return f"the host of worker {self.victim} is lost at step {self.step} (frozen; its pod Terminating)"

    def evict_supervisor(self) -> str:
        """The train-segment step's process goes; the workers keep running for its retry to re-attach to."""
        self.sl.supervisor_lost.set()
        return f"the train-segment supervisor is lost at step {self.step}; the workers keep running"

    def resubmit(self) -> str:
        """Delete the running Workflow (its steps stop, no exit handler; the gang trains on) and submit it again."""
        if self.injector.on_delete is not None:
            self.injector.on_delete()
        return f"deleted the Workflow at step {self.step} (its gang trains on); it is submitted again"

    def corrupt_latest(self) -> str:
        """Damage the newest complete checkpoint (the attempt's workers have stopped)."""
        damaged = corrupt_newest_checkpoint(self.injector.store())
        if damaged:
            self.injector.corrupted.append(damaged)
        return f"corrupted {damaged or 'nothing (no checkpoint yet)'}"

    def lose_host(self) -> str:
        """The victim's host is replaced, its local disk with it."""
        return self.injector.hosts.replace(self.victim)

    def lose_two_hosts(self) -> str:
        """The victim's host and the one before it are replaced."""
        hosts = self.injector.hosts
        return "; ".join(hosts.replace(w) for w in sorted({(self.victim - 1) % len(hosts.nodes), self.victim}))

    def lose_slice(self) -> str:
        """Every host is replaced: only the store is left."""
        hosts = self.injector.hosts
        return "; ".join(hosts.replace(w) for w in range(len(hosts.nodes)))

    def swap_hosts(self) -> str:
        """Workers 0 and 1 come back on each other's hosts."""
        return self.injector.hosts.swap(0, 1)

    def corrupt_local(self) -> str:
        """Damage the victim's newest part on its own host's disk."""
        return self.injector.hosts.corrupt_own_part(self.victim)
