"""A local slice whose workers all ended, as its supervisor's snapshot holds it (the evidence classify reads)."""

from __future__ import annotations

from collections.abc import Sequence

from jaxrec.model.jobset import pod_failure_policy
from jaxrec.model.snapshot import ContainerState, JobEvidence, PodEvidence
from workflows.local.slices import job_failure


def ended_slice(
    jobset: str, ends: Sequence[tuple[int, float]], started: float
) -> tuple[list[PodEvidence], JobEvidence]:
    """The pods of ``jobset``'s workers, each ``(code, finished_at)``, and its Job.

    Each pod is terminated as the kubelet reports it (a process the signal N ended, code -N: exit code 128 + N,
    reason Error); the Job failed as the Job controller decides it from the shipped podFailurePolicy.
    """
    pods = [
        PodEvidence(
            name=f"{jobset}-workers-0-{i}",
            worker_index=i,
            node=f"local-{i}",
            phase="Failed",
            containers=[
                ContainerState(
                    name="trainer",
                    state="terminated",
                    reason="Error",
                    exit_code=128 - code if code < 0 else code,
                    started_at=started,
                    finished_at=ended,
                )
            ],
        )
        for i, (code, ended) in enumerate(ends)
    ]
    cond = job_failure(pod_failure_policy()["rules"], 0, pods, "default")
    return pods, JobEvidence(name=f"{jobset}-workers-0", conditions=[cond] if cond is not None else [])
