"""The local JobSet stand-in seen the way the Kubernetes API shows a JobSet: a ``ClusterSnapshot`` of its processes.

``slice_snapshot`` turns the worker processes of a ``LocalSlice`` into the same record the Kubernetes adapter of
``train-segment`` builds from the API (``recovery_steps.kernel.snapshot``), so that one supervisor, one decision
and one record serve both worlds. A worker the slice could not place is a Pending pod the scheduler refused; one
whose image "cannot be pulled" is a Pending pod waiting in ``ImagePullBackOff``; a worker whose "node" was lost is
Running on a node that is unreachable (Ready Unknown, the unreachable taint), with a deletion timestamp; a worker
being stopped is a pod being deleted, and one that exited after the delete is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recovery_steps.kernel.names import UNREACHABLE_TAINT
from recovery_steps.kernel.snapshot import (
    TRAINER_CONTAINER,
    ClusterSnapshot,
    Condition,
    ContainerState,
    JobSetEvidence,
    NodeEvidence,
    PodEvidence,
)

if TYPE_CHECKING:
    from workflows.local.executor import LocalSlice, WorkerProc

UNSCHEDULABLE = "Unschedulable"
IMAGE_PULL = "ImagePullBackOff"


def node_name(index: int) -> str:
    """The stand-in node of worker ``index`` (one host per worker, as on a TPU slice)."""
    return f"local-{index}"


def pod_name(jobset: str, index: int) -> str:
    """The pod name JobSet would give worker ``index`` (without the random suffix)."""
    return f"{jobset}-workers-0-{index}"


def _pod(sl: LocalSlice, w: WorkerProc, image: str) -> PodEvidence | None:
    """Worker ``w`` as its pod (None: the pod is gone, its worker exited after the JobSet was deleted)."""
    held = sl.withheld.get(w.index)
    base = {
        "name": pod_name(sl.jobset, w.index),
        "worker_index": w.index,
        "created_at": sl.created_at,
        "grace_s": sl.grace_seconds,
    }
    if held == UNSCHEDULABLE:
        room = f"0/{len(sl.workers)} local hosts have room for this worker (rehearsal)"
        cond = Condition(type="PodScheduled", status="False", reason=UNSCHEDULABLE, at=sl.created_at, message=room)
        return None if sl.deleted_at is not None else PodEvidence(**base, phase="Pending", conditions=[cond])
    scheduled = [Condition(type="PodScheduled", at=w.started_at or sl.created_at)]
    if held == IMAGE_PULL:
        # The message as kubelet >= 1.32 writes it: the back-off repeats the pull's error (kubernetes#127918).
        pulled = f'Back-off pulling image "{image}": ErrImagePull: failed to resolve reference "{image}": not found'
        waiting = ContainerState(
            name=TRAINER_CONTAINER, state="waiting", waiting_reason=IMAGE_PULL, waiting_message=f"{pulled} (rehearsal)"
        )
        if sl.deleted_at is not None:
            return None
        return PodEvidence(**base, phase="Pending", node=node_name(w.index), conditions=scheduled, containers=[waiting])
    if w.proc is None:
        return None if sl.deleted_at is not None else PodEvidence(**base, phase="Pending")
    if w.returncode is None:
        running = ContainerState(name=TRAINER_CONTAINER, state="running", running_since=w.started_at)
        deleted = sl.lost.get(w.index, sl.deleted_at)
        return PodEvidence(
            **base,
            phase="Running",
            node=node_name(w.index),
            conditions=scheduled,
            containers=[running],
            deleted_at=deleted,
        )
    if sl.deleted_at is not None:
        return None  # a deleted JobSet takes its ended pods with it
    ok = w.returncode == 0
    ended = ContainerState(
        name=TRAINER_CONTAINER,
        state="terminated",
        exit_code=w.exit_code,
        reason="Completed" if ok else (w.signal_name or "Error"),
        started_at=w.started_at,
        finished_at=w.ended_at,
    )
    return PodEvidence(
        **base, phase="Succeeded" if ok else "Failed", node=node_name(w.index), conditions=scheduled, containers=[ended]
    )


def _node(sl: LocalSlice, index: int) -> NodeEvidence:
    if index in sl.lost:
        # As the node lifecycle controller leaves a node whose kubelet went silent: Ready Unknown, tainted.
        return NodeEvidence(
            name=node_name(index),
            ready=None,
            ready_reason="NodeStatusUnknown",
            ready_since=sl.lost[index],
            taints=[f"{UNREACHABLE_TAINT}:NoExecute"],
        )
    return NodeEvidence(name=node_name(index), ready=True, ready_reason="KubeletReady")


def slice_snapshot(sl: LocalSlice, now: float, image: str = "") -> ClusterSnapshot:
    """The local slice's "pods" and "nodes" now, as the Kubernetes adapter would report them."""
    pods = [p for w in sl.workers if (p := _pod(sl, w, image)) is not None]
    nodes = [_node(sl, w.index) for w in sl.workers if sl.withheld.get(w.index) != UNSCHEDULABLE]
    # Foreground deletion: the JobSet stays until its pods are gone.
    js = JobSetEvidence(name=sl.jobset, created_at=sl.created_at)
    return ClusterSnapshot(taken_at=now, jobset=js, pods=sorted(pods, key=lambda p: p.name), nodes=nodes)
