"""The Kubernetes evidence adapter against a fake API server at its HTTP boundary, and classify-failure on GKE."""

from __future__ import annotations

import copy
import json
import socket
from pathlib import Path

import pytest
from support.fake_k8s import FakeCluster, status

from jaxrec.adapters.kube import make_api_client
from jaxrec.adapters.store import AttemptRef, RunLayout, RunStore
from jaxrec.model.config import parse_config
from jaxrec.model.contract import FailureClass
from jaxrec.model.records import SupervisionRecord, WorkerExitReport
from recovery_steps import classify_failure
from recovery_steps.classify import classify
from recovery_steps.evidence import Evidence, gather_kubernetes, gather_reports

NS = "training"
JS = "llm-a3"
JS_LABEL = "jobset.sigs.k8s.io/jobset-name"


def ts(sec: int) -> str:
    return f"2024-05-01T10:00:{sec:02d}Z"


def api_pod(
    i: int,
    *,
    code: int | None,
    at: int | None = None,
    reason: str = "Error",
    disruption: str | None = None,
    phase: str = "Failed",
    node: str | None = None,
) -> dict:
    name = f"{JS}-workers-0-{i}-q{i}x7z"
    if code is not None:
        state = {
            "terminated": {
                "exitCode": code,
                "reason": reason,
                "startedAt": ts(0),
                "finishedAt": ts(at),
                "containerID": f"containerd://{i:064d}",
            }
        }
    elif phase == "Pending":
        state = {"waiting": {"reason": "ContainerCreating"}}
    else:
        state = {"running": {"startedAt": ts(0)}}
    spec = {"restartPolicy": "Never", "containers": [{"name": "trainer", "image": "gcr.io/p/trainer:1"}]}
    if phase != "Pending":
        spec["nodeName"] = node or f"gke-tpu-pool-{i}"
    conditions = [
        {
            "type": "Ready",
            "status": "False",
            "lastProbeTime": None,
            "lastTransitionTime": ts(at or 0),
            "reason": "PodFailed",
        }
    ]
    if phase == "Pending":
        conditions = [
            {
                "type": "PodScheduled",
                "status": "False",
                "lastProbeTime": None,
                "lastTransitionTime": ts(0),
                "reason": "Unschedulable",
                "message": "0/8 nodes are available: 8 Insufficient google.com/tpu.",
            }
        ]
    if disruption:
        conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "lastProbeTime": None,
                "lastTransitionTime": ts(at or 0),
                "reason": disruption,
                "message": "Pod was terminated in response to imminent node shutdown.",
            }
        )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{i}",
            "labels": {
                JS_LABEL: JS,
                "jobset.sigs.k8s.io/replicatedjob-name": "workers",
                "batch.kubernetes.io/job-completion-index": str(i),
                "job-name": f"{JS}-workers-0",
            },
            "annotations": {"batch.kubernetes.io/job-completion-index": str(i)},
        },
        "spec": spec,
        "status": {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": [
                {
                    "name": "trainer",
                    "state": state,
                    "lastState": {},
                    "ready": False,
                    "restartCount": 0,
                    "image": "gcr.io/p/trainer:1",
                    "imageID": "",
                    "started": False,
                }
            ],
        },
    }


def api_node(name: str, *, ready: str = "True", spot: bool = False, taints: list[dict] | None = None) -> dict:
    labels = {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice", "kubernetes.io/hostname": name}
    if spot:
        labels["cloud.google.com/gke-spot"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints or []},
        "status": {
            "conditions": [
                {
                    "type": "MemoryPressure",
                    "status": "False",
                    "lastHeartbeatTime": ts(0),
                    "lastTransitionTime": ts(0),
                    "reason": "KubeletHasSufficientMemory",
                    "message": "kubelet has sufficient memory available",
                },
                {
                    "type": "Ready",
                    "status": ready,
                    "lastHeartbeatTime": ts(9),
                    "lastTransitionTime": ts(9),
                    "reason": "KubeletReady" if ready == "True" else "KubeletNotReady",
                    "message": "kubelet is posting ready status" if ready == "True" else "node is shutting down",
                },
            ]
        },
    }


def api_jobset(failed: bool = True) -> dict:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": JS, "namespace": NS},
        "spec": {"failurePolicy": {"maxRestarts": 0}, "replicatedJobs": [{"name": "workers", "replicas": 1}]},
        "status": {
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "FailedJobs",
                    "message": "jobset failed due to one or more job failures",
                    "lastTransitionTime": ts(11),
                }
            ]
            if failed
            else [],
            "terminalState": "Failed" if failed else None,
            "replicatedJobsStatus": [{"name": "workers", "ready": 0, "succeeded": 0, "failed": 1, "active": 0}],
        },
    }


def api_job(failed_pod: str, code: int) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{JS}-workers-0", "namespace": NS, "labels": {JS_LABEL: JS}},
        "status": {
            "failed": 1,
            "conditions": [
                {
                    "type": "FailureTarget",
                    "status": "True",
                    "reason": "PodFailurePolicy",
                    "lastTransitionTime": ts(10),
                    "message": f"Container trainer for pod {NS}/{failed_pod} failed with exit code {code} matching "
                    "FailJob rule at index 5",
                },
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "PodFailurePolicy",
                    "lastTransitionTime": ts(10),
                    "message": f"Container trainer for pod {NS}/{failed_pod} failed with exit code {code} matching "
                    "FailJob rule at index 5",
                },
            ],
        },
    }


@pytest.fixture
def api():
    a = FakeCluster(namespace=NS)
    yield a
    a.close()


def spot_preemption(api: FakeCluster) -> None:
    api.put("jobsets", api_jobset())
    pods = [
        api_pod(0, code=143, at=12),
        api_pod(1, code=143, at=10, disruption="TerminationByKubelet"),
        api_pod(2, code=143, at=12),
        api_pod(3, code=143, at=12),
    ]
    api.put("pods", *pods)
    api.put("jobs", api_job(pods[1]["metadata"]["name"], 143))
    api.put("nodes", *(api_node(f"gke-tpu-pool-{i}", spot=True) for i in range(4)))
    api.put(
        "nodes",
        api_node(
            "gke-tpu-pool-1",
            ready="False",
            spot=True,
            taints=[{"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"}],
        ),
    )
    # A pod of another JobSet in the namespace must not be read as evidence (its own name: one namespace holds
    # one object of a name).
    other = api_pod(0, code=42, at=1)
    other["metadata"]["labels"][JS_LABEL] = "someone-else"
    other["metadata"]["name"] = "someone-else-workers-0-0-q0x7z"
    api.put("pods", other)


def test_spot_preemption_read_from_the_api(api):
    spot_preemption(api)
    ev = gather_kubernetes(make_api_client(api.url), NS, JS, Evidence(backend="gke", attempt=3))
    assert ev.notes == []
    assert ev.jobset is not None and ev.jobset.terminal_state == "Failed"
    assert [p.worker_index for p in ev.pods] == [0, 1, 2, 3]
    p1 = ev.pods[1]
    assert p1.disruption() is not None and p1.disruption().reason == "TerminationByKubelet"
    assert p1.trainer().exit_code == 143 and p1.trainer().finished_at == pytest.approx(1714557610.0)
    n1 = ev.node("gke-tpu-pool-1")
    assert n1.ready is False and n1.spot and n1.maintenance().startswith("taint cloud.google.com/impending")
    assert ev.jobs[0].failed and "exit code 143" in ev.jobs[0].failure_message
    v = classify(ev)
    assert v.failure_class is FailureClass.PREEMPTION
    assert v.first_worker == 1
    assert "gke-tpu-pool-1" in v.reason


def test_pending_pods_events_give_capacity(api):
    api.put("jobsets", api_jobset(failed=False))
    pods = [api_pod(i, code=None, phase="Pending") for i in range(4)]
    api.put("pods", *pods)
    events = [
        {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"e{i}", "namespace": NS},
            "involvedObject": {"kind": "Pod", "name": p["metadata"]["name"], "namespace": NS},
            "reason": "FailedScheduling",
            "type": "Warning",
            "count": 14,
            "message": "0/8 nodes are available: 8 Insufficient google.com/tpu. preemption: not eligible",
        }
        for i, p in enumerate(pods)
    ]
    api.put("events", *events)
    ev = gather_kubernetes(make_api_client(api.url), NS, JS, Evidence(backend="gke", attempt=0))
    assert all(p.events and p.events[0].startswith("FailedScheduling") for p in ev.pods)
    v = classify(ev)
    assert v.failure_class is FailureClass.CAPACITY
    assert "Insufficient google.com/tpu" in v.reason


def test_missing_jobset_is_noted_and_reports_still_classify(api, tmp_path):
    store = RunStore(str(tmp_path), "r")
    rep = WorkerExitReport(
        run_id="r",
        attempt=0,
        process_index=2,
        process_count=4,
        exit_code=21,
        exit_name="HANG",
        ended_at=1714557700.0,
        last_step=90,
    )
    store.write_json(RunLayout.worker_report(0, 2), rep.model_dump(mode="json"))
    ev = Evidence(backend="gke", attempt=0)
    gather_reports(store, 0, ev)
    gather_kubernetes(make_api_client(api.url), NS, JS, ev)
    assert ev.jobset is not None and not ev.jobset.found
    assert any("not found" in n for n in ev.notes)
    assert classify(ev).failure_class is FailureClass.HANG


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_api_is_never_taken_for_a_missing_gang():
    from jaxrec.adapters.kube import api_exit_code
    from recovery_steps.evidence import EvidenceUnreadable

    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(EvidenceUnreadable) as e:
        gather_kubernetes(make_api_client(url), NS, JS, Evidence(backend="gke", attempt=0))
    assert e.value.what == f"JobSet {NS}/{JS}" and "Kubernetes API unreachable" in str(e.value)
    assert api_exit_code(e.value.error) == 69


def tpu_config(root: str):
    return parse_config(
        {
            "run_id": "llm",
            "namespace": NS,
            "image": "gcr.io/p/trainer:1",
            "slice": {"accelerator": "v5e", "topology": "4x4", "spot": True},
            "storage": {"root": root, "durable_mount": True},
        }
    )


def test_classify_failure_on_gke_backend(api, tmp_path, capsys):
    spot_preemption(api)
    cfg = tpu_config(str(tmp_path / "store"))
    store = RunStore.for_config(cfg)
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})
    out = tmp_path / "out"
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        out,
        api_client=make_api_client(api.url),
    )
    assert r.evidence.backend == "gke"
    assert (out / "failure-class").read_text() == "preemption"
    assert (out / "decision").read_text() == "retry"
    assert (out / "next-attempt").read_text() == "4"
    assert json.loads((out / "attempts-by-class").read_text())["preemption"] == 1
    rec = store.read_json(RunLayout.attempt_record(3))
    assert rec["failure_class"] == "preemption" and rec["jobset"] == JS
    assert Path(store.url(RunLayout.LEDGER)).exists()


def test_a_cpu_slice_is_classified_from_the_kubernetes_api_in_both_worlds(api, tmp_path):
    """The CPU slice has a JobSet and pods to read wherever its steps run: the local runner serves its cluster as the
    Kubernetes API too, so classify-failure reads the same evidence as on a cluster."""
    spot_preemption(api)
    cfg = parse_config(
        {
            "run_id": "cpu",
            "namespace": NS,
            "image": "trainer:local",
            "slice": {"accelerator": "local", "hosts": 4},
            "storage": {"root": str(tmp_path / "store")},
        }
    )
    store = RunStore.for_config(cfg)
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        tmp_path / "out",
        api_client=make_api_client(api.url),
    )
    assert r.evidence.backend == "local" and len(r.evidence.pods) > 0
    assert r.verdict.failure_class is FailureClass.PREEMPTION


def _failed_attempt_snapshot(code: int):
    from jaxrec.model.snapshot import ClusterSnapshot, job_from_api, node_from_api, pod_from_api

    pods = []
    for i in range(4):
        term = i == 2
        state = (
            {
                "terminated": {
                    "exitCode": code,
                    "reason": "Error",
                    "startedAt": "2026-01-01T00:00:00Z",
                    "finishedAt": "2026-01-01T00:05:00Z",
                }
            }
            if term
            else {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        )
        pods.append(
            pod_from_api(
                {
                    "metadata": {
                        "name": f"{JS}-workers-0-{i}-x",
                        "labels": {"batch.kubernetes.io/job-completion-index": str(i)},
                    },
                    "spec": {"nodeName": f"n{i}"},
                    "status": {
                        "phase": "Failed" if term else "Running",
                        "containerStatuses": [{"name": "trainer", "state": state}],
                    },
                }
            )
        )
    msg = (
        f"Container trainer for pod {NS}/{JS}-workers-0-2-x failed with exit code {code} matching FailJob rule "
        "at index 5"
    )
    job = job_from_api(
        {
            "metadata": {"name": f"{JS}-workers-0"},
            "status": {
                "conditions": [
                    {
                        "type": "FailureTarget",
                        "status": "True",
                        "reason": "PodFailurePolicy",
                        "message": msg,
                        "lastTransitionTime": "2026-01-01T00:05:01Z",
                    }
                ]
            },
        }
    )
    nodes = [
        node_from_api({"metadata": {"name": f"n{i}"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        for i in range(4)
    ]
    return ClusterSnapshot(taken_at=1.0, jobs=[job], pods=pods, nodes=nodes)


def test_a_job_at_failure_target_counts_as_failed_with_its_rule_message():
    snap = _failed_attempt_snapshot(42)
    (job,) = snap.jobs
    assert job.failed and job.failure_reason == "PodFailurePolicy" and "exit code 42" in job.failure_message


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (42, FailureClass.APPLICATION),
        (2, FailureClass.CONFIGURATION),
        (20, FailureClass.INFRASTRUCTURE),
        (21, FailureClass.HANG),
    ],
)
def test_the_supervisors_snapshot_is_the_evidence_when_its_stop_left_nothing_in_the_api(code, cls):
    from jaxrec.model.records import SupervisionRecord
    from recovery_steps.evidence import use_supervisor_snapshot

    sup = SupervisionRecord(
        attempt=3,
        jobset=JS,
        outcome="failed",
        reason="FailureTarget",
        detected_at=2.0,
        snapshot=_failed_attempt_snapshot(code),
    )
    empty = Evidence(backend="gke", attempt=3, supervision=sup)
    assert (
        classify(empty.model_copy(update={"supervision": sup.model_copy(update={"snapshot": None})})).failure_class
        == FailureClass.UNKNOWN
    )
    ev = use_supervisor_snapshot(empty)
    assert len(ev.pods) == 4 and any("before its stop" in n for n in ev.notes)
    assert classify(ev).failure_class == cls


def test_pods_the_api_still_has_win_over_the_snapshot():
    from jaxrec.model.records import SupervisionRecord
    from jaxrec.model.snapshot import PodEvidence
    from recovery_steps.evidence import use_supervisor_snapshot

    sup = SupervisionRecord(
        attempt=3, jobset=JS, outcome="failed", reason="x", detected_at=2.0, snapshot=_failed_attempt_snapshot(42)
    )
    live = [PodEvidence(name="still-here", worker_index=0, phase="Failed")]
    ev = use_supervisor_snapshot(Evidence(backend="gke", attempt=3, supervision=sup, pods=live))
    assert [p.name for p in ev.pods] == ["still-here"] and not ev.notes


def _running_gang(api: FakeCluster) -> None:
    api.put(
        "jobsets",
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": JS, "namespace": NS},
            "status": {"replicatedJobsStatus": []},
        },
    )
    api.put("pods", *(api_pod(i, code=None, phase="Running") for i in range(4)))


def _gke_run(tmp_path):
    cfg = tpu_config(str(tmp_path / "store"))
    store = RunStore.for_config(cfg)
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})
    return cfg, store


def test_a_running_gang_whose_supervisor_left_no_verdict_is_supervised_again_not_closed(api, tmp_path):
    from jaxrec.model.records import Ledger, SupervisionRecord, SupervisorLosses

    _running_gang(api)
    cfg, store = _gke_run(tmp_path)
    out = tmp_path / "out"
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        out,
        api_client=make_api_client(api.url),
    )
    assert (out / "decision").read_text() == "resupervise" and "supervisor was lost" in (out / "reason").read_text()
    # The attempt is not closed: no ledger entry, no budget spent; the loss is counted.
    assert store.read_record(RunLayout.LEDGER, Ledger) is None
    assert len(store.read_record(RunLayout.supervisor_losses(3), SupervisorLosses).at) == 1
    assert r.decision.decision == "resupervise"
    # A supervisor that left transient (69) decided nothing either; one that recorded a verdict did.
    store.write_record(
        RunLayout.supervision(3),
        SupervisionRecord(attempt=3, jobset=JS, outcome="error", exit_code=69, reason="API 503", detected_at=1.0),
    )
    assert (
        classify_failure.run(
            classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
            None,
            api_client=make_api_client(api.url),
        ).decision.decision
        == "resupervise"
    )
    store.write_record(
        RunLayout.supervision(3),
        SupervisionRecord(
            attempt=3, jobset=JS, outcome="stalled", stall_kind="hang", reason="no step", detected_at=1.0
        ),
    )
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        None,
        api_client=make_api_client(api.url),
    )
    assert r.decision.decision == "retry" and r.verdict.failure_class == "hang"


def test_a_supervisor_lost_again_and_again_closes_the_attempt(api, tmp_path):
    from jaxrec.model.records import Ledger, SupervisorLosses

    _running_gang(api)
    cfg, store = _gke_run(tmp_path)
    losses = SupervisorLosses(attempt=3, at=[1.0] * classify_failure.MAX_SUPERVISOR_LOSSES)
    store.write_record(RunLayout.supervisor_losses(3), losses)
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        None,
        api_client=make_api_client(api.url),
    )
    assert r.decision.decision != "resupervise"
    assert [a.attempt for a in store.read_record(RunLayout.LEDGER, Ledger).attempts] == [3]
    assert any("lost 10 times" in n for n in r.evidence.notes)


def test_a_finished_or_missing_jobset_is_never_resupervised(api, tmp_path):
    cfg, _ = _gke_run(tmp_path)
    spot_preemption(api)  # the JobSet failed
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        None,
        api_client=make_api_client(api.url),
    )
    assert r.decision.decision == "retry"
    api.remove("jobsets", JS)
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 4), JS),
        None,
        api_client=make_api_client(api.url),
    )
    assert r.decision.decision != "resupervise"


def _status(code: int, reason: str, message: str, **details) -> tuple[int, dict]:
    return code, status(code, reason, message, **details)


# How the API server answers when it cannot answer now (apimachinery's Status bodies), and a refusal.
UNAVAILABLE = _status(
    503,
    "ServiceUnavailable",
    "the server is currently unable to handle the request",
    causes=[{"reason": "UnexpectedServerResponse", "message": "service unavailable"}],
)
THROTTLED = _status(429, "TooManyRequests", "Too many requests, please try again later.", retryAfterSeconds=1)
INTERNAL = _status(
    500,
    "InternalError",
    "Internal error occurred: conversion webhook for jobset.x-k8s.io/v1alpha2, "
    'Kind=JobSet failed: Post "https://jobset-webhook-service.jobset-system.svc:443/convert": EOF',
)
FORBIDDEN = _status(
    403,
    "Forbidden",
    f'jobsets.jobset.x-k8s.io "{JS}" is forbidden: User "system:serviceaccount:'
    f'{NS}:jax-recovery" cannot get resource "jobsets" in API group "jobset.x-k8s.io" in the '
    f'namespace "{NS}"',
    name=JS,
    group="jobset.x-k8s.io",
    kind="jobsets",
)
# The reads the verdict depends on, by the path each one asks.
READS = {
    "jobset": f"/jobsets/{JS}",
    "jobs": f"/apis/batch/v1/namespaces/{NS}/jobs",
    "pods": f"/api/v1/namespaces/{NS}/pods",
    "node": "/api/v1/nodes/",
}


@pytest.mark.parametrize("answer", [UNAVAILABLE, THROTTLED, INTERNAL], ids=["503", "429", "500"])
@pytest.mark.parametrize("read", list(READS))
def test_a_gang_whose_evidence_cannot_be_read_is_neither_closed_nor_resupervised(api, tmp_path, read, answer):
    """The supervisor was lost and the gang still runs: a failed read is not a missing JobSet (transient, 69)."""
    from jaxrec.model.records import Ledger, SupervisorLosses
    from recovery_steps.step import StepError

    _running_gang(api)
    api.inject(READS[read], *answer)
    cfg, store = _gke_run(tmp_path)
    with pytest.raises(StepError) as e:
        classify_failure.run(
            classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
            tmp_path / "out",
            api_client=make_api_client(api.url),
        )
    assert e.value.code == 69 and f"answered {answer[0]}" in str(e.value) and "not taken for absence" in str(e.value)
    assert store.read_record(RunLayout.LEDGER, Ledger) is None  # the attempt is not closed
    assert store.read_record(RunLayout.supervisor_losses(3), SupervisorLosses) is None  # nor counted as lost
    assert not (tmp_path / "out").exists()


def test_a_refused_read_is_configuration_and_decides_nothing(api, tmp_path):
    from jaxrec.model.records import Ledger
    from recovery_steps.step import StepError

    _running_gang(api)
    api.inject(READS["jobset"], *FORBIDDEN)
    cfg, store = _gke_run(tmp_path)
    with pytest.raises(StepError) as e:
        classify_failure.run(
            classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
            None,
            api_client=make_api_client(api.url),
        )
    assert e.value.code == 2 and "answered 403" in str(e.value) and "argo/rbac.yaml" in str(e.value)
    assert store.read_record(RunLayout.LEDGER, Ledger) is None


@pytest.fixture
def kubeconfig(monkeypatch, tmp_path):
    """A kubeconfig naming ``url``, as ``make_api_client()`` reads it outside a pod."""
    from kubernetes import client

    def point_at(url: str) -> None:
        path = tmp_path / "kubeconfig"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "c",
                    "clusters": [{"name": "fake", "cluster": {"server": url}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
                }
            )
        )
        monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    yield point_at
    client.Configuration.set_default(None)


def test_classify_failure_exits_transient_while_the_api_cannot_answer(api, tmp_path, kubeconfig, capsys):
    from jaxrec.model.records import Ledger

    _running_gang(api)
    api.inject(READS["jobset"], *UNAVAILABLE)
    cfg, store = _gke_run(tmp_path)
    kubeconfig(api.url)
    argv = [
        "--store-root",
        cfg.storage.root,
        "--run-id",
        cfg.run_id,
        "--attempt",
        "3",
        "--jobset",
        JS,
        "--output-dir",
        str(tmp_path / "out"),
    ]
    assert classify_failure.main(argv) == 69
    err = capsys.readouterr().err
    assert f"classify-failure: cannot read JobSet {NS}/{JS}: Kubernetes API answered 503" in err
    assert store.read_record(RunLayout.LEDGER, Ledger) is None
    api.faults.clear()  # the API answers again: Argo's retry decides
    assert classify_failure.main(argv) == 0
    assert (tmp_path / "out" / "decision").read_text() == "resupervise"


def api_event(kind: str, name: str, reason: str, message: str, n: int = 0) -> dict:
    """A core/v1 Event about ``kind``/``name`` as the API returns it."""
    source = "job-controller" if kind == "Job" else "kubelet"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.17c{n:013x}", "namespace": NS},
        "involvedObject": {
            "apiVersion": "batch/v1" if kind == "Job" else "v1",
            "kind": kind,
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
        },
        "reason": reason,
        "message": message,
        "source": {"component": source},
        "firstTimestamp": ts(1),
        "lastTimestamp": ts(30),
        "count": 7,
        "type": "Warning",
        "eventTime": None,
        "reportingComponent": source,
        "reportingInstance": "",
    }


def test_unreadable_events_only_lose_their_detail(api, tmp_path):
    """Events add detail, nothing the verdict rests on: one list that cannot be read is noted, the rest stands."""
    api.put("jobsets", api_jobset(failed=False))
    api.put("pods", *(api_pod(i, code=None, phase="Pending") for i in range(4)))
    api.inject(f"/api/v1/namespaces/{NS}/events", *UNAVAILABLE)
    ev = gather_kubernetes(make_api_client(api.url), NS, JS, Evidence(backend="gke", attempt=0))
    assert len(ev.pods) == 4 and all(p.events == [] for p in ev.pods)
    assert sum(f"the events of pod {JS}-workers-0-" in n and "answered 503" in n for n in ev.notes) == 4
    cfg, store = _gke_run(tmp_path)
    store.write_record(
        RunLayout.supervision(3),
        SupervisionRecord(
            attempt=3,
            jobset=JS,
            outcome="stalled",
            stall_kind="capacity",
            reason="worker 0: unschedulable for 601 s",
            detected_at=1.0,
        ),
    )
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        None,
        api_client=make_api_client(api.url),
    )
    assert r.verdict.failure_class == "capacity" and any("events of pod" in line for line in r.verdict.evidence)


def api_job_at_failure_target(failed_pod: str, code: int) -> dict:
    """The Job once its controller decided it fails and before every pod is terminal: FailureTarget, no Failed."""
    job = api_job(failed_pod, code)
    job["status"] = {"active": 3, "failed": 1, "terminating": 3, "conditions": job["status"]["conditions"][:1]}
    return job


def test_a_job_at_failure_target_is_a_failed_gang_though_its_jobset_has_not_failed_yet(api, tmp_path):
    """JobSet reacts to Failed only; Failed waits for every pod to be terminal. The Job's FailureTarget decides."""
    _running_gang(api)
    failed = api_pod(2, code=42, at=20)
    api.put("pods", failed)  # replaces worker 2's pod (the same name)
    api.put("jobs", api_job_at_failure_target(failed["metadata"]["name"], 42))
    cfg, store = _gke_run(tmp_path)
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        None,
        api_client=make_api_client(api.url),
    )
    assert r.decision.decision == "retry" and r.verdict.failure_class == "application", r.verdict.reason
    assert r.verdict.first_worker == 2
    assert any(
        line.startswith(f"Job {JS}-workers-0 FailureTarget at 10:00:10Z: PodFailurePolicy: Container trainer")
        for line in r.verdict.evidence
    )


PSA_REFUSAL = (
    f'Error creating: pods "{JS}-workers-0-0-x8k2p" is forbidden: violates PodSecurity "baseline:latest": '
    'hostPath volumes (volume "tpu-dev")'
)
WEBHOOK_REFUSAL = (
    'Error creating: admission webhook "validation.gatekeeper.sh" denied the request: [allowed-repos] '
    "container <trainer> has an invalid image repo <gcr.io/p/trainer:1>"
)
QUOTA_REFUSAL = (
    f'Error creating: pods "{JS}-workers-0-0-x8k2p" is forbidden: exceeded quota: tpu-quota, requested: '
    "google.com/tpu=4, used: google.com/tpu=16, limited: google.com/tpu=16"
)


def _never_started(api: FakeCluster, message: str, *, stopped: bool) -> SupervisionRecord:
    """A gang whose pods the API refused: the supervisor's capacity stall; ``stopped``: its stop deleted the gang."""
    from jaxrec.model.snapshot import ClusterSnapshot, job_from_api, jobset_from_api

    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "status": {"active": 0, "ready": 0, "terminating": 0},
        "metadata": {"name": f"{JS}-workers-0", "namespace": NS, "labels": {JS_LABEL: JS}},
    }
    api.put("events", api_event("Job", f"{JS}-workers-0", "FailedCreate", message))
    if not stopped:
        api.put("jobsets", api_jobset(failed=False))
        api.put("jobs", copy.deepcopy(job))
    snap = ClusterSnapshot(taken_at=1.0, jobset=jobset_from_api(api_jobset(failed=False)), jobs=[job_from_api(job)])
    return SupervisionRecord(
        attempt=3,
        jobset=JS,
        outcome="stalled",
        stall_kind="capacity",
        detected_at=1.0,
        reason="only 0/4 worker pods exist after 601 s (deadline 600 s)",
        snapshot=snap,
    )


@pytest.mark.parametrize("stopped", [True, False], ids=["after-the-stop", "before-the-stop"])
@pytest.mark.parametrize(
    ("message", "cls", "says"),
    [
        (PSA_REFUSAL, "configuration", "Pod Security admission (baseline:latest) forbids them"),
        (WEBHOOK_REFUSAL, "configuration", "admission webhook validation.gatekeeper.sh denied them"),
        (QUOTA_REFUSAL, "capacity", "ResourceQuota tpu-quota is spent"),
    ],
    ids=["pod-security", "webhook", "quota"],
)
def test_a_gang_whose_pods_the_api_refused_is_classified_from_its_jobs_events(
    api, tmp_path, message, cls, says, stopped
):
    cfg, store = _gke_run(tmp_path)
    store.write_record(RunLayout.supervision(3), _never_started(api, message, stopped=stopped))
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        None,
        api_client=make_api_client(api.url),
    )
    assert r.verdict.failure_class == cls, r.verdict.reason
    assert (
        r.verdict.reason.startswith(f"Job {JS}-workers-0 could not create its worker pods: ")
        and says in r.verdict.reason
    )
    assert f"Job {JS}-workers-0: FailedCreate: {message}" in r.verdict.evidence
    assert any("involvedObject.kind%3DJob" in q or "involvedObject.kind=Job" in q for _, q, _ in api.requests)


def test_the_pull_failure_of_a_pod_torn_down_before_it_ran_is_read_from_its_events(api, tmp_path):
    """The kubelet's placeholder (exit 137, ContainerStatusUnknown) says nothing; the pod's events say why."""
    api.put("jobsets", api_jobset())
    pods = [api_pod(i, code=137, at=12, reason="ContainerStatusUnknown") for i in range(4)]
    image = "gcr.io/p/trainer:typo"
    for p in pods:
        term = p["status"]["containerStatuses"][0]["state"]["terminated"]
        term.pop("startedAt"), term.pop("containerID")
        term["message"] = "The container could not be located when the pod was terminated"
        api.put(
            "events",
            api_event(
                "Pod",
                p["metadata"]["name"],
                "Failed",
                f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to pull '
                f'and unpack image "{image}": failed to resolve reference "{image}": {image}: '
                "not found",
            ),
        )
    api.put("pods", *pods)
    cfg, _ = _gke_run(tmp_path)
    r = classify_failure.run(
        classify_failure.ClosingAttempt(AttemptRef(cfg.storage.root, cfg.run_id, 3), JS),
        None,
        api_client=make_api_client(api.url),
    )
    assert r.verdict.failure_class == "configuration", r.verdict.reason
    assert "never ran: its image cannot be pulled" in r.verdict.reason
