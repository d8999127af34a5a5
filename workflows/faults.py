"""The faults, one row and one name each, and the cluster verbs they act with.

The verbs are one set, ``Verbs``, that each world performs its own way: ``workflows/local/inject.py``'s
``LocalScene`` on the local cluster (its worker processes, hosts and API), ``workflows/drill.py``'s ``Scene`` on a
real one (the Kubernetes API, an exec into a pod). Both call ``act(scene, row)`` and damage a checkpoint with
``corrupt_newest_checkpoint``, so both rehearse the same corruption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from jaxrec.adapters.store import RunLayout, RunStore


class Verbs(Protocol):
    """What a fault does to a running attempt, each verb returning one line that says what it did.

    The victim is the attempt's last worker. A world performs the verbs its rows use there: the local scene every
    verb, the drill's scene the verbs of the rows it injects. ``delete_pod`` and ``drain_node`` are the drill's own
    in both worlds, through the local cluster's API or a real one's.
    """

    def kill_trainer(self) -> str:
        """SIGKILL the victim's trainer process."""

    def delete_pod(self) -> str:
        """Delete the victim's pod through the API (its grace: SIGTERM first)."""

    def drain_node(self) -> str:
        """Cordon the victim's node, evict the run's pods on it."""

    def evict_supervisor(self) -> str:
        """The train-segment pod goes, the gang keeps running."""

    def corrupt_latest(self) -> str:
        """Damage the newest complete checkpoint once the workers stopped."""

    def resubmit(self) -> str:
        """Delete the Workflow (no exit handler) and submit it again."""

    def restart_trainer(self) -> str:
        """Kill the victim and start it again alone."""

    def preempt(self) -> str:
        """SIGTERM every worker, SIGKILL at the end of the shutdown window."""

    def freeze_trainer(self) -> str:
        """SIGSTOP the victim."""

    def lose_node(self) -> str:
        """The victim's node goes silent: frozen, its pod Terminating."""

    def lose_host(self) -> str:
        """The victim's host (and its local disk) replaced."""

    def lose_two_hosts(self) -> str:
        """The victim's host and the one before it replaced."""

    def lose_slice(self) -> str:
        """Every host replaced."""

    def swap_hosts(self) -> str:
        """Workers 0 and 1 come back on each other's hosts."""

    def corrupt_local(self) -> str:
        """Damage the victim's newest part on its own disk."""


@dataclass(frozen=True)
class Fault:
    """One fault, by its one name: when a local run fires it, the verb it acts with, and what the drill does.

    ``trigger`` None: a local run does not rehearse it; ``on_cluster`` None: the drill does not inject it.
    """

    name: str
    does: str  # what it does (``--inject``'s help)
    # When a local run fires it. watch: when a worker reaches STEP; trainer: the trainer injects it into itself
    # (TRAINER_FAULT); withhold: the first attempt's slice never starts one worker; after-failure: after a failed
    # attempt (a kill at STEP fails it unless another fault does); hosts: on the hosts after the failed attempt,
    # which a kill at STEP causes.
    trigger: str | None
    withheld: str | None = None  # withhold: the waiting reason the worker's pod shows
    ends: str = "Succeeded"  # how the local run ends: Succeeded, or Failed (the class's budget spent)
    verb: str | None = None  # the ``Verbs`` method it acts with (None: the trainer or the slice itself plays it)
    # What ``workflows.drill`` does on a cluster (``docs/RUNBOOK.md`` says what to expect).
    on_cluster: str | None = None
    # trigger "trainer": the fault the trainer injects into itself (``TRAINER_FAULT``'s KIND, one of
    # ``trainer.decisions.FAULT_KINDS``), into the first attempt only unless ``every_attempt``, with ``trainer_env``.
    trainer_fault: str | None = None
    every_attempt: bool = False
    trainer_env: tuple[tuple[str, str], ...] = ()


def act(scene: Verbs, row: Fault) -> str:
    """Perform ``row``'s verb on ``scene``; the line it says."""
    if row.verb is None:
        raise ValueError(f"fault {row.name} acts with no verb: the trainer or the slice plays it")
    return getattr(scene, row.verb)()


FAULTS: tuple[Fault, ...] = (
    Fault(
        "kill-worker",
        "SIGKILL one non-zero worker at STEP",
        "watch",
        verb="kill_trainer",
        on_cluster="SIGKILLs one worker's trainer by exec (refused where the trainer is its container's PID 1)",
    ),
    Fault(
        "restart-worker",
        "kill one worker and start it again alone (it cannot rejoin: the gang fails and recovers)",
        "watch",
        verb="restart_trainer",
    ),
    Fault(
        "preempt",
        "SIGTERM every worker at STEP, SIGKILL after the shutdown window (saved if it fits: no step lost)",
        "watch",
        verb="preempt",
    ),
    Fault(
        "freeze-worker",
        "SIGSTOP one worker at STEP (peers notice through heartbeats or the watchdog)",
        "watch",
        verb="freeze_trainer",
    ),
    Fault(
        "delete-workflow",
        "delete the Workflow at STEP (its steps stop, no exit handler; its gang trains on) and submit it again",
        "watch",
        verb="resubmit",
        on_cluster="deletes the Workflow (no exit handler runs) and submits the same file again",
    ),
    Fault(
        "corrupt-latest",
        "after a failure, damage the newest checkpoint (a kill at STEP unless another fault is given)",
        "after-failure",
        verb="corrupt_latest",
        on_cluster="deletes a worker pod; once the attempt's workers stopped, damages the newest complete checkpoint",
    ),
    Fault(
        "kill-during-save",
        "process 0 kills itself while the checkpoint of STEP is written (first attempt)",
        "trainer",
        trainer_fault="kill-during-save",
    ),
    Fault(
        "app-bug",
        "an exception in the training step at STEP on every attempt (ends Failed: application)",
        "trainer",
        ends="Failed",
        trainer_fault="app-bug",
        every_attempt=True,
    ),
    Fault(
        "stuck-pending",
        'the first attempt"s slice cannot place one worker (Pending, no room): capacity stall',
        "withhold",
        withheld="Unschedulable",
    ),
    Fault(
        "image-pull",
        "one worker of the first attempt never starts (ImagePullBackOff): configuration stall",
        "withhold",
        withheld="ImagePullBackOff",
        ends="Failed",
    ),
    Fault(
        "node-lost",
        'at STEP one worker"s host is lost: frozen (SIGSTOP) and its pod Terminating: node-lost stall',
        "watch",
        verb="lose_node",
    ),
    Fault(
        "silent-hang",
        "every worker stops stepping at STEP, alive, in-process watchdog off (first attempt): hang stall",
        "trainer",
        # Every worker sleeps before STEP and nothing inside it notices: only the supervisor can.
        trainer_fault="hang",
        trainer_env=(("TRAINER_WATCHDOG", "off"),),
    ),
    Fault(
        "supervisor-lost",
        "the train-segment supervisor is lost at STEP; its retry re-attaches to the running gang",
        "watch",
        verb="evict_supervisor",
        on_cluster="evicts the train-segment pod, as a drain of its node does",
    ),
    Fault(
        "delete-worker",
        "one worker's pod deleted through the API at STEP (its grace period: the trainer gets SIGTERM first)",
        "watch",
        verb="delete_pod",
        on_cluster="deletes one worker pod through the API",
    ),
    Fault(
        "drain-node",
        "at STEP one worker's node cordoned and the run's pods on it evicted through the API, as kubectl drain does",
        "watch",
        verb="drain_node",
        on_cluster="cordons one worker's node and evicts the run's pods on it (refused when others run there)",
    ),
    Fault(
        "lose-host",
        'local tiers: a kill at STEP, then the killed worker"s host is replaced (its local disk is gone)',
        "hosts",
        verb="lose_host",
    ),
    Fault(
        "lose-two-hosts",
        'local tiers: a kill at STEP, then the killed worker"s host and the one before it are replaced',
        "hosts",
        verb="lose_two_hosts",
    ),
    Fault(
        "corrupt-local",
        'local tiers: a kill at STEP, then the killed worker"s newest part on its own disk is damaged',
        "hosts",
        verb="corrupt_local",
    ),
    Fault(
        "swap-hosts",
        'local tiers: a kill at STEP, then workers 0 and 1 come back on each other"s hosts',
        "hosts",
        verb="swap_hosts",
    ),
    Fault(
        "lose-slice",
        "local tiers: a kill at STEP, then every host is replaced (only GCS is left)",
        "hosts",
        verb="lose_slice",
    ),
)


def flip_middle(data: bytes) -> bytes:
    """``data`` with the 16 bytes in its middle inverted (same size: only a checksum can tell)."""
    out = bytearray(data)
    mid = len(out) // 2
    for i in range(mid, min(len(out), mid + 16)):
        out[i] ^= 0xFF
    return bytes(out)


def corrupt_newest_checkpoint(store: RunStore) -> str | None:
    """Flip bytes in the largest array file of the newest checkpoint that has a manifest (a complete save).

    An array's bytes, the same size: what silent corruption does, and what only the manifest's checksums reveal.

    Returns:
        What was damaged (``checkpoints/<step>/<file>``), or None when there is no such checkpoint.
    """
    for step in reversed(store.checkpoint_steps()):
        if not store.exists(RunLayout.checkpoint_manifest(step)):
            continue
        files = [
            o
            for o in store.list(RunLayout.checkpoint(step))
            if not o.name.endswith(".json") and "METADATA" not in o.name.upper() and o.size > 0
        ]
        if not files:
            continue
        target = max(files, key=lambda o: o.size)
        store.write_bytes(target.name, flip_middle(store.read_bytes(target.name) or b""))
        return target.name
    return None
