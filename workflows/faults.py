"""The faults, one row and one name each, and what they act with: the local injector and the drill dispatch over it.

``workflows/local/inject.py`` rehearses the rows with a local way to act (``acts``), ``workflows/drill.py`` injects
the rows with ``on_cluster`` on a real cluster; both damage a checkpoint one way, so both rehearse the same
corruption.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxrec.adapters.store import RunLayout, RunStore


@dataclass(frozen=True)
class Fault:
    """One fault, by its one name: what a local run does with it and what the drill does on a cluster.

    ``acts`` None: the local run does not rehearse it; ``on_cluster`` None: the drill does not inject it.
    """

    name: str
    does: str  # what it does (``--inject``'s help)
    # How a local run acts. watch: on the workers when one reaches STEP; trainer: the trainer injects it into itself
    # (TRAINER_FAULT); withhold: the first attempt's slice never starts one worker; after-failure: on the store after
    # a failed attempt; hosts: on the hosts (local disks, placement) after the failed attempt, which a kill at STEP
    # causes.
    acts: str | None
    withheld: str | None  # withhold: the waiting reason the worker's pod shows
    ends: str  # how the local run ends: Succeeded, or Failed (the class's budget spent)
    # What ``workflows.drill`` does on a cluster (``docs/RUNBOOK.md`` says what to expect).
    on_cluster: str | None = None
    # acts "trainer": the fault the trainer injects into itself (``TRAINER_FAULT``'s KIND, one of
    # ``trainer.decisions.FAULT_KINDS``), into the first attempt only unless ``every_attempt``, with ``trainer_env``.
    trainer_fault: str | None = None
    every_attempt: bool = False
    trainer_env: tuple[tuple[str, str], ...] = ()


FAULTS: tuple[Fault, ...] = (
    Fault(
        "kill-worker",
        "SIGKILL one non-zero worker at STEP",
        "watch",
        None,
        "Succeeded",
        on_cluster="SIGKILLs one worker's trainer by exec (refused where the trainer is its container's PID 1)",
    ),
    Fault(
        "restart-worker",
        "kill one worker and start it again alone (it cannot rejoin: the gang fails and recovers)",
        "watch",
        None,
        "Succeeded",
    ),
    Fault(
        "preempt",
        "SIGTERM every worker at STEP, SIGKILL after the shutdown window (saved if it fits: no step lost)",
        "watch",
        None,
        "Succeeded",
    ),
    Fault(
        "freeze-worker",
        "SIGSTOP one worker at STEP (peers notice through heartbeats or the watchdog)",
        "watch",
        None,
        "Succeeded",
    ),
    Fault(
        "delete-workflow",
        "stop the whole local run at STEP and start it again with the same run id",
        "watch",
        None,
        "Succeeded",
        on_cluster="deletes the Workflow (no exit handler runs) and submits the same file again",
    ),
    Fault(
        "corrupt-latest",
        "after a failure, damage the newest checkpoint (a kill at STEP unless another fault is given)",
        "after-failure",
        None,
        "Succeeded",
        on_cluster="deletes a worker pod; once the attempt's workers stopped, damages the newest complete checkpoint",
    ),
    Fault(
        "kill-during-save",
        "process 0 kills itself while the checkpoint of STEP is written (first attempt)",
        "trainer",
        None,
        "Succeeded",
        trainer_fault="kill-during-save",
    ),
    Fault(
        "app-bug",
        "an exception in the training step at STEP on every attempt (ends Failed: application)",
        "trainer",
        None,
        "Failed",
        trainer_fault="app-bug",
        every_attempt=True,
    ),
    Fault(
        "stuck-pending",
        'the first attempt"s slice cannot place one worker (Pending, no room): capacity stall',
        "withhold",
        "Unschedulable",
        "Succeeded",
    ),
    Fault(
        "image-pull",
        "one worker of the first attempt never starts (ImagePullBackOff): configuration stall",
        "withhold",
        "ImagePullBackOff",
        "Failed",
    ),
    Fault(
        "node-lost",
        'at STEP one worker"s host is lost: frozen (SIGSTOP) and its pod Terminating: node-lost stall',
        "watch",
        None,
        "Succeeded",
    ),
    Fault(
        "silent-hang",
        "every worker stops stepping at STEP, alive, in-process watchdog off (first attempt): hang stall",
        "trainer",
        None,
        "Succeeded",
        # Every worker sleeps before STEP and nothing inside it notices: only the supervisor can.
        trainer_fault="hang",
        trainer_env=(("TRAINER_WATCHDOG", "off"),),
    ),
    Fault(
        "supervisor-lost",
        "the train-segment supervisor is lost at STEP; its retry re-attaches to the running gang",
        "watch",
        None,
        "Succeeded",
        on_cluster="evicts the train-segment pod, as a drain of its node does",
    ),
    Fault(
        "lose-host",
        'local tiers: a kill at STEP, then the killed worker"s host is replaced (its local disk is gone)',
        "hosts",
        None,
        "Succeeded",
    ),
    Fault(
        "lose-two-hosts",
        'local tiers: a kill at STEP, then the killed worker"s host and the one before it are replaced',
        "hosts",
        None,
        "Succeeded",
    ),
    Fault(
        "corrupt-local",
        'local tiers: a kill at STEP, then the killed worker"s newest part on its own disk is damaged',
        "hosts",
        None,
        "Succeeded",
    ),
    Fault(
        "swap-hosts",
        'local tiers: a kill at STEP, then workers 0 and 1 come back on each other"s hosts',
        "hosts",
        None,
        "Succeeded",
    ),
    Fault(
        "lose-slice",
        "local tiers: a kill at STEP, then every host is replaced (only GCS is left)",
        "hosts",
        None,
        "Succeeded",
    ),
    Fault(
        "delete-worker",
        "a worker pod deleted through the API (its grace period: the trainer gets SIGTERM)",
        None,
        None,
        "Succeeded",
        on_cluster="deletes one worker pod through the API",
    ),
    Fault(
        "drain-node",
        "one worker's node cordoned and the run's pods on it evicted, as kubectl drain does",
        None,
        None,
        "Succeeded",
        on_cluster="cordons one worker's node and evicts the run's pods on it (refused when others run there)",
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
