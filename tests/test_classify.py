"""A table of realistic failed attempts and the class each must get (the pure classifier)."""

from __future__ import annotations

import pytest
from support.local_evidence import ended_slice

from jaxrec.model.contract import FailureClass
from jaxrec.model.jobset import pod_failure_policy
from jaxrec.model.records import WorkerExitReport
from jaxrec.model.snapshot import Condition, ContainerState, JobEvidence, NodeEvidence, PodEvidence
from recovery_steps.classify import classify
from recovery_steps.evidence import Evidence
from workflows.local.slices import job_failure

T0 = 1_714_557_600.0  # 2024-05-01T10:00:00Z
HOSTS = 4


def pod(
    i,
    code=None,
    at=None,
    *,
    reason="Error",
    signal=None,
    disruption=None,
    waiting=None,
    phase="Failed",
    events=(),
    node=None,
    message=None,
):
    c = ContainerState(name="trainer")
    if code is not None:
        c = ContainerState(
            name="trainer",
            exit_code=code,
            signal=signal,
            reason=reason,
            started_at=T0,
            finished_at=T0 + at if at is not None else None,
        )
    if waiting:
        c = ContainerState(name="trainer", waiting_reason=waiting[0], waiting_message=waiting[1])
    conds = (
        [Condition(type="DisruptionTarget", reason=disruption, message=f"{disruption} msg", at=T0 + (at or 0))]
        if disruption
        else []
    )
    return PodEvidence(
        name=f"js-workers-0-{i}-x{i}",
        worker_index=i,
        node=node or f"gke-tpu-{i}",
        phase=phase,
        containers=[c],
        conditions=conds,
        events=list(events),
        message=message,
    )


def node(i, *, ready=True, reason=None, spot=False, maint=None, taints=(), found=True, message=None, preemptible=False):
    labels = {"cloud.google.com/gke-spot": "true"} if spot else {}
    if preemptible:
        labels["cloud.google.com/gke-preemptible"] = "true"
    if maint:
        labels["cloud.google.com/active-node-maintenance"] = maint
    if not found:
        return NodeEvidence(name=f"gke-tpu-{i}", found=False)
    return NodeEvidence(
        name=f"gke-tpu-{i}",
        ready=ready,
        ready_reason=reason,
        ready_message=message,
        ready_since=T0 + 5,
        labels=labels,
        taints=list(taints),
        found=found,
    )


def torn_down(i, *, at=None, events=()):
    """A worker whose container never ran, as the kubelet reports it once the pod ends (status_manager.go)."""
    c = ContainerState(
        name="trainer",
        exit_code=137,
        reason="ContainerStatusUnknown",
        finished_at=None,
        message="The container could not be located when the pod was terminated",
    )
    return PodEvidence(
        name=f"js-workers-0-{i}-x{i}",
        worker_index=i,
        node=f"gke-tpu-{i}",
        phase="Failed",
        containers=[c],
        events=list(events),
    )


TYPO = "us-docker.pkg.dev/p/ml/worker:typo"
TYPO_NOT_FOUND = (
    f'rpc error: code = NotFound desc = failed to pull and unpack image "{TYPO}": failed to resolve '
    f'reference "{TYPO}": {TYPO}: not found'
)
REGISTRY_503 = (
    f'rpc error: code = Unknown desc = failed to pull and unpack image "{TYPO}": failed to copy: '
    "httpReadSeeker: failed open: unexpected status code https://us-docker.pkg.dev/v2/: 503 Service "
    "Unavailable"
)


def report(i, code, at, *, exc=None, msg=None, step=None, tb=None):
    names = {
        0: "OK",
        2: "CONFIGURATION",
        3: "INCOMPATIBLE_CHECKPOINT",
        20: "PEER_LOST",
        21: "HANG",
        22: "ACCELERATOR_INIT",
        42: "APPLICATION",
        143: "PREEMPTED",
    }
    return WorkerExitReport(
        run_id="r",
        attempt=0,
        process_index=i,
        process_count=HOSTS,
        exit_code=code,
        exit_name=names.get(code, str(code)),
        last_step=step,
        exception_type=exc,
        exception_message=msg,
        traceback=tb,
        started_at=T0,
        ended_at=T0 + at,
        hostname=f"host-{i}",
    )


def gke(pods, nodes=None, reports=(), jobs=()):
    nodes = nodes if nodes is not None else [node(i) for i in range(HOSTS)]
    return Evidence(backend="gke", attempt=0, pods=pods, nodes=nodes, reports=list(reports), jobs=list(jobs))


def local(workers, reports=()):
    """A local attempt as its supervisor's snapshot holds it (``support.local_evidence``), ``(code, seconds)`` each."""
    pods, job = ended_slice("local-0", [(code, T0 + at) for code, at in workers], T0)
    nodes = [NodeEvidence(name=f"local-{i}", ready=True, ready_reason="KubeletReady") for i in range(len(pods))]
    return Evidence(backend="local", attempt=0, pods=pods, jobs=[job], nodes=nodes, reports=list(reports))


def _fatal(frames: list[tuple[str, str]]) -> str:
    """A termination message as faulthandler writes it on SIGSEGV (innermost frame first)."""
    lines = ["Fatal Python error: Segmentation fault", "", "Current thread 0x00007f2c (most recent call first):"]
    lines += [f'  File "{path}", line {n + 10} in {fn}' for n, (path, fn) in enumerate(frames)]
    return "\n".join([*lines, "", "Extension modules: numpy._core._multiarray_umath (total: 1)"])


_SITE = "/usr/local/lib/python3.11/site-packages"
_STARTUP = [
    (f"{_SITE}/jax/_src/xla_bridge.py", "backends"),
    (f"{_SITE}/jax/_src/xla_bridge.py", "devices"),
    ("/app/trainer/app.py", "initialize"),
    ("/app/trainer/app.py", "run"),
]
_TRAINING = [
    (f"{_SITE}/jax/_src/pjit.py", "_pjit_call_impl"),
    ("/app/trainer/loop.py", "run_steps"),
    ("/app/trainer/app.py", "_train"),
]


GLOO = "JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: Connection closed by peer"

CASES = [
    pytest.param(
        gke(
            [pod(0, 143, 12), pod(1, 143, 10, disruption="TerminationByKubelet"), pod(2, 143, 12), pod(3, 143, 12)],
            [
                node(0, spot=True),
                node(1, spot=True, ready=False, reason="KubeletNotReady"),
                node(2, spot=True),
                node(3, spot=True),
            ],
        ),
        FailureClass.PREEMPTION,
        "worker 1",
        id="spot-preemption-termination-by-kubelet",
    ),
    pytest.param(
        gke(
            [
                pod(0, 143, 3, disruption="EvictionByEvictionAPI", node="gke-tpu-0"),
                pod(1, 143, 4),
                pod(2, 143, 4),
                pod(3, 143, 4),
            ],
            [node(0, maint="true"), node(1), node(2), node(3)],
        ),
        FailureClass.PREEMPTION,
        "Eviction API",
        id="maintenance-eviction",
    ),
    pytest.param(
        gke(
            [pod(0, 20, 8), pod(1, 20, 8), pod(2, phase="Running"), pod(3, 134, 14)],
            [node(0), node(1), node(2, ready=False, reason="NodeStatusUnknown"), node(3)],
            reports=[
                report(0, 20, 8.1, exc="JaxRuntimeError", msg=GLOO),
                report(1, 20, 8.2, exc="JaxRuntimeError", msg=GLOO),
            ],
        ),
        FailureClass.INFRASTRUCTURE,
        "NotReady",
        id="node-not-ready",
    ),
    pytest.param(
        gke([pod(0, 20, 10), pod(1, 137, 10, reason="OOMKilled"), pod(2, 20, 10), pod(3, 143, 12)]),
        FailureClass.APPLICATION,
        "OOMKilled",
        id="oomkilled-same-second-as-peer-loss",
    ),
    pytest.param(
        gke([pod(0, 143, 12), pod(1, 143, 12), pod(2, 137, 10, reason="OOMKilled"), pod(3, 143, 12)]),
        FailureClass.APPLICATION,
        "worker 2",
        id="mixed-first-failure-oom-then-sigterm",
    ),
    pytest.param(
        gke(
            [
                pod(
                    0,
                    waiting=("ImagePullBackOff", f'Back-off pulling image "{TYPO}": ErrImagePull: {TYPO_NOT_FOUND}'),
                    phase="Pending",
                ),
                pod(1, waiting=("ErrImagePull", "manifest unknown"), phase="Pending"),
                pod(2, phase="Pending"),
                pod(3, phase="Pending"),
            ]
        ),
        FailureClass.CONFIGURATION,
        "ImagePullBackOff",
        id="image-pull-failure",
    ),
    pytest.param(
        gke(
            [
                pod(
                    0,
                    waiting=("ImagePullBackOff", f'Back-off pulling image "{TYPO}": ErrImagePull: {REGISTRY_503}'),
                    phase="Pending",
                ),
                pod(1, phase="Running"),
                pod(2, phase="Running"),
                pod(3, phase="Running"),
            ]
        ),
        FailureClass.INFRASTRUCTURE,
        "registry, network or runtime fault",
        id="image-pull-transient-registry-error",
    ),
    pytest.param(
        gke(
            [
                pod(0, 42, 20),
                pod(1, 143, 21),
                pod(2, 143, 21),
                pod(3, waiting=("ErrImagePull", REGISTRY_503), phase="Pending"),
            ],
            reports=[report(0, 42, 20, exc="KeyError", msg="'labels'", step=3, tb="Traceback ...")],
        ),
        FailureClass.APPLICATION,
        "KeyError",
        id="a-transient-pull-does-not-hide-a-workers-failure",
    ),
    pytest.param(
        gke(
            [
                pod(0, 143, 30),
                pod(1, 143, 30),
                pod(2, 143, 30),
                torn_down(
                    3,
                    events=[f'Failed: Failed to pull image "{TYPO}": {TYPO_NOT_FOUND}', "Failed: Error: ErrImagePull"],
                ),
            ]
        ),
        FailureClass.CONFIGURATION,
        "its image cannot be pulled",
        id="never-ran-137-placeholder-events-say-not-found",
    ),
    pytest.param(
        gke(
            [pod(0, 42, 20), pod(1, 143, 21), pod(2, 143, 21), torn_down(3, at=19)],
            reports=[report(0, 42, 20, exc="ValueError", msg="bad shape", step=5, tb="Traceback ...")],
        ),
        FailureClass.APPLICATION,
        "worker 0",
        id="never-ran-137-placeholder-is-not-a-sigkill",
    ),
    pytest.param(
        gke(
            [
                torn_down(i, events=[f'Failed: Failed to pull image "{TYPO}": {REGISTRY_503}'] if i == 2 else ())
                for i in range(HOSTS)
            ]
        ),
        FailureClass.INFRASTRUCTURE,
        "registry or network fault",
        id="never-ran-placeholders-events-say-503",
    ),
    pytest.param(
        gke(
            [pod(0, 20, 9), pod(1, disruption="DeletionByPodGC", at=5, phase="Failed"), pod(2, 20, 9), pod(3, 134, 15)],
            [node(0, spot=True), node(1, found=False), node(2, spot=True), node(3, spot=True)],
        ),
        FailureClass.PREEMPTION,
        "Spot VM of the slice",
        id="pod-gc-spot-node-gone",
    ),
    pytest.param(
        gke(
            [pod(0, 143, 40), pod(1, 143, 30, disruption="DeletionByTaintManager"), pod(2, 143, 40), pod(3, 143, 40)],
            [
                node(0, spot=True),
                node(
                    1,
                    ready=None,
                    reason="NodeStatusUnknown",
                    spot=True,
                    taints=["node.kubernetes.io/unreachable:NoExecute"],
                ),
                node(2, spot=True),
                node(3, spot=True),
            ],
        ),
        FailureClass.PREEMPTION,
        "Spot node was reclaimed",
        id="taint-manager-deletion-on-spot",
    ),
    pytest.param(
        gke(
            [pod(0, 20, 9), pod(1, 20, 9), pod(2, 20, 9), pod(3, phase="Running")],
            [node(0, spot=True), node(1, spot=True), node(2, spot=True), node(3, found=False)],
            reports=[report(i, 20, 9.1, exc="JaxRuntimeError", msg=GLOO) for i in range(3)],
        ),
        FailureClass.PREEMPTION,
        "a Spot VM of the slice, is gone",
        id="spot-slice-node-gone-peers-lost",
    ),
    pytest.param(
        gke(
            [pod(0, 143, 12), pod(1, 143, 12), pod(2, 143, 12), pod(3, 143, 10)],
            [
                node(0),
                node(1),
                node(2),
                node(3, ready=False, reason="KubeletNotReady", message="node is shutting down"),
            ],
        ),
        FailureClass.PREEMPTION,
        "node shutting down",
        id="on-demand-node-shutting-down",
    ),
    pytest.param(
        gke(
            [pod(i, 42, 20) for i in range(HOSTS)],
            reports=[
                report(
                    i,
                    42,
                    20 + i / 100,
                    exc="ValueError",
                    msg="shapes (16, 32) and (64,) not aligned",
                    step=37,
                    tb="Traceback ...\nValueError: shapes",
                )
                for i in range(HOSTS)
            ],
        ),
        FailureClass.APPLICATION,
        "4 of 4",
        id="traceback-same-step-every-worker",
    ),
    pytest.param(
        gke(
            [pod(0, 20, 10), pod(1, 137, 10, signal=9), pod(2, 20, 10), pod(3, 134, 16)],
            reports=[
                report(0, 20, 10.2, exc="JaxRuntimeError", msg=GLOO),
                report(2, 20, 10.3, exc="JaxRuntimeError", msg=GLOO),
            ],
        ),
        FailureClass.INFRASTRUCTURE,
        "worker 1",
        id="gloo-on-neighbours-of-sigkilled-worker",
    ),
    pytest.param(
        local(
            [(20, 10.2), (-9, 10.0), (20, 10.3), (-6, 16.0)],
            reports=[
                report(0, 20, 10.2, exc="JaxRuntimeError", msg=GLOO),
                report(2, 20, 10.3, exc="JaxRuntimeError", msg=GLOO),
            ],
        ),
        FailureClass.INFRASTRUCTURE,
        "worker 1",
        id="local-sigkill-neighbours-gloo-survivors-abort",
    ),
    pytest.param(
        gke(
            [pod(0, 20, 100), pod(1, 21, 100), pod(2, 20, 100), pod(3, 143, 102)],
            reports=[report(1, 21, 100.0, exc="HangDetected", msg="no step for 60 s", step=240)],
        ),
        FailureClass.HANG,
        "worker 1",
        id="hang-watchdog",
    ),
    pytest.param(
        gke(
            [
                pod(
                    i,
                    phase="Pending",
                    events=[
                        "FailedScheduling: 0/12 nodes are available: 12 Insufficient "
                        "google.com/tpu. preemption: 0/12 nodes are available"
                    ],
                )
                for i in range(HOSTS)
            ],
            nodes=[],
        ),
        FailureClass.CAPACITY,
        "google.com/tpu",
        id="pending-for-tpu-capacity",
    ),
    pytest.param(
        gke(
            [pod(0, 143, 40), pod(1, 143, 30, disruption="DeletionByTaintManager"), pod(2, 143, 40), pod(3, 143, 40)],
            [
                node(0),
                node(1, ready=False, reason="NodeStatusUnknown", taints=["node.kubernetes.io/unreachable:NoExecute"]),
                node(2),
                node(3),
            ],
        ),
        FailureClass.INFRASTRUCTURE,
        "taint manager",
        id="taint-manager-deletion",
    ),
    pytest.param(
        gke(
            [pod(0, 20, 9), pod(1, disruption="DeletionByPodGC", at=5, phase="Failed"), pod(2, 20, 9), pod(3, 134, 15)],
            [node(0), node(1, found=False), node(2), node(3)],
        ),
        FailureClass.INFRASTRUCTURE,
        "worker 1",
        id="pod-gc-node-gone",
    ),
    pytest.param(
        gke([pod(0, 143, 50, disruption="PreemptionByScheduler"), pod(1, 143, 51), pod(2, 143, 51), pod(3, 143, 51)]),
        FailureClass.PREEMPTION,
        "scheduler",
        id="preemption-by-scheduler",
    ),
    pytest.param(
        local(
            [(42, 30.0), (42, 30.01), (42, 30.02), (42, 30.03)],
            reports=[
                report(i, 42, 30 + i / 100, exc="FloatingPointError", msg="non-finite loss nan at step 12", step=12)
                for i in range(HOSTS)
            ],
        ),
        FailureClass.APPLICATION,
        "non-finite",
        id="non-finite-loss",
    ),
    pytest.param(
        gke(
            [pod(0, 2, 3), pod(1, 143, 4), pod(2, 143, 4), pod(3, 143, 4)],
            reports=[report(0, 2, 3, exc="StartupMismatch", msg="expected 4 processes, jax sees 2")],
        ),
        FailureClass.CONFIGURATION,
        "expected 4 processes",
        id="startup-validation-mismatch",
    ),
    pytest.param(
        local([(3, 5.0), (143, 5.5), (143, 5.5), (143, 5.5)]),
        FailureClass.CONFIGURATION,
        "incompatible",
        id="incompatible-checkpoint",
    ),
    pytest.param(
        gke([pod(i, 127, 1) for i in range(HOSTS)]),
        FailureClass.CONFIGURATION,
        "entrypoint",
        id="exit-127-entrypoint-missing",
    ),
    pytest.param(
        gke(
            [
                pod(0, waiting=("CreateContainerConfigError", 'secret "wandb" not found'), phase="Pending"),
                pod(1, phase="Running"),
                pod(2, phase="Running"),
                pod(3, phase="Running"),
            ]
        ),
        FailureClass.CONFIGURATION,
        "CreateContainerConfigError",
        id="create-container-config-error",
    ),
    pytest.param(
        gke(
            [pod(0, 143, 3), pod(1, 143, 3), pod(2, 22, 2), pod(3, 143, 3)],
            reports=[report(2, 22, 2.0, exc="RuntimeError", msg="TPU initialization failed: open(/dev/vfio/0)")],
        ),
        FailureClass.INFRASTRUCTURE,
        "initialisation",
        id="accelerator-init-failure",
    ),
    pytest.param(
        local([(20, 10.0), (20, 10.1), (20, 10.1), (20, 10.2)]),
        FailureClass.INFRASTRUCTURE,
        "no application cause",
        id="peer-loss-without-cause",
    ),
    pytest.param(
        local(
            [(20, 10.0), (42, 10.15), (20, 10.1), (-6, 16.0)],
            reports=[
                report(
                    1, 42, 10.15, exc="KeyError", msg="'labels'", step=3, tb="Traceback (most recent call last): ..."
                )
            ],
        ),
        FailureClass.APPLICATION,
        "KeyError",
        id="peer-loss-first-application-cause-on-other",
    ),
    pytest.param(
        local([(143, 20.5), (143, 20.5), (143, 20.0), (143, 20.5)]),
        FailureClass.PREEMPTION,
        "worker 2",
        id="own-sigterm-first",
    ),
    pytest.param(
        gke(
            [pod(0, 42, 7), pod(1, 20, 7), pod(2, 20, 7), pod(3, 20, 7)],
            reports=[
                report(
                    0,
                    42,
                    7.0,
                    exc="XlaRuntimeError",
                    msg="RESOURCE_EXHAUSTED: XLA compilation ran out of memory in HLO pass",
                )
            ],
            jobs=[
                JobEvidence(
                    name="js-workers-0",
                    failed=True,
                    failure_reason="PodFailurePolicy",
                    failure_message="Container trainer for pod default/js-workers-0-0-x0 failed with exit "
                    "code 42 matching FailJob rule at index 3",
                )
            ],
        ),
        FailureClass.APPLICATION,
        "XLA compilation",
        id="xla-compile-error",
    ),
    pytest.param(
        Evidence(backend="gke", attempt=0, step_exit_code=75),
        FailureClass.CAPACITY,
        "75",
        id="provision-capacity-exit",
    ),
    # A fatal signal in native code (exit 139) with no exit report: where the stacks faulthandler left in the
    # termination message say the worker was.
    pytest.param(
        gke([pod(0, 139, 5, message=_fatal(_STARTUP)), pod(1, 143, 6), pod(2, 143, 6), pod(3, 143, 6)]),
        FailureClass.INFRASTRUCTURE,
        "killed by SIGSEGV in its start-up (xla_bridge.py backends): accelerator or runtime initialisation failed",
        id="native-crash-in-start-up",
    ),
    pytest.param(
        gke([pod(0, 139, 5, message=_fatal(_TRAINING)), pod(1, 143, 6), pod(2, 143, 6), pod(3, 143, 6)]),
        FailureClass.INFRASTRUCTURE,
        "killed by SIGSEGV in native code while training (pjit.py _pjit_call_impl)",
        id="native-crash-while-training",
    ),
    pytest.param(
        gke([pod(0, 135, 5), pod(1, 143, 6), pod(2, 143, 6), pod(3, 143, 6)]),
        FailureClass.UNKNOWN,
        "killed by SIGBUS with no exit report and no stack in its termination message",
        id="native-crash-without-a-stack",
    ),
    pytest.param(
        gke([pod(0, 1, 5), pod(1, 143, 6), pod(2, 143, 6), pod(3, 143, 6)]),
        FailureClass.UNKNOWN,
        "outside the exit-code contract",
        id="exit-1-outside-contract",
    ),
    pytest.param(Evidence(backend="local", attempt=0), FailureClass.UNKNOWN, "no failed worker", id="no-evidence"),
]


@pytest.mark.parametrize(("evidence", "expected", "in_reason"), CASES)
def test_classify_table(evidence, expected, in_reason):
    v = classify(evidence)
    assert v.failure_class is expected, v.reason
    assert in_reason in v.reason
    assert "\n" not in v.reason
    assert v.evidence, "a verdict must carry the evidence lines it used"


def test_first_failure_decides_over_later_application_errors():
    # Worker 3 is preempted at t=10; its siblings crash later while the gang is torn down.
    ev = gke(
        [pod(0, 42, 11), pod(1, 42, 11), pod(2, 42, 11), pod(3, 143, 10, disruption="TerminationByKubelet")],
        [node(0), node(1), node(2), node(3, spot=True)],
    )
    v = classify(ev)
    assert v.failure_class is FailureClass.PREEMPTION
    assert v.first_worker == 3


def case(name):
    return next(c.values[0] for c in CASES if c.id == name)


def test_secondary_first_points_at_cause_worker():
    ev = case("gloo-on-neighbours-of-sigkilled-worker")
    v = classify(ev)
    assert (v.first_worker, v.cause_worker) == (1, 1)
    assert v.evidence[0].startswith("worker 1 ")


def test_job_failure_message_breaks_a_tie_in_the_same_second():
    job = JobEvidence(
        name="js-workers-0",
        failed=True,
        failure_reason="PodFailurePolicy",
        failure_message="Container trainer for pod default/js-workers-0-2-x2 failed with exit code 21 "
        "matching FailJob rule at index 2",
    )
    ev = gke([pod(0, 21, 50), pod(1, 143, 52), pod(2, 21, 50), pod(3, 143, 52)], jobs=[job])
    v = classify(ev)
    assert v.failure_class is FailureClass.HANG
    assert v.first_worker == 2
    assert any("matching FailJob rule" in line for line in v.evidence)


def test_a_local_kill_is_classified_from_the_kubelets_exit_code_and_the_jobs_backoff_limit():
    """SIGKILL (137) matches no FailJob rule of the shipped policy: the Job fails by its backoff limit, naming no
    pod, as on GKE; the killed worker is named from the exit codes and times, its peers' exit 20 follow it."""
    ev = local([(20, 5.2), (-6, 9.0), (20, 5.3), (-9, 5.0)])
    assert ev.jobs[0].failure().reason == "BackoffLimitExceeded"
    v = classify(ev)
    assert v.failure_class is FailureClass.INFRASTRUCTURE
    assert v.reason.startswith("worker 3 (pod local-0-workers-0-3, node local-3) exit 137 (signal 9)"), v.reason


def test_the_local_job_names_the_first_pod_a_failjob_rule_matches_as_the_job_controller_does():
    pods = local([(143, 20.5), (42, 20.0), (143, 20.5)]).pods
    c = job_failure(pod_failure_policy()["rules"], 0, pods, "ns")
    assert (c.type, c.reason) == ("FailureTarget", "PodFailurePolicy")
    # pkg/controller/job/pod_failure_policy.go (v1.36.3): the message the classifier reads the pod and code from.
    assert c.message == (
        "Container trainer for pod ns/local-0-workers-0-1 failed with exit code 42 matching FailJob rule at index 5"
    )
    ignore = [{"action": "Ignore", "onExitCodes": {"operator": "In", "values": [42]}}]
    assert job_failure(ignore, 0, pods[1:2], "ns") is None


def test_classify_is_pure():
    ev = case("oomkilled-same-second-as-peer-loss")
    before = ev.model_dump()
    assert classify(ev) == classify(ev)
    assert ev.model_dump() == before


def _supervised(outcome, kind, reason, code=None, snapshot=None):
    from jaxrec.model.records import SupervisionRecord

    return SupervisionRecord(
        attempt=0,
        jobset="js",
        outcome=outcome,
        stall_kind=kind,
        reason=reason,
        worker=3,
        detected_at=T0 + 50,
        exit_code=code,
        snapshot=snapshot,
    )


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        ("capacity", FailureClass.CAPACITY),
        ("configuration", FailureClass.CONFIGURATION),
        ("hang", FailureClass.HANG),
        ("node-lost", FailureClass.INFRASTRUCTURE),
        ("image-pull", FailureClass.INFRASTRUCTURE),
        ("refused", FailureClass.UNKNOWN),
    ],
)
def test_a_stall_the_supervisor_stopped_decides_over_the_sigterm_exits_it_caused(kind, cls):
    # After the stop every worker exited 143 (SIGTERM): alone, that reads as a preemption.
    pods = [pod(i, 143, 60) for i in range(HOSTS)]
    ev = Evidence(backend="gke", attempt=0, pods=pods, supervision=_supervised("stalled", kind, "worker 3: why"))
    v = classify(ev)
    assert v.failure_class == cls and "worker 3: why" in v.reason and v.cause_worker == 3
    assert classify(Evidence(backend="gke", attempt=0, pods=pods)).failure_class == FailureClass.PREEMPTION


def test_a_supervisor_that_cannot_reach_the_api_is_configuration():
    s = _supervised("error", None, "Kubernetes API unreachable: connection refused", code=2)
    v = classify(Evidence(backend="gke", attempt=0, supervision=s))
    assert v.failure_class == FailureClass.CONFIGURATION and "unreachable" in v.reason


def test_a_supervised_ordinary_failure_is_classified_from_the_workers():
    pods = [pod(0, 143, 61), pod(1, 143, 61), pod(2, 143, 61), pod(3, 42, 60)]
    ev = Evidence(backend="gke", attempt=0, pods=pods, supervision=_supervised("failed", None, "Job failed"))
    assert classify(ev).failure_class == FailureClass.APPLICATION


def test_the_worker_the_supervisors_failure_verdict_names_is_the_first_that_failed():
    # Two workers killed within one second: alone, the lower index is named first; the supervisor saw worker 3 go
    # first on its live view and named it (_supervised: worker 3), and classify-failure names the same one.
    pods = [pod(0, 137, 60, reason="Error"), pod(1, 20, 62), pod(2, 20, 62), pod(3, 137, 60, reason="Error")]
    alone = classify(Evidence(backend="gke", attempt=0, pods=pods))
    assert alone.first_worker == 0
    v = classify(Evidence(backend="gke", attempt=0, pods=pods, supervision=_supervised("failed", None, "why")))
    assert v.first_worker == 3 and v.reason.startswith("worker 3 ") and v.failure_class == alone.failure_class
    # A named worker no longer among the failed ones (its pod gone from the evidence): the rule over the rest.
    rest = Evidence(backend="gke", attempt=0, pods=pods[:3], supervision=_supervised("failed", None, "why"))
    assert classify(rest).first_worker == 0


IMPENDING = "cloud.google.com/impending-node-termination:NoSchedule"
# A node-lost stall, as the supervisor recorded it with its snapshot (worker 3 on gke-tpu-3), and the class it is.
# (id, the snapshot's nodes, the workers' exit reports, the stall's reason, class, a fragment of the reason)
NODE_LOST = [
    (
        "node-shutting-down",
        [node(3, ready=False, reason="KubeletNotReady", message="node is shutting down")],
        [],
        "worker 3: node gke-tpu-3 is NotReady for 121 s",
        FailureClass.PREEMPTION,
        "gke-tpu-3 was shutting down",
    ),
    (
        "spot-node-unreachable",
        [node(3, ready=None, reason="NodeStatusUnknown", spot=True)],
        [],
        "worker 3: node gke-tpu-3 is unreachable",
        FailureClass.PREEMPTION,
        "gke-tpu-3 is a Spot VM",
    ),
    (
        "preemptible-node",
        [node(3, ready=None, preemptible=True)],
        [],
        "worker 3: node gke-tpu-3 is unreachable",
        FailureClass.PREEMPTION,
        "Spot VM",
    ),
    (
        "reclaim-taint",
        [node(3, ready=False, reason="KubeletNotReady", taints=[IMPENDING])],
        [],
        "worker 3: node gke-tpu-3 is NotReady",
        FailureClass.PREEMPTION,
        "maintenance (taint cloud.google.com/impending",
    ),
    (
        "maintenance-label",
        [node(3, ready=False, maint="true")],
        [],
        "worker 3: node gke-tpu-3 is NotReady",
        FailureClass.PREEMPTION,
        "label cloud.google.com/active-node-maintenance=true",
    ),
    (
        "worker-sigterm-before-the-stop",
        [node(3, ready=None)],
        [report(3, 143, 40, step=30)],
        "worker 3: node gke-tpu-3 is unreachable",
        FailureClass.PREEMPTION,
        "worker 3 exited 143 (SIGTERM) before",
    ),
    (
        "sigterm-from-the-supervisors-own-stop",
        [node(3, ready=None)],
        [report(i, 143, 60) for i in range(3)],
        "worker 3: node gke-tpu-3 is unreachable",
        FailureClass.INFRASTRUCTURE,
        "stalled (node-lost)",
    ),
    (
        "gone-node-of-a-spot-slice",
        [node(0, spot=True), node(3, found=False)],
        [],
        "worker 3: node gke-tpu-3 is gone",
        FailureClass.PREEMPTION,
        "the slice's nodes are Spot VMs (node gke-tpu-0)",
    ),
    (
        "on-demand-node-unreachable",
        [node(0), node(3, ready=None, reason="NodeStatusUnknown")],
        [],
        "worker 3: node gke-tpu-3 is unreachable",
        FailureClass.INFRASTRUCTURE,
        "unreachable",
    ),
    (
        "on-demand-node-gone",
        [node(0), node(3, found=False)],
        [],
        "worker 3: node gke-tpu-3 is gone",
        FailureClass.INFRASTRUCTURE,
        "gone",
    ),
    (
        "no-snapshot-the-recorded-ready-message-says-it",
        None,
        [],
        "worker 3: node gke-tpu-3 is NotReady (KubeletNotReady: node is shutting down) for 130 s",
        FailureClass.PREEMPTION,
        "the supervisor saw the node shutting down",
    ),
]


@pytest.mark.parametrize(
    ("case", "nodes", "reports", "why", "cls", "fragment"), NODE_LOST, ids=[c[0] for c in NODE_LOST]
)
def test_a_node_lost_stall_is_a_preemption_when_the_node_or_the_workers_say_so(
    case, nodes, reports, why, cls, fragment
):
    from jaxrec.model.snapshot import ClusterSnapshot

    snap = None
    if nodes is not None:
        snap = ClusterSnapshot(taken_at=T0 + 50, nodes=nodes, pods=[pod(i, phase="Running") for i in range(HOSTS)])
    after_stop = [pod(i, 143, 60) for i in range(HOSTS)]  # every worker got the stop's SIGTERM
    ev = Evidence(
        backend="gke",
        attempt=0,
        pods=after_stop,
        reports=list(reports),
        supervision=_supervised("stalled", "node-lost", why, snapshot=snap),
    )
    v = classify(ev)
    assert v.failure_class is cls, v.reason
    assert fragment in v.reason and v.cause_worker == 3
    assert "\n" not in v.reason and v.evidence[0].startswith("supervisor: stalled (node-lost)")


# The Job controller's FailedCreate events as the API server and its admission leave them ('Error creating: <the
# API's error>', kubernetes pkg/controller/controller_utils.go), and what each means.
POD_SECURITY = (
    'FailedCreate: Error creating: pods "js-workers-0-0-x8k2p" is forbidden: violates PodSecurity '
    '"baseline:latest": hostPath volumes (volume "tpu-dev"), privileged (container "trainer" must not '
    "set securityContext.privileged=true)"
)
WEBHOOK_DENIED = (
    'FailedCreate: Error creating: admission webhook "validation.gatekeeper.sh" denied the request: '
    "[allowed-repos] container <trainer> has an invalid image repo <gcr.io/p/trainer:1>, allowed repos "
    'are ["us-docker.pkg.dev/corp/"]'
)
QUOTA = (
    'FailedCreate: Error creating: pods "js-workers-0-0-x8k2p" is forbidden: exceeded quota: tpu-quota, '
    "requested: google.com/tpu=4, used: google.com/tpu=16, limited: google.com/tpu=16"
)
WEBHOOK_DOWN = (
    "FailedCreate: Error creating: Internal error occurred: failed calling webhook "
    '"validation.gatekeeper.sh": failed to call webhook: Post "https://gatekeeper-webhook-service.'
    'gatekeeper-system.svc:443/v1/admit?timeout=3s": context deadline exceeded'
)
LIMIT_RANGE = (
    'FailedCreate: Error creating: pods "js-workers-0-0-x8k2p" is forbidden: maximum memory usage per '
    "Container is 64Gi, but limit is 400Gi"
)
NO_ACCOUNT = (
    'FailedCreate: Error creating: pods "js-workers-0-0-x8k2p" is forbidden: error looking up service '
    'account training/jax-recovery-worker: serviceaccount "jax-recovery-worker" not found'
)

# JobSet's own pod webhook while the leader pod of an exclusive-placement Job is not scheduled yet, as the real
# JobSet v0.12.0 controller left it on the real-controller tier.
JOBSET_FOLLOWER = (
    'FailedCreate: Error creating: admission webhook "vpod.kb.io" denied the request: follower pod '
    "node selector for topology domain not found. missing selector: cloud.google.com/gke-nodepool"
)
JOBSET_LEADER = (
    'FailedCreate: Error creating: admission webhook "vpod.kb.io" denied the request: leader pod not '
    "yet scheduled, not creating follower pod. this is an expected, transient error"
)

# JobSet's webhook while the leader pod is gone or doubled (a restart racing the Job controller), and ResourceQuota
# admission while the quota controller has not counted a resource yet: both pass on the Job controller's retry.
JOBSET_NO_LEADER = (
    'FailedCreate: Error creating: admission webhook "vpod.kb.io" denied the request: expected 1 leader pod '
    "(js-workers-0-0), but got 0. this is an expected, transient error"
)
QUOTA_UNKNOWN = (
    'FailedCreate: Error creating: pods "js-workers-0-1-q2x9z" is forbidden: status unknown for quota: tpu-quota, '
    "resources: google.com/tpu"
)
# A refusal no rule names: what it means is not known, so it is not called configuration (budget 0).
UNRECOGNISED = (
    'FailedCreate: Error creating: pods "js-workers-0-0-x8k2p" is forbidden: node affinity of the pod is not '
    "allowed in this namespace by the cluster's placement policy"
)

# (id, the Job's warning event, the class (None: not a refusal), fragments of the line)
CREATE_REFUSALS = [
    (
        "pod-security",
        POD_SECURITY,
        FailureClass.CONFIGURATION,
        ["Pod Security admission (baseline:latest)", "hostPath volumes", "pod-security.kubernetes.io/enforce"],
    ),
    (
        "webhook-denied",
        WEBHOOK_DENIED,
        FailureClass.CONFIGURATION,
        ["admission webhook validation.gatekeeper.sh denied them", "invalid image repo", "exempt the namespace"],
    ),
    ("quota", QUOTA, FailureClass.CAPACITY, ["ResourceQuota tpu-quota is spent", "google.com/tpu=16", "raise"]),
    (
        "webhook-unreachable",
        WEBHOOK_DOWN,
        FailureClass.INFRASTRUCTURE,
        ["validation.gatekeeper.sh could not be called", "context deadline exceeded"],
    ),
    ("limit-range", LIMIT_RANGE, FailureClass.CONFIGURATION, ["LimitRange forbids them", "limit is 400Gi"]),
    ("service-account", NO_ACCOUNT, FailureClass.CONFIGURATION, ["no service account training/jax-recovery-worker"]),
    ("unrecognised", UNRECOGNISED, FailureClass.UNKNOWN, ["does not know", "node affinity"]),
    ("another-warning", "FailedScheduling: 0/8 nodes are available: 8 Insufficient google.com/tpu.", None, []),
    ("backoff", "BackoffLimitExceeded: Job has reached the specified backoff limit", None, []),
    ("jobset-follower-before-leader", JOBSET_FOLLOWER, None, []),
    ("jobset-leader-not-scheduled", JOBSET_LEADER, None, []),
    ("jobset-leader-missing", JOBSET_NO_LEADER, None, []),
    ("quota-status-unknown", QUOTA_UNKNOWN, None, []),
]


@pytest.mark.parametrize(
    ("event", "cls", "fragments"), [c[1:] for c in CREATE_REFUSALS], ids=[c[0] for c in CREATE_REFUSALS]
)
def test_a_jobs_failed_create_names_what_refused_its_pods_and_the_fix(event, cls, fragments):
    from recovery_steps.classify import create_refusal

    found = create_refusal(event)
    assert (found[0] if found else None) is cls
    for f in fragments:
        assert f in found[1], found[1]


def _refused_gang(event, supervision=None):
    """The gang never started: its Job exists, the API refused every pod; nothing else tells why."""
    job = JobEvidence(name="js-workers-0", events=[event])
    return Evidence(backend="gke", attempt=0, jobs=[job], supervision=supervision)


@pytest.mark.parametrize(
    ("event", "cls"),
    [
        (POD_SECURITY, FailureClass.CONFIGURATION),
        (WEBHOOK_DENIED, FailureClass.CONFIGURATION),
        (QUOTA, FailureClass.CAPACITY),
    ],
    ids=["pod-security", "webhook", "quota"],
)
def test_pods_the_api_refused_decide_over_the_supervisors_count_of_missing_pods(event, cls):
    stalled = _supervised("stalled", "capacity", "only 0/4 worker pods exist after 601 s (deadline 600 s)")
    for ev in (_refused_gang(event), _refused_gang(event, stalled)):
        v = classify(ev)
        assert v.failure_class is cls, v.reason
        assert v.reason.startswith("Job js-workers-0 could not create its worker pods: ") and "\n" not in v.reason
        assert any(line.startswith("Job js-workers-0: FailedCreate: Error creating") for line in v.evidence)
    # A stall of another kind is the supervisor's own finding: it stands.
    hang = classify(_refused_gang(event, _supervised("stalled", "hang", "worker 3: no progress")))
    assert hang.failure_class is FailureClass.HANG


@pytest.mark.parametrize("event", [POD_SECURITY, QUOTA])
def test_a_refusal_the_job_controller_retried_never_outranks_a_trainer_that_ran(event):
    """Some pods were refused for a while, then created; a worker exited 42: an application error."""
    job = JobEvidence(name="js-workers-0", events=[event])
    v = classify(gke([pod(0, 42, 44), *(pod(i, 143, 44) for i in (1, 2, 3))], jobs=[job]))
    assert v.failure_class is FailureClass.APPLICATION, v.reason


BACKOFF_LIMIT = Condition(
    type="FailureTarget",
    reason="BackoffLimitExceeded",
    message="Job has reached the specified backoff limit",
    at=T0 + 70,
)


def test_a_job_at_failure_target_is_the_failure_when_no_worker_explains_it():
    """The Job controller decided (FailureTarget) while the pods on a lost node were never seen to end."""
    job = JobEvidence(
        name="js-workers-0",
        conditions=[BACKOFF_LIMIT],
        failed=True,
        failure_reason="BackoffLimitExceeded",
        failure_message=BACKOFF_LIMIT.message,
    )
    v = classify(gke([pod(i, phase="Running") for i in range(HOSTS)], jobs=[job]))
    assert v.failure_class is FailureClass.UNKNOWN
    assert v.reason.startswith("Job js-workers-0 FailureTarget (BackoffLimitExceeded: Job has reached the specified")
    assert any(
        line.startswith("Job js-workers-0 FailureTarget at 10:01:10Z: BackoffLimitExceeded") for line in v.evidence
    )


def _fail_job_target(pod_name: str, rule: int) -> Condition:
    """The FailureTarget the Job controller sets when a pod matches a FailJob rule with exit code 42."""
    return Condition(
        type="FailureTarget",
        reason="PodFailurePolicy",
        at=T0 + 42,
        message=f"Container trainer for pod default/{pod_name} failed with exit code 42 matching "
        f"FailJob rule at index {rule}",
    )


def test_the_exit_code_a_jobs_failure_target_names_classifies_a_worker_whose_pod_is_gone():
    job = JobEvidence(name="js-workers-0", conditions=[_fail_job_target("js-workers-0-2-x2", 0)])
    pods = [pod(i, 143, 44) for i in (0, 1, 3)]  # worker 2's pod was deleted; its Job still says how it ended
    v = classify(gke(pods, jobs=[job]))
    assert v.failure_class is FailureClass.APPLICATION, v.reason
    assert (v.first_worker, v.cause_worker) == (2, 2)
    assert "pod js-workers-0-2-x2, gone" in v.reason and "exit 42" in v.reason


def test_the_exit_code_a_jobs_failure_target_names_classifies_a_worker_whose_pod_was_last_seen_running():
    """The supervisor's pod view lagged its Job view (two watches): worker 1's pod still ran in the snapshot while
    its Job had failed naming the pod and its exit code. That exit is the fresher fact: application, not unknown."""
    job = JobEvidence(name="js-workers-0", conditions=[_fail_job_target("js-workers-0-1-x1", 5)])
    v = classify(gke([pod(i, phase="Running") for i in range(HOSTS)], jobs=[job]))
    assert v.failure_class is FailureClass.APPLICATION, v.reason
    assert v.first_worker == 1 and "exit 42" in v.reason, v.reason


def test_a_trainer_killed_in_a_pod_its_agent_keeps_is_classified_from_the_agents_code():
    """Level 0: the pods still run (no container exit code) and the SIGKILLed trainer wrote no report; its agent's
    recorded code is the evidence, read as a container's would be."""
    from jaxrec.model.records import AgentState, AgentStateKind

    running = [pod(i, phase="Running") for i in range(HOSTS)]
    ev = gke(running, [node(i) for i in range(HOSTS)])
    assert classify(ev).failure_class is FailureClass.UNKNOWN  # nothing says what ended
    ev.agents = [AgentState(process_index=2, state=AgentStateKind.EXITED, attempt=0, exit_code=137, at=T0 + 3)]
    v = classify(ev)
    assert (v.failure_class, v.first_worker) == (FailureClass.INFRASTRUCTURE, 2), v.reason
    assert "SIGKILL" in v.reason
