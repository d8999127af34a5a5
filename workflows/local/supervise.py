"""The local JobSet stand-in seen the way the supervisor sees a JobSet: an ``Observation`` of its processes.

``slice_observation`` turns the worker processes of a ``LocalSlice`` into the same record the
``train-segment`` supervisor builds from the Kubernetes API, so that both call one decision
(``recovery_steps.supervision.decide``). A worker the slice could not place is a Pending pod the
scheduler refused; one whose image "cannot be pulled" is a Pending pod waiting in ``ImagePullBackOff``;
a worker whose "node" was lost is Running on a node that is unreachable, with a deletion timestamp.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from recovery_steps.kernel.records import WorkerHeartbeat
from recovery_steps.supervision import NodeObservation, Observation, PodCondition, PodObservation, WorkerProgress

if TYPE_CHECKING:
    from workflows.local.executor import LocalSlice

UNSCHEDULABLE = "Unschedulable"
IMAGE_PULL = "ImagePullBackOff"


def node_name(index: int) -> str:
    """The stand-in node of worker ``index`` (one host per worker, as on a TPU slice)."""
    return f"local-{index}"


def pod_name(jobset: str, index: int) -> str:
    """The pod name JobSet would give worker ``index`` (without the random suffix)."""
    return f"{jobset}-workers-0-{index}"


def slice_observation(sl: LocalSlice, now: float, beats: Sequence[WorkerHeartbeat], image: str = "") -> Observation:
    """The decision's input from the local processes of one attempt and the workers' heartbeats."""
    pods = []
    for w in sl.workers:
        name, node = pod_name(sl.jobset, w.index), node_name(w.index)
        held = sl.withheld.get(w.index)
        if held == UNSCHEDULABLE:
            room = f"0/{len(sl.workers)} local hosts have room for this worker (rehearsal)"
            cond = PodCondition(type="PodScheduled", status="False", reason=UNSCHEDULABLE, since=sl.created_at,
                                message=room)  # fmt: skip
            pods.append(PodObservation(name=name, index=w.index, created_at=sl.created_at, conditions=(cond,)))
        elif held == IMAGE_PULL:
            # The message as kubelet >= 1.32 writes it: the back-off repeats the pull's error (kubernetes#127918).
            pulled = f'Back-off pulling image "{image}": ErrImagePull: failed to resolve reference "{image}": not found'
            pods.append(PodObservation(
                name=name, index=w.index, node=node, created_at=sl.created_at, waiting_reason=IMAGE_PULL,
                waiting_since=sl.created_at, waiting_message=f"{pulled} (rehearsal)",
                conditions=(PodCondition(type="PodScheduled", since=sl.created_at),),
            ))  # fmt: skip
        elif w.proc is None:
            pods.append(PodObservation(name=name, index=w.index, created_at=sl.created_at))
        elif w.returncode is None:
            pods.append(PodObservation(
                name=name, index=w.index, phase="Running", node=node, created_at=sl.created_at,
                running_since=w.started_at, deletion_timestamp=sl.lost.get(w.index),
                conditions=(PodCondition(type="PodScheduled", since=w.started_at),),
            ))  # fmt: skip
        else:
            pods.append(PodObservation(
                name=name, index=w.index, phase="Succeeded" if w.returncode == 0 else "Failed", node=node,
                created_at=sl.created_at, running_since=w.started_at, exit_code=w.exit_code,
                terminated_reason="Completed" if w.returncode == 0 else (w.signal_name or "Error"),
                conditions=(PodCondition(type="PodScheduled", since=w.started_at),),
            ))  # fmt: skip
    nodes = tuple(
        NodeObservation(name=node_name(w.index), ready=None if w.index in sl.lost else True,
                        unreachable=w.index in sl.lost, since=sl.lost.get(w.index))
        for w in sl.workers if sl.withheld.get(w.index) != UNSCHEDULABLE
    )  # fmt: skip
    return Observation(
        now=now,
        expected_workers=len(sl.workers),
        created_at=sl.created_at,
        pods=tuple(pods),
        nodes=nodes,
        progress=tuple(
            WorkerProgress(index=b.process_index, step=b.step, at=b.at, first_step_at=b.first_step_at) for b in beats
        ),  # fmt: skip
    )
