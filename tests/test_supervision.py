"""A table of attempts as the supervisor observes them, and the state each is in (the pure decision)."""

from __future__ import annotations

import pytest

from recovery_steps.kernel.config import ConfigError, SupervisionConfig, parse_config
from recovery_steps.supervision import (
    AttemptState,
    JobObservation,
    NodeObservation,
    Observation,
    PodCondition,
    PodObservation,
    StallKind,
    WorkerProgress,
    decide,
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
)
UNSCHEDULABLE = PodCondition(
    type="PodScheduled",
    status="False",
    reason="Unschedulable",
    message="0/8 nodes are available: 4 Insufficient google.com/tpu, 4 node(s) didn't match Pod's node affinity.",
    since=T0 + 1,
)


def running(i: int, *, since: float = T0 + 60, **kw) -> PodObservation:
    base = dict(
        name=f"run-a0-workers-0-{i}-abcde",
        index=i,
        phase="Running",
        node=f"gke-tpu-{i}",
        created_at=T0 + 1,
        running_since=since,
        conditions=(PodCondition(type="PodScheduled", since=T0 + 2), PodCondition(type="Ready", since=since)),
    )
    base.update(kw)
    return PodObservation(**base)


def pending(i: int, **kw) -> PodObservation:
    base = dict(name=f"run-a0-workers-0-{i}-abcde", index=i, phase="Pending", created_at=T0 + 1,
                conditions=(UNSCHEDULABLE,))  # fmt: skip
    base.update(kw)
    return PodObservation(**base)


def done(i: int, code: int = 0) -> PodObservation:
    phase = "Succeeded" if code == 0 else "Failed"
    return running(i, phase=phase, exit_code=code, terminated_reason="Completed" if code == 0 else "Error")


def beat(i: int, step: int | None, at: float) -> WorkerProgress:
    return WorkerProgress(index=i, step=step, at=at, first_step_at=T0 + 200 if step is not None else None)


def nodes(*lost: int, unreachable: bool = True) -> tuple[NodeObservation, ...]:
    return tuple(
        NodeObservation(name=f"gke-tpu-{i}", ready=None if i in lost else True,
                        unreachable=unreachable and i in lost, since=T0 + 500)
        for i in range(HOSTS)
    )  # fmt: skip


def obs(now: float, pods=(), *, jobs=(), progress=(), node_list=None, **kw) -> Observation:
    return Observation(now=T0 + now, expected_workers=HOSTS, created_at=T0, pods=tuple(pods), jobs=tuple(jobs),
                       progress=tuple(progress), nodes=nodes() if node_list is None else node_list, **kw)  # fmt: skip


ALL_RUNNING = [running(i) for i in range(HOSTS)]
STEPPING = [beat(i, 40, T0 + 500) for i in range(HOSTS)]
FAILURE_TARGET = JobObservation(
    name="run-a0-workers-0",
    conditions=(
        PodCondition(
            type="FailureTarget",
            reason="PodFailurePolicy",
            message="Container trainer for pod default/run-a0-workers-0-3 failed with exit code 20 "
            "matching FailJob rule at index 3",
        ),
    ),  # fmt: skip
)

# (id, observation, expected state, expected stall kind, a fragment the reason must contain)
CASES = [
    ("all-running-stepping", obs(510, ALL_RUNNING, progress=STEPPING), AttemptState.RUNNING, None, "step 40"),
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
        ),  # fmt: skip
        AttemptState.RUNNING,
        None,
        "scheduled 3/4",
    ),
    (
        "compiling-within-grace",
        obs(900, ALL_RUNNING, progress=[beat(i, None, T0 + 890) for i in range(HOSTS)]),
        AttemptState.RUNNING,
        None,
        "running 4/4",
    ),
    ("heartbeat-just-within-timeout", obs(619, ALL_RUNNING, progress=STEPPING), AttemptState.RUNNING, None, ""),
    ("every-pod-succeeded", obs(900, [done(i) for i in range(HOSTS)]), AttemptState.SUCCEEDED, None, "4/4"),
    (
        "jobset-completed",
        obs(900, [done(i) for i in range(HOSTS)], jobset_terminal_state="Completed"),
        AttemptState.SUCCEEDED,
        None,
        "completed",
    ),
    (
        "partial-completion-one-failed",
        obs(900, [done(0), done(1), done(2), done(3, code=42)]),
        AttemptState.FAILED,
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
                PodCondition(
                    type="Failed", reason="FailedJobs", message="jobset failed due to one or more job failures"
                ),
            ),
        ),  # fmt: skip
        AttemptState.FAILED,
        None,
        "FailedJobs",
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
        ),  # fmt: skip
        AttemptState.FAILED,
        None,
        "FailureTarget",
    ),
    (
        "node-unreachable-no-job-verdict",
        obs(700, ALL_RUNNING, progress=STEPPING, node_list=nodes(2)),
        AttemptState.STALLED,
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
                n if n.name != "gke-tpu-1" else NodeObservation(name="gke-tpu-1", exists=False) for n in nodes()
            ),
        ),  # fmt: skip
        AttemptState.STALLED,
        StallKind.NODE_LOST,
        "gone",
    ),
    (
        "pod-stuck-terminating-past-grace",
        obs(700, [*ALL_RUNNING[:3], running(3, deletion_timestamp=T0 + 630)], progress=STEPPING),
        AttemptState.STALLED,
        StallKind.NODE_LOST,
        "Terminating for 70 s",
    ),
    (
        "stuck-pending-no-tpu",
        obs(620, [running(0), running(1), running(2), pending(3)]),
        AttemptState.STALLED,
        StallKind.CAPACITY,
        "Insufficient google.com/tpu",
    ),
    (
        "too-few-pods-created",
        obs(620, [running(0), running(1), running(2)]),
        AttemptState.STALLED,
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
                    waiting_message='Back-off pulling image "gcr.io/x/worker:typo"',
                ),
            ],
        ),
        AttemptState.STALLED,
        StallKind.CONFIGURATION,
        "ImagePullBackOff for 310 s",
    ),
    (
        "invalid-image-name-at-once",
        obs(
            5,
            [
                pending(i, node=f"gke-tpu-{i}", conditions=(), waiting_reason="InvalidImageName", waiting_since=T0 + 4)
                for i in range(HOSTS)
            ],
        ),  # fmt: skip
        AttemptState.STALLED,
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
                        PodCondition(type="ConfigIssue", reason="MissingSecret", message="secret gcs-key not found"),
                    ),
                ),
            ],
        ),  # fmt: skip
        AttemptState.STALLED,
        StallKind.CONFIGURATION,
        "ConfigIssue: MissingSecret",
    ),
    (
        "silent-hang-after-first-step",
        obs(
            621,
            ALL_RUNNING,
            progress=[beat(0, 40, T0 + 600), beat(1, 40, T0 + 600), beat(2, 40, T0 + 600), beat(3, 38, T0 + 500)],
        ),  # fmt: skip
        AttemptState.STALLED,
        StallKind.HANG,
        "worker 3: no progress past step 38 for 121 s",
    ),
    (
        "no-first-step-past-compile-grace",
        obs(961, ALL_RUNNING),
        AttemptState.STALLED,
        StallKind.HANG,
        "no first step 901 s",
    ),
    (
        "jobset-deleted-underneath",
        obs(500, ALL_RUNNING, jobset_exists=False),
        AttemptState.FAILED,
        None,
        "deleted",
    ),
]


@pytest.mark.parametrize(("case", "observation", "state", "kind", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_decide(case, observation, state, kind, fragment):
    v = decide(observation, D)
    assert (v.state, v.kind) == (state, kind), v.reason
    assert fragment in v.reason
    assert v.over is (state != AttemptState.RUNNING)


def test_table_is_large_enough_and_covers_every_state_and_kind():
    assert len(CASES) >= 15
    assert {c[2] for c in CASES} == set(AttemptState)
    assert {c[3] for c in CASES} - {None} == set(StallKind)


def test_hang_timeout_below_two_heartbeats_is_one_line_naming_both_fields():
    data = {"run_id": "r", "image": "i", "slice": {"accelerator": "local", "hosts": 2}, "storage": {"root": "/tmp/x"},
            "supervision": {"hang_timeout_s": 10, "heartbeat_interval_s": 8}}  # fmt: skip
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    (line,) = e.value.problems
    assert line.startswith("supervision.hang_timeout_s: 10 is less than twice supervision.heartbeat_interval_s")
