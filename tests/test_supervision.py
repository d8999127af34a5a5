"""A table of attempts as the supervisor observes them, and the state each is in (the pure decision)."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import pytest
from pydantic import ValidationError

from jaxrec.model.config import ConfigError, SupervisionConfig, parse_config
from jaxrec.model.contract import AttemptOutcome
from jaxrec.model.names import SPOT_LABEL, UNREACHABLE_TAINT
from jaxrec.model.snapshot import (
    ClusterSnapshot,
    Condition,
    ContainerState,
    JobEvidence,
    JobSetEvidence,
    NodeEvidence,
    PodEvidence,
    first_failed,
)
from recovery_steps.supervision import (
    HeartbeatRead,
    Observation,
    ReadState,
    StallKind,
    Verdict,
    WaitClock,
    WorkerProgress,
    decide,
    pull_failure_is_credentials,
    pull_failure_is_permanent,
    read_clock,
    startup_seconds,
    view_clock,
    wait_clock,
    waiting_cause,
)

T0 = 1_714_557_600.0  # 2024-05-01T10:00:00Z: the JobSet was created
HOSTS = 4
D = SupervisionConfig(
    startup_deadline_s=600,
    image_pull_deadline_s=300,
    hang_timeout_s=120,
    compile_grace_s=900,
    force_delete_grace_s=60,
    heartbeat_interval_s=30,
    transient_pull_deadline_s=900,
    node_lost_grace_s=120,
    save_timeout_s=600,
)
UNSCHEDULABLE = Condition(
    type="PodScheduled",
    status="False",
    reason="Unschedulable",
    message="0/8 nodes are available: 4 Insufficient google.com/tpu, 4 node(s) didn't match Pod's node affinity.",
    at=T0 + 1,
)


class Clocked(NamedTuple):
    """A pod or a node with the supervisor's own clock of it (``obs`` hands the clocks to the observation)."""

    thing: Any
    clock: Any  # a pod's WaitClock of its pull or creation failure; when a node was first seen lost


def _pod(
    i: int,
    *,
    phase: str,
    node: str | None = None,
    created_at: float = T0 + 1,
    conditions=(),
    running_since: float | None = None,
    exit_code: int | None = None,
    terminated_reason: str | None = None,
    finished_at: float | None = None,
    deletion_timestamp: float | None = None,
    grace_s: float | None = None,
    waiting_reason: str | None = None,
    waiting_message: str | None = None,
) -> PodEvidence:
    """A worker pod as the snapshot holds it: its trainer container terminated, waiting or running."""
    if exit_code is not None:
        c = ContainerState(
            name="trainer",
            state="terminated",
            exit_code=exit_code,
            reason=terminated_reason,
            started_at=running_since,
            finished_at=finished_at,
        )
    elif waiting_reason is not None:
        c = ContainerState(
            name="trainer", state="waiting", waiting_reason=waiting_reason, waiting_message=waiting_message
        )
    elif running_since is not None:
        c = ContainerState(name="trainer", state="running", started_at=running_since, running_since=running_since)
    else:
        c = None
    return PodEvidence(
        name=f"run-a0-workers-0-{i}-abcde",
        worker_index=i,
        phase=phase,
        node=node,
        created_at=created_at,
        conditions=list(conditions),
        containers=[c] if c is not None else [],
        deleted_at=deletion_timestamp,
        grace_s=grace_s,
    )


def running(i: int, *, since: float = T0 + 60, **kw) -> PodEvidence:
    base = dict(
        phase="Running",
        node=f"gke-tpu-{i}",
        running_since=since,
        conditions=(Condition(type="PodScheduled", at=T0 + 2), Condition(type="Ready", at=since)),
    )
    base.update(kw)
    return _pod(i, **base)


def pending(i: int, *, waiting_since: float | None = None, waiting_cause: str = "", **kw) -> PodEvidence | Clocked:
    base = dict(phase="Pending", conditions=(UNSCHEDULABLE,))
    base.update(kw)
    pod = _pod(i, **base)
    if waiting_since is None:
        return pod
    return Clocked(pod, WaitClock(key=f"pull:{waiting_cause}", since=waiting_since, cause=waiting_cause))


def done(i: int, code: int = 0) -> PodEvidence:
    phase = "Succeeded" if code == 0 else "Failed"
    return running(i, phase=phase, exit_code=code, terminated_reason="Completed" if code == 0 else "Error")


def beat(
    i: int, step: int | None, at: float, saving: int | None = None, step_seconds: float | None = None
) -> WorkerProgress:
    first = T0 + 200 if step is not None else None
    return WorkerProgress(index=i, step=step, at=at, first_step_at=first, saving=saving, step_seconds=step_seconds)


def node(
    name: str,
    *,
    ready: bool | None = True,
    unreachable: bool = False,
    since: float | None = None,
    exists: bool = True,
    seen_lost_at: float | None = None,
    spot: bool = False,
    maintenance: str | None = None,
    ready_reason: str | None = None,
    ready_message: str | None = None,
) -> NodeEvidence | Clocked:
    """A node as the snapshot holds it (``maintenance``: the taint a reclaim puts on it); with ``seen_lost_at``, and
    the supervisor's clock of when it first saw it lost."""
    taints = [f"{UNREACHABLE_TAINT}:NoExecute"] if unreachable else []
    taints += [maintenance.removeprefix("taint ")] if maintenance else []
    n = NodeEvidence(
        name=name,
        ready=ready if exists else None,
        ready_since=since,
        ready_reason=ready_reason,
        ready_message=ready_message,
        taints=taints,
        labels={SPOT_LABEL: "true"} if spot else {},
        found=exists,
    )
    return n if seen_lost_at is None else Clocked(n, seen_lost_at)


def nodes(*lost: int, unreachable: bool = True) -> tuple[NodeEvidence, ...]:
    return tuple(
        node(f"gke-tpu-{i}", ready=None if i in lost else True, unreachable=unreachable and i in lost, since=T0 + 500)
        for i in range(HOSTS)
    )


def _unclocked(things) -> tuple[list[Any], dict[str, Any]]:
    plain, clocks = [], {}
    for t in things:
        if isinstance(t, Clocked):
            clocks[t.thing.name] = t.clock
            t = t.thing
        plain.append(t)
    return plain, clocks


def obs(
    now: float,
    pods=(),
    *,
    jobs=(),
    progress=(),
    node_list=None,
    jobset_exists=True,
    jobset_terminal_state=None,
    jobset_conditions=(),
    **kw,
) -> Observation:
    pods, waits = _unclocked(pods)
    node_list, lost_seen = _unclocked(nodes() if node_list is None else node_list)
    jobset = JobSetEvidence(
        name="run-a0", found=jobset_exists, terminal_state=jobset_terminal_state, conditions=list(jobset_conditions)
    )
    snap = ClusterSnapshot(taken_at=T0 + now, jobset=jobset, jobs=list(jobs), pods=list(pods), nodes=list(node_list))
    return Observation(
        now=T0 + now,
        expected_workers=HOSTS,
        created_at=T0,
        snapshot=snap,
        progress=tuple(progress),
        waits=waits,
        lost_seen=lost_seen,
        **kw,
    )


IMAGE = "us-docker.pkg.dev/p/ml/worker:typo"
# Kubelet >= 1.32 waiting messages (pkg/kubelet/images/image_manager.go): the back-off repeats the pull's error.
NOT_FOUND = (
    f'rpc error: code = NotFound desc = failed to pull and unpack image "{IMAGE}": failed to resolve '
    f'reference "{IMAGE}": {IMAGE}: not found'
)
BACK_OFF_NOT_FOUND = f'Back-off pulling image "{IMAGE}": ErrImagePull: {NOT_FOUND}'
UNAVAILABLE = (
    f'rpc error: code = Unknown desc = failed to pull and unpack image "{IMAGE}": failed to copy: '
    "httpReadSeeker: failed open: unexpected status code https://us-docker.pkg.dev/v2/p/ml/worker/blobs/"
    "sha256:9f2c: 503 Service Unavailable"
)
BACK_OFF_UNAVAILABLE = f'Back-off pulling image "{IMAGE}": ErrImagePull: {UNAVAILABLE}'


def shutting_down(i: int, since: float, **kw) -> NodeEvidence:
    """The node as the kubelet reports it once a graceful shutdown starts (pkg/kubelet/nodeshutdown)."""
    return node(
        f"gke-tpu-{i}",
        ready=False,
        since=since,
        ready_reason="KubeletNotReady",
        ready_message="node is shutting down",
        **kw,
    )


def with_node(one: NodeEvidence | Clocked) -> tuple[NodeEvidence | Clocked, ...]:
    name = one.thing.name if isinstance(one, Clocked) else one.name
    return tuple(one if n.name == name else n for n in nodes())


def pulling(i: int, reason: str, message: str, since: float, **kw) -> Clocked:
    return pending(
        i, node=f"gke-tpu-{i}", conditions=(), waiting_reason=reason, waiting_message=message, waiting_since=since, **kw
    )


def failing(since: float, *workers: int) -> tuple[HeartbeatRead, ...]:
    """The heartbeat reads of ``workers`` (default: every one) failing since ``since`` (a store outage)."""
    return tuple(
        HeartbeatRead(index=i, ok=False, since=T0 + since, error="OSError: [Errno 5] Input/output error")
        for i in workers or range(HOSTS)
    )


POD_SECURITY_REFUSAL = (
    'FailedCreate: Error creating: pods "run-a0-workers-0-3-x8k2p" is forbidden: violates PodSecurity '
    '"baseline:latest": hostPath volumes (volume "tpu-dev")'
)
QUOTA_UNKNOWN_REFUSAL = (
    'FailedCreate: Error creating: pods "run-a0-workers-0-3-q2x9z" is forbidden: status unknown for quota: '
    "tpu-quota, resources: google.com/tpu"
)

# A webhook that answers 500 for a reason of its own: no rule names it, and it does not say it passes.
UNNAMED_REFUSAL = (
    'FailedCreate: Error creating: Internal error occurred: admission plugin "PodNodeSelector" failed to complete '
    "validation in 13s"
)


def refusing(event: str) -> JobEvidence:
    """The gang's Job as the supervisor reads it while the API refuses one of its pods (its FailedCreate event)."""
    return JobEvidence(name="run-a0-workers-0", events=[event])


REFUSED = "the pods watch: MaxRetryError: HTTPSConnectionPool(host='10.0.0.1', port=443): Connection refused"


def view_down(since: float) -> ReadState:
    """The cluster view failing since ``since`` (an API server restarting: its watches and node reads refused)."""
    return ReadState(ok=False, since=T0 + since, error=REFUSED)


def view_back(since: float) -> ReadState:
    """The cluster view current again since ``since``, after failed observations."""
    return ReadState(ok=True, since=T0 + since)


def recovered(since: float) -> tuple[HeartbeatRead, ...]:
    """Every worker's heartbeat readable again since ``since``, after failed reads."""
    return tuple(HeartbeatRead(index=i, ok=True, since=T0 + since) for i in range(HOSTS))


ALL_RUNNING = [running(i) for i in range(HOSTS)]
STEPPING = [beat(i, 40, T0 + 500) for i in range(HOSTS)]
FAILURE_TARGET = JobEvidence(
    name="run-a0-workers-0",
    conditions=(
        Condition(
            type="FailureTarget",
            reason="PodFailurePolicy",
            message="Container trainer for pod default/run-a0-workers-0-3 failed with exit code 20 "
            "matching FailJob rule at index 3",
        ),
    ),
)

# (id, observation, expected state, expected stall kind, a fragment the reason must contain)
CASES = [
    ("all-running-stepping", obs(510, ALL_RUNNING, progress=STEPPING), AttemptOutcome.RUNNING, None, "step 40"),
    (
        "slow-start-within-deadlines",
        obs(
            590,
            [
                running(0),
                running(1),
                pending(2),
                pending(
                    3,
                    node="gke-tpu-3",
                    conditions=(),
                    waiting_reason="ErrImagePull",
                    waiting_since=T0 + 400,
                    waiting_message="rpc error: code = Unknown desc = failed to pull",
                ),
            ],
        ),
        AttemptOutcome.RUNNING,
        None,
        "scheduled 3/4",
    ),
    (
        "compiling-within-grace",
        obs(900, ALL_RUNNING, progress=[beat(i, None, T0 + 890) for i in range(HOSTS)]),
        AttemptOutcome.RUNNING,
        None,
        "running 4/4",
    ),
    ("heartbeat-just-within-timeout", obs(619, ALL_RUNNING, progress=STEPPING), AttemptOutcome.RUNNING, None, ""),
    ("every-pod-succeeded", obs(900, [done(i) for i in range(HOSTS)]), AttemptOutcome.SUCCEEDED, None, "4/4"),
    (
        "jobset-completed",
        obs(900, [done(i) for i in range(HOSTS)], jobset_terminal_state="Completed"),
        AttemptOutcome.SUCCEEDED,
        None,
        "completed",
    ),
    (
        "partial-completion-one-failed",
        obs(900, [done(0), done(1), done(2), done(3, code=42)]),
        AttemptOutcome.FAILED,
        None,
        "worker 3 failed (exit code 42",
    ),
    (
        "ordinary-failure-jobset-failed",
        obs(
            900,
            [done(0, 143), done(1, 143), done(2, 143), done(3, 20)],
            jobset_terminal_state="Failed",
            jobset_conditions=(
                Condition(type="Failed", reason="FailedJobs", message="jobset failed due to one or more job failures"),
            ),
        ),
        AttemptOutcome.FAILED,
        None,
        "FailedJobs",
    ),
    (
        # A supervisor slower than the controllers sees the JobSet failed in the view that first holds the failed
        # worker (its peer's pod already deleted by the Job controller): the worker is named all the same.
        "jobset-failed-in-the-view-that-first-shows-its-failed-worker",
        obs(
            900,
            [done(1, 137)],
            jobset_terminal_state="Failed",
            jobset_conditions=(Condition(type="Failed", reason="FailedJobs", message="one or more job failures"),),
        ),
        AttemptOutcome.FAILED,
        None,
        "worker 1 failed (exit code 137, SIGKILL); JobSet failed: FailedJobs",
    ),
    (
        "failure-target-with-pod-terminating-on-unreachable-node",
        obs(
            700,
            [
                running(0, deletion_timestamp=T0 + 650),
                running(1, deletion_timestamp=T0 + 650),
                running(2, deletion_timestamp=T0 + 650),
                running(3, deletion_timestamp=T0 + 650),
            ],
            jobs=[FAILURE_TARGET],
            node_list=nodes(3),
        ),
        AttemptOutcome.FAILED,
        None,
        "FailureTarget",
    ),
    (
        "failed-pod-and-the-jobs-verdict-name-the-worker-first",
        obs(
            640,
            [
                *ALL_RUNNING[:3],
                running(3, phase="Failed", exit_code=20, terminated_reason="Error", finished_at=T0 + 630),
            ],
            jobs=[FAILURE_TARGET],
            progress=STEPPING,
        ),
        AttemptOutcome.FAILED,
        None,
        "worker 3 failed (exit code 20); Job run-a0-workers-0 FailureTarget: PodFailurePolicy: Container trainer",
    ),
    (
        "node-unreachable-no-job-verdict",
        obs(700, ALL_RUNNING, progress=STEPPING, node_list=nodes(2)),
        AttemptOutcome.STALLED,
        StallKind.NODE_LOST,
        "node gke-tpu-2 is unreachable",
    ),
    (
        "node-object-deleted",
        obs(
            700,
            ALL_RUNNING,
            progress=STEPPING,
            node_list=tuple(
                n if n.name != "gke-tpu-1" else node("gke-tpu-1", exists=False, seen_lost_at=T0 + 550) for n in nodes()
            ),
        ),
        AttemptOutcome.STALLED,
        StallKind.NODE_LOST,
        "gone",
    ),
    (
        "pod-stuck-terminating-past-grace",
        obs(700, [*ALL_RUNNING[:3], running(3, deletion_timestamp=T0 + 630)], progress=STEPPING),
        AttemptOutcome.STALLED,
        StallKind.NODE_LOST,
        "Terminating for 70 s",
    ),
    (
        # Deleted with a 30 s grace on a Ready node: its kubelet has until 60 + 30 s to end it (a save in progress).
        "pod-terminating-within-its-own-grace-on-a-ready-node",
        obs(
            700,
            [*ALL_RUNNING[:3], running(3, deletion_timestamp=T0 + 630, grace_s=30)],
            progress=[beat(i, 44, T0 + 690) for i in range(HOSTS)],
        ),
        AttemptOutcome.RUNNING,
        None,
        "",
    ),
    (
        "pod-stuck-terminating-past-its-own-grace",
        obs(700, [*ALL_RUNNING[:3], running(3, deletion_timestamp=T0 + 600, grace_s=30)], progress=STEPPING),
        AttemptOutcome.STALLED,
        StallKind.NODE_LOST,
        "Terminating for 100 s (grace 90 s)",
    ),
    (
        # Steps of at most 2 s (heartbeat interval 30 s): 30 + 20 x 2 = 70 s of silence is a stuck step, within
        # the 120 s hang timeout.
        "stuck-step-caught-within-a-multiple-of-its-own-time",
        obs(700, ALL_RUNNING, progress=[beat(i, 44, T0 + 620, step_seconds=2.0) for i in range(HOSTS)]),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "no progress past step 44 for 80 s (stuck-step limit 70 s: 20 times its longest recent step of 2.0 s plus",
    ),
    (
        "a-step-within-its-multiple-is-not-stuck",
        obs(700, ALL_RUNNING, progress=[beat(i, 44, T0 + 640, step_seconds=2.0) for i in range(HOSTS)]),
        AttemptOutcome.RUNNING,
        None,
        "",
    ),
    (
        # Steps of 0.1 s: 30 + 20 x 0.1 = 32 s, but never under 60 s (a busy host stalls one step for seconds).
        "a-fast-loop-s-stuck-step-limit-has-a-floor",
        obs(700, ALL_RUNNING, progress=[beat(i, 44, T0 + 645, step_seconds=0.1) for i in range(HOSTS)]),
        AttemptOutcome.RUNNING,
        None,
        "",
    ),
    (
        "a-fast-loop-stuck-past-the-floor",
        obs(700, ALL_RUNNING, progress=[beat(i, 44, T0 + 635, step_seconds=0.1) for i in range(HOSTS)]),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "for 65 s (stuck-step limit 60 s: 20 times its longest recent step of 0.1 s",
    ),
    (
        # Slow steps: the multiple passes the hang timeout, which then applies.
        "slow-steps-keep-the-hang-timeout",
        obs(700, ALL_RUNNING, progress=[beat(i, 44, T0 + 100, step_seconds=40.0) for i in range(HOSTS)]),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "no progress past step 44 for 600 s (hang timeout 120 s)",
    ),
    (
        "stuck-pending-no-tpu",
        obs(620, [running(0), running(1), running(2), pending(3)]),
        AttemptOutcome.STALLED,
        StallKind.CAPACITY,
        "Insufficient google.com/tpu",
    ),
    (
        "stuck-pending-whose-status-has-no-phase-yet",
        obs(620, [running(0), running(1), running(2), pending(3, phase=None)]),
        AttemptOutcome.STALLED,
        StallKind.CAPACITY,
        "Insufficient google.com/tpu",
    ),
    (
        "too-few-pods-created",
        obs(620, [running(0), running(1), running(2)]),
        AttemptOutcome.STALLED,
        StallKind.CAPACITY,
        "only 3/4",
    ),
    (
        "image-pull-backoff-past-deadline",
        obs(
            420,
            [
                running(0),
                running(1),
                running(2),
                pending(
                    3,
                    node="gke-tpu-3",
                    conditions=(),
                    waiting_reason="ImagePullBackOff",
                    waiting_since=T0 + 110,
                    waiting_message=BACK_OFF_NOT_FOUND,
                ),
            ],
        ),
        AttemptOutcome.STALLED,
        StallKind.CONFIGURATION,
        "ImagePullBackOff for 310 s (deadline 300 s for a permanent failure)",
    ),
    (
        "invalid-image-name-at-once",
        obs(
            5,
            [
                pending(i, node=f"gke-tpu-{i}", conditions=(), waiting_reason="InvalidImageName", waiting_since=T0 + 4)
                for i in range(HOSTS)
            ],
        ),
        AttemptOutcome.STALLED,
        StallKind.CONFIGURATION,
        "InvalidImageName",
    ),
    (
        "config-issue-pod-condition",
        obs(
            30,
            [
                running(0),
                running(1),
                running(2),
                pending(
                    3,
                    conditions=(
                        Condition(type="ConfigIssue", reason="MissingSecret", message="secret gcs-key not found"),
                    ),
                ),
            ],
        ),
        AttemptOutcome.STALLED,
        StallKind.CONFIGURATION,
        "ConfigIssue: MissingSecret",
    ),
    (
        "silent-hang-after-first-step",
        obs(
            621,
            ALL_RUNNING,
            progress=[beat(0, 40, T0 + 600), beat(1, 40, T0 + 600), beat(2, 40, T0 + 600), beat(3, 38, T0 + 500)],
        ),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "worker 3: no progress past step 38 for 121 s",
    ),
    # A loop that waits for a save's commit (a store slowed by an outage) says so: the save timeout applies.
    (
        "waiting-for-a-save-longer-than-hang-timeout",
        obs(
            621,
            ALL_RUNNING,
            progress=[
                beat(0, 40, T0 + 500, saving=30),
                beat(1, 40, T0 + 500, saving=30),
                beat(2, 40, T0 + 500, saving=30),
                beat(3, 40, T0 + 500, saving=30),
            ],
        ),
        AttemptOutcome.RUNNING,
        None,
        "step 40, waiting for the save of checkpoint 30",
    ),
    (
        "waiting-for-a-save-past-save-timeout",
        obs(
            1101,
            ALL_RUNNING,
            progress=[
                beat(0, 40, T0 + 500, saving=30),
                beat(1, 40, T0 + 1090),
                beat(2, 40, T0 + 1090),
                beat(3, 40, T0 + 1090),
            ],
        ),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "worker 0: waited 601 s after step 40 for the save of checkpoint 30 to commit (save timeout 600 s)",
    ),
    # Its peers stopped in the next step's collective behind it: not hung while its wait lasts, and then it is named.
    (
        "peers-blocked-behind-a-save-within-its-timeout",
        obs(
            801,
            ALL_RUNNING,
            progress=[
                beat(0, 40, T0 + 500, saving=30),
                beat(1, 41, T0 + 620),
                beat(2, 41, T0 + 620),
                beat(3, 41, T0 + 620),
            ],
        ),
        AttemptOutcome.RUNNING,
        None,
        "waiting for the save of checkpoint 30",
    ),
    (
        "a-peer-silent-long-before-the-save-is-hung",
        obs(
            801,
            ALL_RUNNING,
            progress=[
                beat(0, 40, T0 + 700, saving=30),
                beat(1, 41, T0 + 790),
                beat(2, 41, T0 + 790),
                beat(3, 38, T0 + 400),
            ],
        ),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "worker 3: no progress past step 38 for 401 s",
    ),
    (
        "save-wait-over-then-silent-past-hang-timeout",
        obs(
            621,
            ALL_RUNNING,
            progress=[beat(0, 40, T0 + 500), beat(1, 40, T0 + 600), beat(2, 40, T0 + 600), beat(3, 40, T0 + 600)],
        ),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "worker 0: no progress past step 40 for 121 s",
    ),
    (
        "no-first-step-past-compile-grace",
        obs(961, ALL_RUNNING),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "no first step 901 s",
    ),
    # An earlier attempt of this run took 600 s to its first step (a long restore and compilation): twice that.
    (
        "no-first-step-within-twice-this-runs-earlier-start-up",
        obs(1100, ALL_RUNNING, startup_before_s=600),
        AttemptOutcome.RUNNING,
        None,
        "",
    ),
    (
        "no-first-step-past-twice-this-runs-earlier-start-up",
        obs(1261, ALL_RUNNING, startup_before_s=600),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "no first step 1201 s after every worker started (2 times this run's earlier start-up of 600 s, above the "
        "compile grace 900 s)",
    ),
    (
        "no-first-step-names-the-phase-each-heartbeat-says",
        obs(961, ALL_RUNNING, progress=[WorkerProgress(index=0, at=T0 + 300, phase="compile")]),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "worker 0: no first step 901 s after every worker started (compile grace 900 s); in compile for 661 s",
    ),
    (
        "a-short-earlier-start-up-leaves-the-compile-grace",
        obs(961, ALL_RUNNING, startup_before_s=30),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "no first step 901 s after every worker started (compile grace 900 s)",
    ),
    (
        "jobset-deleted-underneath",
        obs(500, ALL_RUNNING, jobset_exists=False),
        AttemptOutcome.FAILED,
        None,
        "deleted",
    ),
    # A node NotReady is not lost before its grace: a graceful shutdown fails the pods first.
    (
        "node-shutting-down-within-grace",
        obs(600, ALL_RUNNING, progress=STEPPING, node_list=with_node(shutting_down(2, T0 + 590, spot=True))),
        AttemptOutcome.RUNNING,
        None,
        "running 4/4",
    ),
    (
        "node-shutting-down-then-pod-failed-by-the-kubelet",
        obs(
            620,
            [*ALL_RUNNING[:2], running(2, phase="Failed", exit_code=143, terminated_reason="Error"), running(3)],
            progress=STEPPING,
            node_list=with_node(shutting_down(2, T0 + 590, spot=True)),
        ),
        AttemptOutcome.FAILED,
        None,
        "worker 2 failed (exit code 143",
    ),
    (
        # The SIGKILLed worker ended first; its peers' exit 20 (peer lost) came after: the failure is named after it.
        "first-to-end-names-the-failure",
        obs(
            640,
            [
                *ALL_RUNNING[:2],
                running(2, phase="Failed", exit_code=20, terminated_reason="Error", finished_at=T0 + 632),
                running(3, phase="Failed", exit_code=137, terminated_reason="Error", finished_at=T0 + 630),
            ],
            progress=STEPPING,
        ),
        AttemptOutcome.FAILED,
        None,
        "worker 3 failed (exit code 137, SIGKILL)",  # the signal 137 stands for, not the runtime's "Error"
    ),
    (
        # In the same second (finishedAt's step), not the one that exited on losing a peer.
        "a-tie-is-not-named-after-a-peer-lost-exit",
        obs(
            640,
            [
                running(0),
                running(1, phase="Failed", exit_code=20, terminated_reason="Error", finished_at=T0 + 630),
                running(2),
                running(3, phase="Failed", exit_code=42, terminated_reason="Error", finished_at=T0 + 630),
            ],
            progress=STEPPING,
        ),
        AttemptOutcome.FAILED,
        None,
        "worker 3 failed (exit code 42",
    ),
    (
        "node-shutting-down-then-job-failure-target",
        obs(
            620, ALL_RUNNING, jobs=[FAILURE_TARGET], progress=STEPPING, node_list=with_node(shutting_down(3, T0 + 590))
        ),
        AttemptOutcome.FAILED,
        None,
        "FailureTarget",
    ),
    (
        "node-shutting-down-past-grace-names-its-ready-message-and-labels",
        obs(
            711,
            ALL_RUNNING,
            progress=STEPPING,
            node_list=with_node(
                shutting_down(2, T0 + 590, spot=True, maintenance="taint cloud.google.com/impending-node-termination")
            ),
        ),
        AttemptOutcome.STALLED,
        StallKind.NODE_LOST,
        "node gke-tpu-2 is NotReady (KubeletNotReady: node is shutting down, Spot, taint "
        "cloud.google.com/impending-node-termination) for 121 s (grace 120 s)",
    ),
    (
        "node-not-ready-flap-back-to-ready-ends-nothing",
        obs(
            900,
            ALL_RUNNING,
            progress=[beat(i, 60, T0 + 890) for i in range(HOSTS)],
            node_list=with_node(node("gke-tpu-1", ready=True, since=T0 + 640)),
        ),
        AttemptOutcome.RUNNING,
        None,
        "step 60",
    ),
    (
        "node-gone-within-grace-from-first-seen",
        obs(
            600,
            ALL_RUNNING,
            progress=STEPPING,
            node_list=with_node(node("gke-tpu-1", exists=False, seen_lost_at=T0 + 560)),
        ),
        AttemptOutcome.RUNNING,
        None,
        "",
    ),
    (
        "node-unreachable-but-ready-counts-from-first-seen",
        obs(
            700,
            ALL_RUNNING,
            progress=[beat(i, 44, T0 + 690) for i in range(HOSTS)],
            node_list=with_node(
                node("gke-tpu-1", ready=True, unreachable=True, since=T0 - 9000, seen_lost_at=T0 + 650)
            ),
        ),
        AttemptOutcome.RUNNING,
        None,
        "",
    ),
    (
        "node-not-ready-within-grace-but-its-pod-stuck-terminating",
        obs(
            700,
            [*ALL_RUNNING[:3], running(3, deletion_timestamp=T0 + 620)],
            progress=STEPPING,
            node_list=with_node(node("gke-tpu-3", ready=None, unreachable=True, since=T0 + 650)),
        ),
        AttemptOutcome.STALLED,
        StallKind.NODE_LOST,
        "node gke-tpu-3 is unreachable for 50 s (grace 120 s); its pod Terminating for 80 s",
    ),
    # Image pulls: the clock is the current failure's (wait_clock); only a failure that cannot heal is configuration.
    (
        "transient-pull-error-past-the-permanent-deadline-keeps-waiting",
        obs(700, [*ALL_RUNNING[:3], pulling(3, "ImagePullBackOff", BACK_OFF_UNAVAILABLE, T0 + 100)]),
        AttemptOutcome.RUNNING,
        None,
        "running 3/4",
    ),
    (
        "transient-pull-error-past-its-own-deadline-is-an-image-pull-stall",
        obs(1001, [*ALL_RUNNING[:3], pulling(3, "ErrImagePull", UNAVAILABLE, T0 + 100)]),
        AttemptOutcome.STALLED,
        StallKind.IMAGE_PULL,
        "ErrImagePull for 901 s (deadline 900 s for a transient failure)",
    ),
    (
        "old-kubelet-back-off-judged-by-the-pull-error-seen-before-it",
        obs(
            420,
            [
                *ALL_RUNNING[:3],
                pulling(
                    3,
                    "ImagePullBackOff",
                    f'Back-off pulling image "{IMAGE}"',
                    T0 + 110,
                    waiting_cause=f"{IMAGE}: not found",
                ),
            ],
        ),
        AttemptOutcome.STALLED,
        StallKind.CONFIGURATION,
        "(last error: us-docker.pkg.dev/p/ml/worker:typo: not found)",
    ),
    (
        "create-container-error-timeout-is-transient",
        obs(420, [*ALL_RUNNING[:3], pulling(3, "CreateContainerError", "context deadline exceeded", T0 + 10)]),
        AttemptOutcome.RUNNING,
        None,
        "",
    ),
    (
        "missing-secret-is-configuration-after-the-deadline",
        obs(420, [*ALL_RUNNING[:3], pulling(3, "CreateContainerConfigError", 'secret "wandb" not found', T0 + 110)]),
        AttemptOutcome.STALLED,
        StallKind.CONFIGURATION,
        "CreateContainerConfigError for 310 s",
    ),
    # A read that failed is never evidence of absence; the hang clocks pause while the store cannot be read.
    (
        "reattached-to-a-gang-of-days-whose-first-heartbeat-reads-fail",
        obs(3 * 86400, ALL_RUNNING, reads=failing(3 * 86400)),
        AttemptOutcome.RUNNING,
        None,
        "heartbeats unreadable: worker 0, 1, 2, 3",
    ),
    (
        "reattached-one-heartbeat-unreadable-the-others-stepping",
        obs(
            3 * 86400,
            ALL_RUNNING,
            progress=[beat(i, 40, T0 + 3 * 86400 - 5) for i in (0, 1, 2)],
            reads=failing(3 * 86400, 3),
        ),
        AttemptOutcome.RUNNING,
        None,
        "heartbeats unreadable: worker 3",
    ),
    (
        "store-outage-longer-than-hang-timeout-after-good-beats",
        obs(500 + 10 * 120, ALL_RUNNING, progress=STEPPING, reads=failing(510)),
        AttemptOutcome.RUNNING,
        None,
        "heartbeats unreadable",
    ),
    (
        "heartbeats-readable-again-for-less-than-hang-timeout",
        obs(2119, ALL_RUNNING, progress=STEPPING, reads=recovered(2000)),
        AttemptOutcome.RUNNING,
        None,
        "step 40",
    ),
    (
        "silent-for-hang-timeout-once-heartbeats-read-again",
        obs(2120, ALL_RUNNING, progress=STEPPING, reads=recovered(2000)),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "worker 0: no progress past step 40 for 1620 s",
    ),
    (
        "store-outage-then-a-worker-fails",
        obs(2000, [*ALL_RUNNING[:3], done(3, code=20)], progress=STEPPING, reads=failing(510)),
        AttemptOutcome.FAILED,
        None,
        "worker 3 failed (exit code 20",
    ),
    (
        "store-outage-then-a-node-lost-past-its-grace",
        obs(2000, ALL_RUNNING, progress=STEPPING, reads=failing(510), node_list=nodes(2)),
        AttemptOutcome.STALLED,
        StallKind.NODE_LOST,
        "worker 2: node gke-tpu-2 is unreachable",
    ),
    # The API refusing a worker pod by a policy no retry gets past: the Job says so at once, the attempt ends then.
    (
        "pod-security-refuses-a-worker-pod-ends-at-once",
        obs(12, [running(0), running(1), running(2)], jobs=[refusing(POD_SECURITY_REFUSAL)]),
        AttemptOutcome.STALLED,
        StallKind.CONFIGURATION,
        "Job run-a0-workers-0 could not create its worker pods: the namespace's Pod Security admission",
    ),
    (
        "a-refusal-the-next-try-gets-past-waits-for-the-start-up-deadline",
        obs(12, [running(0), running(1), running(2)], jobs=[refusing(QUOTA_UNKNOWN_REFUSAL)]),
        AttemptOutcome.RUNNING,
        None,
        "scheduled 3/4",
    ),
    (
        "a-refusal-no-rule-names-waits-for-the-start-up-deadline",
        obs(590, [running(0), running(1), running(2)], jobs=[refusing(UNNAMED_REFUSAL)]),
        AttemptOutcome.RUNNING,
        None,
        "scheduled 3/4",
    ),
    (
        "pods-missing-past-the-deadline-with-a-refusal-no-rule-names-are-refused-not-capacity",
        obs(610, [running(0), running(1), running(2)], jobs=[refusing(UNNAMED_REFUSAL)]),
        AttemptOutcome.STALLED,
        StallKind.REFUSED,
        "Job run-a0-workers-0 says the API refused them: Error creating: Internal error occurred: admission plugin",
    ),
    (
        "pods-missing-past-the-deadline-after-a-transient-refusal-are-capacity",
        obs(610, [running(0), running(1), running(2)], jobs=[refusing(QUOTA_UNKNOWN_REFUSAL)]),
        AttemptOutcome.STALLED,
        StallKind.CAPACITY,
        "only 3/4 worker pods exist after 610 s",
    ),
    (
        "an-old-refusal-of-a-gang-now-whole-ends-nothing",
        obs(600, ALL_RUNNING, jobs=[refusing(POD_SECURITY_REFUSAL)], progress=STEPPING),
        AttemptOutcome.RUNNING,
        None,
        "running 4/4",
    ),
    # A view of the cluster that cannot be refreshed is an old view: only its terminal facts end the attempt, and
    # every stall clock counts from when it is current again (a Job controller down with the API creates pods late).
    (
        "api-outage-too-few-pods-no-verdict-while-the-view-fails",
        obs(620, [running(0), running(1), running(2)], view=view_down(500)),
        AttemptOutcome.RUNNING,
        None,
        "the cluster view is not current for 120 s (the pods watch: MaxRetryError",
    ),
    (
        "api-outage-over-too-few-pods-counted-from-the-view-current-again",
        obs(620, [running(0), running(1), running(2)], view=view_back(560)),
        AttemptOutcome.RUNNING,
        None,
        "scheduled 3/4",
    ),
    (
        "api-outage-over-too-few-pods-past-the-deadline-counted-from-then",
        obs(1160, [running(0), running(1), running(2)], view=view_back(560)),
        AttemptOutcome.STALLED,
        StallKind.CAPACITY,
        "only 3/4 worker pods exist after 600 s",
    ),
    (
        "api-outage-unschedulable-counted-from-the-view-current-again",
        obs(620, [running(0), running(1), running(2), pending(3)], view=view_back(560)),
        AttemptOutcome.RUNNING,
        None,
        "scheduled 3/4",
    ),
    (
        "api-outage-node-lost-no-verdict-while-the-view-fails",
        obs(700, ALL_RUNNING, progress=STEPPING, node_list=nodes(2), view=view_down(510)),
        AttemptOutcome.RUNNING,
        None,
        "no stall is judged on it",
    ),
    (
        "api-outage-over-node-lost-grace-counted-from-then",
        obs(700, ALL_RUNNING, progress=STEPPING, node_list=nodes(2), view=view_back(650)),
        AttemptOutcome.RUNNING,
        None,
        "running 4/4",
    ),
    (
        "api-outage-over-node-lost-past-its-grace-counted-from-then",
        obs(770, ALL_RUNNING, progress=STEPPING, node_list=nodes(2), view=view_back(650)),
        AttemptOutcome.STALLED,
        StallKind.NODE_LOST,
        "node gke-tpu-2 is unreachable for 120 s",
    ),
    (
        "api-outage-image-pull-no-verdict-while-the-view-fails",
        obs(420, [*ALL_RUNNING[:3], pulling(3, "ImagePullBackOff", BACK_OFF_NOT_FOUND, T0 + 10)], view=view_down(400)),
        AttemptOutcome.RUNNING,
        None,
        "not current",
    ),
    (
        "api-outage-no-hang-while-the-view-fails",
        obs(2000, ALL_RUNNING, progress=STEPPING, view=view_down(600)),
        AttemptOutcome.RUNNING,
        None,
        "not current for 1400 s",
    ),
    (
        "api-outage-over-hang-counted-from-then",
        obs(2110, ALL_RUNNING, progress=STEPPING, view=view_back(2000)),
        AttemptOutcome.RUNNING,
        None,
        "step 40",
    ),
    (
        "api-outage-a-failed-pod-still-ends-the-attempt",
        obs(700, [*ALL_RUNNING[:3], done(3, code=20)], progress=STEPPING, view=view_down(600)),
        AttemptOutcome.FAILED,
        None,
        "worker 3 failed (exit code 20",
    ),
    (
        "api-outage-the-jobs-failure-target-still-ends-the-attempt",
        obs(700, ALL_RUNNING, jobs=[FAILURE_TARGET], progress=STEPPING, view=view_down(600)),
        AttemptOutcome.FAILED,
        None,
        "FailureTarget",
    ),
    (
        "api-outage-every-worker-succeeded-still-ends-the-attempt",
        obs(700, [done(i) for i in range(HOSTS)], view=view_down(600)),
        AttemptOutcome.SUCCEEDED,
        None,
        "",
    ),
    (
        "reattached-heartbeat-read-and-absent-past-compile-grace",
        obs(3 * 86400, ALL_RUNNING, reads=recovered(1000)),
        AttemptOutcome.STALLED,
        StallKind.HANG,
        "worker 0: no first step",
    ),
]


@pytest.mark.parametrize(("case", "observation", "state", "kind", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_decide(case, observation, state, kind, fragment):
    v = decide(observation, D)
    assert (v.state, v.kind) == (state, kind), v.reason
    assert fragment in v.reason
    if named := re.match(r"worker (\d+) failed", fragment):  # a failed worker's verdict names it
        assert v.worker == int(named[1]), v
    assert v.over is (state != AttemptOutcome.RUNNING)


def test_pods_not_created_yet_get_a_restarting_controllers_time_whatever_a_short_start_up_deadline_says():
    """A rehearsal's 6 s start-up deadline is no verdict on pods no controller has created yet (kube-controller-manager
    restarting waits out its leader lease): they get MISSING_PODS_GRACE_S; an unschedulable pod keeps the deadline."""
    from recovery_steps.supervision import MISSING_PODS_GRACE_S

    short = D.model_copy(update={"startup_deadline_s": 6})
    three = [running(0), running(1), running(2)]
    assert decide(obs(30, three), short).state == AttemptOutcome.RUNNING
    late = decide(obs(MISSING_PODS_GRACE_S + 1, three), short)
    assert (late.state, late.kind) == (AttemptOutcome.STALLED, StallKind.CAPACITY), late.reason
    assert f"deadline {MISSING_PODS_GRACE_S:g} s" in late.reason
    stuck = decide(obs(30, [*three, pending(3)]), short)
    assert (stuck.state, stuck.kind) == (AttemptOutcome.STALLED, StallKind.CAPACITY), stuck.reason


def test_a_jobset_no_controller_has_acted_on_is_no_stall_and_its_jobs_pods_count_from_the_job():
    """Neither Job nor pod, long past every deadline: the JobSet controller has not acted (it was restarting), which
    says nothing of capacity; once it creates the Job, the missing pods' grace counts from the Job's creation."""
    from recovery_steps.supervision import MISSING_PODS_GRACE_S

    idle = decide(obs(900), D)
    assert idle.state == AttemptOutcome.RUNNING and "the JobSet controller has not acted on it yet" in idle.reason
    late_job = JobEvidence(name="run-a0-workers-0", created_at=T0 + 890)
    assert decide(obs(900, jobs=[late_job]), D).state == AttemptOutcome.RUNNING
    after = max(D.startup_deadline_s, MISSING_PODS_GRACE_S) + 1
    stalled = decide(obs(890 + after, jobs=[late_job]), D)
    assert (stalled.state, stalled.kind) == (AttemptOutcome.STALLED, StallKind.CAPACITY), stalled.reason
    assert "only 0/4 worker pods exist" in stalled.reason
    # A Job with no creation time: the pods' grace counts from the JobSet's.
    assert decide(obs(900, jobs=[JobEvidence(name="old")]), D).kind == StallKind.CAPACITY


def test_table_is_large_enough_and_covers_every_state_and_kind():
    assert len(CASES) >= 15
    assert {c[2] for c in CASES} == set(AttemptOutcome.VERDICT_STATES)
    assert {c[3] for c in CASES} - {None} == set(StallKind)


@pytest.mark.parametrize("outcome", [o.value for o in AttemptOutcome])
def test_a_verdict_holds_only_running_or_a_supervisors_verdict(outcome):
    # "error" (a supervisor that could not supervise) and "stopped" (the exit handler's) are no verdict's state.
    if outcome in AttemptOutcome.VERDICT_STATES:
        assert Verdict(state=outcome, reason="r").state is AttemptOutcome(outcome)
        return
    with pytest.raises(ValidationError) as e:
        Verdict(state=outcome, reason="r")
    assert [err["loc"] for err in e.value.errors()] == [("state",)]


def test_hang_timeout_below_two_heartbeats_is_one_line_naming_both_fields():
    data = {
        "run_id": "r",
        "image": "i",
        "slice": {"accelerator": "local", "hosts": 2},
        "storage": {"root": "/tmp/x"},
        "supervision": {"hang_timeout_s": 10, "heartbeat_interval_s": 8},
    }
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    (line,) = e.value.problems
    assert line.startswith("supervision.hang_timeout_s: 10 is less than twice supervision.heartbeat_interval_s")


def test_read_clock_keeps_an_outages_start_and_starts_again_when_reads_succeed():
    assert read_clock(None, 2, None, T0) is None  # every read succeeded: nothing to keep
    down = read_clock(None, 2, "OSError: timeout", T0 + 10)
    assert (down.index, down.ok, down.since) == (2, False, T0 + 10)
    still = read_clock(down, 2, "DocumentError: extra field", T0 + 20)
    assert (still.ok, still.since, still.error) == (False, T0 + 10, "DocumentError: extra field")
    up = read_clock(still, 2, None, T0 + 30)
    assert (up.ok, up.since) == (True, T0 + 30) and read_clock(up, 2, None, T0 + 40) == up
    assert read_clock(up, 2, "OSError: timeout", T0 + 50).since == T0 + 50


def test_view_clock_keeps_an_outages_start_and_starts_again_when_the_view_is_current():
    assert view_clock(None, None, T0) is None  # every observation was current: nothing to keep
    down = view_clock(None, REFUSED, T0 + 10)
    assert (down.ok, down.since, down.error) == (False, T0 + 10, REFUSED)
    still = view_clock(down, "node gke-tpu-1: ReadTimeoutError", T0 + 20)
    assert (still.ok, still.since, still.error) == (False, T0 + 10, "node gke-tpu-1: ReadTimeoutError")
    up = view_clock(still, None, T0 + 30)
    assert (up.ok, up.since) == (True, T0 + 30) and view_clock(up, None, T0 + 40) == up
    assert view_clock(up, REFUSED, T0 + 50).since == T0 + 50


TIMEOUT = "dial tcp 142.250.1.1:443: i/o timeout"
# (id, the container's waiting states in turn as (reason, message, now), the clock's start after each; None: no clock)
CLOCKS = [
    (
        "one-transient-error-then-a-slow-pull-one-clock-until-the-container-starts",
        [
            ("ErrImagePull", UNAVAILABLE, 10),
            ("ImagePullBackOff", BACK_OFF_UNAVAILABLE, 20),
            ("ImagePullBackOff", BACK_OFF_UNAVAILABLE, 400),
            (None, None, 800),
        ],
        [10, 10, 10, None],
    ),
    (
        "another-failure-restarts-the-clock",
        [
            ("ErrImagePull", UNAVAILABLE, 10),
            ("ErrImagePull", TIMEOUT, 50),
            ("ImagePullBackOff", BACK_OFF_NOT_FOUND, 90),
            ("ErrImagePull", NOT_FOUND, 120),
        ],
        [10, 50, 90, 90],
    ),
    (
        "addresses-that-change-between-tries-are-the-same-failure",
        [("ErrImagePull", TIMEOUT, 10), ("ErrImagePull", TIMEOUT.replace("142.250.1.1", "142.250.9.77"), 70)],
        [10, 10],
    ),
    (
        "an-old-kubelets-back-off-is-the-back-off-of-the-pull-error-before-it",
        [
            ("ErrImagePull", NOT_FOUND, 5),
            ("ImagePullBackOff", f'Back-off pulling image "{IMAGE}"', 15),
            ("ErrImagePull", NOT_FOUND, 40),
        ],
        [5, 5, 5],
    ),
    (
        "not-waiting-on-a-failure-in-between-starts-over",
        [("ErrImagePull", UNAVAILABLE, 10), ("ContainerCreating", None, 30), ("ErrImagePull", UNAVAILABLE, 60)],
        [10, None, 60],
    ),
    (
        "a-creation-failure-after-a-pull-failure-is-another-failure",
        [
            ("ErrImagePull", UNAVAILABLE, 10),
            ("CreateContainerError", "context deadline exceeded", 300),
            ("CreateContainerError", "context deadline exceeded", 500),
        ],
        [10, 300, 300],
    ),
]


@pytest.mark.parametrize(("case", "states", "starts"), CLOCKS, ids=[c[0] for c in CLOCKS])
def test_wait_clock(case, states, starts):
    clock: WaitClock | None = None
    seen = []
    for reason, message, now in states:
        clock = wait_clock(clock, reason, message, T0 + now)
        seen.append(None if clock is None else clock.since - T0)
    assert seen == starts


def test_an_old_kubelets_back_off_keeps_the_cause_and_decide_uses_it():
    clock = wait_clock(None, "ErrImagePull", NOT_FOUND, T0)
    clock = wait_clock(clock, "ImagePullBackOff", f'Back-off pulling image "{IMAGE}"', T0 + 10)
    assert clock is not None and clock.cause == NOT_FOUND
    pod = pulling(3, "ImagePullBackOff", f'Back-off pulling image "{IMAGE}"', clock.since, waiting_cause=clock.cause)
    v = decide(obs(301, [*ALL_RUNNING[:3], pod]), D)
    assert (v.state, v.kind) == (AttemptOutcome.STALLED, StallKind.CONFIGURATION), v.reason


@pytest.mark.parametrize(
    ("reason", "message", "cause"),
    [
        ("ImagePullBackOff", BACK_OFF_NOT_FOUND, NOT_FOUND),
        ("ErrImagePull", NOT_FOUND, NOT_FOUND),
        ("ImagePullBackOff", f'Back-off pulling image "{IMAGE}"', ""),
        (
            "ImagePullBackOff",
            f'Back-off pulling image "{IMAGE}": RegistryUnavailable: image pull failed for {IMAGE} '
            "because the registry is unavailable",
            f"image pull failed for {IMAGE} because the registry is unavailable",
        ),
        (
            "RegistryUnavailable",
            f"image pull failed for {IMAGE} because the registry is unavailable",
            f"image pull failed for {IMAGE} because the registry is unavailable",
        ),
        ("CreateContainerError", "context deadline exceeded", "context deadline exceeded"),
        ("ErrImagePull", None, ""),
    ],
)
def test_waiting_cause_is_the_same_for_a_pull_error_and_its_back_off(reason, message, cause):
    assert waiting_cause(reason, message) == cause


@pytest.mark.parametrize(
    ("reason", "cause", "permanent"),
    [
        ("ErrImagePull", NOT_FOUND, True),
        ("ErrImagePull", 'manifest unknown: Failed to fetch "typo"', True),
        (
            "ErrImagePull",
            "failed to authorize: failed to fetch oauth token: unexpected status: 401 Unauthorized",
            False,
        ),
        (
            "ErrImagePull",
            'denied: Permission "artifactregistry.repositories.downloadArtifacts" denied on resource',
            True,
        ),
        ("ErrImagePull", "unexpected status from HEAD request to https://us-docker.pkg.dev/v2/: 403 Forbidden", True),
        ("InvalidImageName", 'couldn\'t parse image reference "Worker:1": invalid reference format', True),
        ("ErrImageNeverPull", 'Container image "w:1" is not present with pull policy of Never', True),
        ("CreateContainerConfigError", 'configmap "trainer-env" not found', True),
        ("SignatureValidationFailed", "image pull failed for w:1 because the signature validation failed", True),
        ("ErrImagePull", UNAVAILABLE, False),
        ("ErrImagePull", TIMEOUT, False),
        ("ErrImagePull", "read tcp 10.0.0.2:51234->142.250.1.1:443: read: connection reset by peer", False),
        ("ImagePullBackOff", "", False),
        ("RegistryUnavailable", "image pull failed for w:1 because the registry is unavailable", False),
        ("CreateContainerError", "context deadline exceeded", False),
    ],
)
def test_only_a_failure_waiting_cannot_heal_is_permanent(reason, cause, permanent):
    assert pull_failure_is_permanent(reason, cause) is permanent


EXPIRED = (
    'failed to pull and unpack image "us-docker.pkg.dev/p/ml/worker:1": failed to copy: httpReadSeeker: failed '
    "open: unexpected status code https://us-docker.pkg.dev/v2/p/ml/worker/blobs/sha256:6bd5: 401 Unauthorized - "
    "Server message: unauthorized: not authenticated: No valid credential was supplied."
)


@pytest.mark.parametrize(
    ("cause", "credentials"),
    [
        (EXPIRED, True),
        ("failed to authorize: failed to fetch oauth token: unexpected status: 401 Unauthorized", True),
        ('denied: Permission "artifactregistry.repositories.downloadArtifacts" denied on resource', False),
        ("unexpected status from HEAD request to https://us-docker.pkg.dev/v2/: 403 Forbidden", False),
        (UNAVAILABLE, False),
    ],
)
def test_a_401_is_a_credentials_failure_a_403_a_permanent_one(cause, credentials):
    assert pull_failure_is_credentials("ErrImagePull", cause) is credentials


@pytest.mark.parametrize(
    ("waited", "state", "kind"),
    [(310, AttemptOutcome.RUNNING, None), (900, AttemptOutcome.STALLED, StallKind.CONFIGURATION)],
)
def test_an_expired_pull_token_is_waited_on_for_its_refresh_then_is_missing_credentials(waited, state, kind):
    """A 401 may be a token the kubelet refreshes on its next try: not configuration at the permanent deadline;
    one that outlives the transient deadline is missing credentials, configuration."""
    pod = pulling(3, "ErrImagePull", EXPIRED, T0 + 10)
    v = decide(obs(10 + waited, [*ALL_RUNNING[:3], pod]), D)
    assert (v.state, v.kind) == (state, kind), v.reason
    if kind is not None:
        assert "deadline 900 s for a credentials failure" in v.reason, v.reason


def _api_job(*conditions: dict) -> JobEvidence:
    """A JobSet's Job as the API returns it (batch/v1), through the snapshot's record."""
    from jaxrec.model.snapshot import job_from_api

    return job_from_api(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": "run-a0-workers-0",
                "namespace": "default",
                "labels": {"jobset.sigs.k8s.io/jobset-name": "run-a0"},
            },
            "status": {"active": 4, "failed": 1, "terminating": 3, "conditions": list(conditions)},
        }
    )


# The Job controller's FailureTarget before Failed (kubernetes pkg/controller/job/job_controller.go, >= 1.31).
BACKOFF_TARGET = {
    "type": "FailureTarget",
    "status": "True",
    "reason": "BackoffLimitExceeded",
    "message": "Job has reached the specified backoff limit",
    "lastProbeTime": "2024-05-01T10:10:00Z",
    "lastTransitionTime": "2024-05-01T10:10:00Z",
}

# A record the supervisor wrote before it kept the conditions: its failure is the record's own.
RECORD_ONLY = JobEvidence(
    name="run-a0-workers-0",
    failed=True,
    failure_reason="PodFailurePolicy",
    failure_message="Container trainer for pod default/run-a0-workers-0-1-abcde failed with "
    "exit code 42 matching FailJob rule at index 0",
)


@pytest.mark.parametrize(
    ("job", "state", "fragment"),
    [
        (_api_job(BACKOFF_TARGET), AttemptOutcome.FAILED, "FailureTarget: BackoffLimitExceeded: Job has reached"),
        (_api_job({**BACKOFF_TARGET, "status": "False"}), AttemptOutcome.RUNNING, "running 4/4"),
        (RECORD_ONLY, AttemptOutcome.FAILED, "PodFailurePolicy: Container trainer"),
    ],
    ids=["failure-target-backoff-limit", "failure-target-not-true", "record-without-conditions"],
)
def test_a_job_at_failure_target_fails_the_attempt_before_its_jobset_does(job, state, fragment):
    """The JobSet has no condition yet and every pod still runs: the Job's record alone decides."""
    v = decide(obs(520, ALL_RUNNING, jobs=[job], progress=STEPPING), D)
    assert v.state is state and fragment in v.reason, v.reason


@pytest.mark.parametrize(
    ("failures", "want"),
    [
        # (name, end, index, rank, named by its Job)
        ([("a", 10.9, 1, 0, False), ("b", 11.0, 0, 0, False)], "a"),  # the first by the second
        ([("peer", 10.2, 0, 1, False), ("cause", 10.8, 1, 0, False)], "cause"),  # one second: cause first
        ([("x", 10.5, 1, 0, False), ("job", 10.7, 2, 0, True)], "job"),  # then the one its Job names
        ([("late", 10.6, 0, 0, False), ("early", 10.1, 3, 0, False)], "early"),  # then the finer clock
        ([("i2", 10.0, 2, 0, False), ("i1", 10.0, 1, 0, False)], "i1"),  # then the lowest index
        ([("unknown", None, 0, 0, False), ("known", 99.0, 5, 3, False)], "known"),  # an end not known: last
    ],
)
def test_the_first_failure_is_one_rule_for_the_supervisor_and_classify(failures, want):
    got = first_failed(failures, ended=lambda f: f[1], index=lambda f: f[2], rank=lambda f: f[3], named=lambda f: f[4])
    assert got[0] == want


def test_startup_seconds_is_every_worker_running_to_every_first_step_or_unknown():
    from jaxrec.model.records import SupervisionRecord, WorkerSupervision

    def rec(*workers):
        return SupervisionRecord(
            attempt=0, jobset="js", outcome="failed", reason="r", detected_at=T0 + 900, workers=list(workers)
        )

    a = WorkerSupervision(index=0, started_at=T0 + 60, first_step_at=T0 + 400)
    b = WorkerSupervision(index=1, started_at=T0 + 90, first_step_at=T0 + 410)
    assert startup_seconds(rec(a, b)) == 320  # from the last to start to the last first step
    assert startup_seconds(rec(a, WorkerSupervision(index=1, started_at=T0 + 90))) is None  # one never stepped
    assert startup_seconds(rec()) is None
