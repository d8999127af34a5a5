"""The Kubernetes evidence adapter against a fake API server at its HTTP boundary, and classify-failure on GKE."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from fake_http import JsonServer

from recovery_steps import classify_failure
from recovery_steps.classify import classify
from recovery_steps.evidence import Evidence, gather_kubernetes, gather_reports
from recovery_steps.kernel.config import parse_config
from recovery_steps.kernel.contract import FailureClass
from recovery_steps.kernel.k8s import make_api_client
from recovery_steps.kernel.records import WorkerExitReport
from recovery_steps.kernel.store import RunLayout, RunStore

NS = "training"
JS = "llm-a3"
JS_LABEL = "jobset.sigs.k8s.io/jobset-name"


class FakeApi:
    """Answers the API paths the adapter reads, with bodies shaped as the API server returns them."""

    def __init__(self):
        self.jobsets: dict[str, dict] = {}
        self.jobs: list[dict] = []
        self.pods: list[dict] = []
        self.nodes: dict[str, dict] = {}
        self.events: list[dict] = []
        self.requests: list[str] = []
        self.http = JsonServer(self._route)
        self.url = self.http.url

    def _route(self, method: str, raw: str, body: dict) -> tuple[int, dict]:
        self.requests.append(raw)
        return self.answer(raw)

    def close(self):
        self.http.close()

    @staticmethod
    def _not_found(kind: str, name: str) -> tuple[int, dict]:
        return 404, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": f'{kind} "{name}" not found', "reason": "NotFound",
                     "details": {"name": name, "kind": kind}, "code": 404}  # fmt: skip

    @staticmethod
    def _select(items: list[dict], query: dict) -> list[dict]:
        sel = query.get("labelSelector", [""])[0]
        if not sel:
            return items
        k, v = sel.split("=", 1)
        return [i for i in items if i["metadata"].get("labels", {}).get(k) == v]

    def answer(self, raw: str) -> tuple[int, dict]:
        u = urlparse(raw)
        q = parse_qs(u.query)
        parts = u.path.strip("/").split("/")
        if u.path.startswith(f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/"):
            name = parts[-1]
            return (200, self.jobsets[name]) if name in self.jobsets else self._not_found("jobsets", name)
        if u.path == f"/apis/batch/v1/namespaces/{NS}/jobs":
            return 200, {"apiVersion": "batch/v1", "kind": "JobList", "metadata": {"resourceVersion": "7"},
                         "items": self._select(self.jobs, q)}  # fmt: skip
        if u.path == f"/api/v1/namespaces/{NS}/pods":
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "7"},
                         "items": self._select(self.pods, q)}  # fmt: skip
        if u.path.startswith("/api/v1/nodes/"):
            name = parts[-1]
            return (200, self.nodes[name]) if name in self.nodes else self._not_found("nodes", name)
        if u.path == f"/api/v1/namespaces/{NS}/events":
            fields = dict(f.split("=", 1) for f in q.get("fieldSelector", [""])[0].split(",") if f)
            items = [e for e in self.events if e["involvedObject"]["name"] == fields.get("involvedObject.name")]
            return 200, {"apiVersion": "v1", "kind": "EventList", "metadata": {}, "items": items}
        return 404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}


def ts(sec: int) -> str:
    return f"2024-05-01T10:00:{sec:02d}Z"


def api_pod(i: int, *, code: int | None, at: int | None = None, reason: str = "Error", disruption: str | None = None,
            phase: str = "Failed", node: str | None = None) -> dict:  # fmt: skip
    name = f"{JS}-workers-0-{i}-q{i}x7z"
    if code is not None:
        state = {"terminated": {"exitCode": code, "reason": reason, "startedAt": ts(0), "finishedAt": ts(at),
                                "containerID": f"containerd://{i:064d}"}}  # fmt: skip
    elif phase == "Pending":
        state = {"waiting": {"reason": "ContainerCreating"}}
    else:
        state = {"running": {"startedAt": ts(0)}}
    spec = {"restartPolicy": "Never", "containers": [{"name": "trainer", "image": "gcr.io/p/trainer:1"}]}
    if phase != "Pending":
        spec["nodeName"] = node or f"gke-tpu-pool-{i}"
    conditions = [{"type": "Ready", "status": "False", "lastProbeTime": None, "lastTransitionTime": ts(at or 0),
                   "reason": "PodFailed"}]  # fmt: skip
    if phase == "Pending":
        conditions = [{"type": "PodScheduled", "status": "False", "lastProbeTime": None,
                       "lastTransitionTime": ts(0), "reason": "Unschedulable",
                       "message": "0/8 nodes are available: 8 Insufficient google.com/tpu."}]  # fmt: skip
    if disruption:
        conditions.append({"type": "DisruptionTarget", "status": "True", "lastProbeTime": None,
                           "lastTransitionTime": ts(at or 0), "reason": disruption,
                           "message": "Pod was terminated in response to imminent node shutdown."})  # fmt: skip
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
        },  # fmt: skip
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
        },  # fmt: skip
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
        "status": {"conditions": [
            {"type": "MemoryPressure", "status": "False", "lastHeartbeatTime": ts(0), "lastTransitionTime": ts(0),
             "reason": "KubeletHasSufficientMemory", "message": "kubelet has sufficient memory available"},
            {"type": "Ready", "status": ready, "lastHeartbeatTime": ts(9), "lastTransitionTime": ts(9),
             "reason": "KubeletReady" if ready == "True" else "KubeletNotReady",
             "message": "kubelet is posting ready status" if ready == "True" else "node is shutting down"},
        ]},
    }  # fmt: skip


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
        },  # fmt: skip
    }


def api_job(failed_pod: str, code: int) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{JS}-workers-0", "namespace": NS, "labels": {JS_LABEL: JS}},
        "status": {"failed": 1, "conditions": [
            {"type": "FailureTarget", "status": "True", "reason": "PodFailurePolicy", "lastTransitionTime": ts(10),
             "message": f"Container trainer for pod {NS}/{failed_pod} failed with exit code {code} matching "
                        "FailJob rule at index 5"},
            {"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "lastTransitionTime": ts(10),
             "message": f"Container trainer for pod {NS}/{failed_pod} failed with exit code {code} matching "
                        "FailJob rule at index 5"},
        ]},
    }  # fmt: skip


@pytest.fixture
def api():
    a = FakeApi()
    yield a
    a.close()


def spot_preemption(api: FakeApi) -> None:
    api.jobsets[JS] = api_jobset()
    api.pods = [api_pod(0, code=143, at=12), api_pod(1, code=143, at=10, disruption="TerminationByKubelet"),
                api_pod(2, code=143, at=12), api_pod(3, code=143, at=12)]  # fmt: skip
    api.jobs = [api_job(api.pods[1]["metadata"]["name"], 143)]
    api.nodes = {f"gke-tpu-pool-{i}": api_node(f"gke-tpu-pool-{i}", spot=True) for i in range(4)}
    api.nodes["gke-tpu-pool-1"] = api_node(
        "gke-tpu-pool-1", ready="False", spot=True,
        taints=[{"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"}],
    )  # fmt: skip
    # A pod of another JobSet in the namespace must not be read as evidence.
    other = api_pod(0, code=42, at=1)
    other["metadata"]["labels"][JS_LABEL] = "someone-else"
    api.pods.append(other)


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
    api.jobsets[JS] = api_jobset(failed=False)
    api.pods = [api_pod(i, code=None, phase="Pending") for i in range(4)]
    api.events = [{"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"e{i}", "namespace": NS},
                   "involvedObject": {"kind": "Pod", "name": p["metadata"]["name"], "namespace": NS},
                   "reason": "FailedScheduling", "type": "Warning", "count": 14,
                   "message": "0/8 nodes are available: 8 Insufficient google.com/tpu. preemption: not eligible"}
                  for i, p in enumerate(api.pods)]  # fmt: skip
    ev = gather_kubernetes(make_api_client(api.url), NS, JS, Evidence(backend="gke", attempt=0))
    assert all(p.events and p.events[0].startswith("FailedScheduling") for p in ev.pods)
    v = classify(ev)
    assert v.failure_class is FailureClass.CAPACITY
    assert "Insufficient google.com/tpu" in v.reason


def test_missing_jobset_is_noted_and_reports_still_classify(api, tmp_path):
    store = RunStore(str(tmp_path), "r")
    rep = WorkerExitReport(run_id="r", attempt=0, process_index=2, process_count=4, exit_code=21, exit_name="HANG",
                           ended_at=1714557700.0, last_step=90)  # fmt: skip
    store.write_json(RunLayout.worker_report(0, 2), rep.model_dump(mode="json"))
    ev = Evidence(backend="gke", attempt=0)
    gather_reports(store, 0, ev)
    gather_kubernetes(make_api_client(api.url), NS, JS, ev)
    assert ev.jobset is not None and not ev.jobset.found
    assert any("not found" in n for n in ev.notes)
    assert classify(ev).failure_class is FailureClass.HANG


def test_unreachable_api_is_noted_not_fatal():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ev = gather_kubernetes(make_api_client(f"http://127.0.0.1:{port}"), NS, JS, Evidence(backend="gke", attempt=0))
    assert any("not fully readable" in n for n in ev.notes)
    assert classify(ev).failure_class is FailureClass.UNKNOWN


def tpu_config(root: str):
    return parse_config({"run_id": "llm", "namespace": NS, "image": "gcr.io/p/trainer:1",
                         "slice": {"accelerator": "v5e", "topology": "4x4", "spot": True},
                         "storage": {"root": root, "durable_mount": True}})  # fmt: skip


def test_classify_failure_on_gke_backend(api, tmp_path, capsys):
    spot_preemption(api)
    cfg = tpu_config(str(tmp_path / "store"))
    store = RunStore.for_config(cfg)
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})
    out = tmp_path / "out"
    r = classify_failure.run(cfg.storage.root, cfg.run_id, 3, JS, out, api_client=make_api_client(api.url))
    assert r.evidence.backend == "gke"
    assert (out / "failure-class").read_text() == "preemption"
    assert (out / "decision").read_text() == "retry"
    assert (out / "next-attempt").read_text() == "4"
    assert json.loads((out / "attempts-by-class").read_text())["preemption"] == 1
    rec = store.read_json(RunLayout.attempt_record(3))
    assert rec["failure_class"] == "preemption" and rec["jobset"] == JS
    assert Path(store.url(RunLayout.LEDGER)).exists()


@pytest.mark.parametrize("in_pod", [False, True], ids=["local-runner", "in-a-pod"])
def test_a_cpu_slice_is_classified_from_the_cluster_when_its_steps_run_in_pods(api, tmp_path, monkeypatch, in_pod):
    """The CPU slice on a cluster (``argo/local-cpu.yaml`` submitted there) has a JobSet and pods to read; only the
    local runner's attempts are classified from its own records."""
    spot_preemption(api)
    cfg = parse_config({"run_id": "cpu", "namespace": NS, "image": "trainer:local",
                        "slice": {"accelerator": "local", "hosts": 4},
                        "storage": {"root": str(tmp_path / "store")}})  # fmt: skip
    if in_pod:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    store = RunStore.for_config(cfg)
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})
    r = classify_failure.run(cfg.storage.root, cfg.run_id, 3, JS, tmp_path / "out", api_client=make_api_client(api.url))
    assert r.evidence.backend == ("gke" if in_pod else "local")
    assert (len(r.evidence.pods) > 0) is in_pod
    assert (r.verdict.failure_class is FailureClass.PREEMPTION) is in_pod


def _failed_attempt_snapshot(code: int):
    from recovery_steps.kernel.snapshot import ClusterSnapshot, job_from_api, node_from_api, pod_from_api

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


@pytest.mark.parametrize(("code", "cls"), [(42, FailureClass.APPLICATION), (2, FailureClass.CONFIGURATION),
                                           (20, FailureClass.INFRASTRUCTURE), (21, FailureClass.HANG)])  # fmt: skip
def test_the_supervisors_snapshot_is_the_evidence_when_its_stop_left_nothing_in_the_api(code, cls):
    from recovery_steps.evidence import use_supervisor_snapshot
    from recovery_steps.kernel.records import SupervisionRecord

    sup = SupervisionRecord(attempt=3, jobset=JS, outcome="failed", reason="FailureTarget", detected_at=2.0,
                            snapshot=_failed_attempt_snapshot(code))  # fmt: skip
    empty = Evidence(backend="gke", attempt=3, supervision=sup)
    assert classify(empty.model_copy(update={"supervision": sup.model_copy(update={"snapshot": None})}))\
        .failure_class == FailureClass.UNKNOWN  # fmt: skip
    ev = use_supervisor_snapshot(empty)
    assert len(ev.pods) == 4 and any("before its stop" in n for n in ev.notes)
    assert classify(ev).failure_class == cls


def test_pods_the_api_still_has_win_over_the_snapshot():
    from recovery_steps.evidence import use_supervisor_snapshot
    from recovery_steps.kernel.records import SupervisionRecord
    from recovery_steps.kernel.snapshot import PodEvidence

    sup = SupervisionRecord(attempt=3, jobset=JS, outcome="failed", reason="x", detected_at=2.0,
                            snapshot=_failed_attempt_snapshot(42))  # fmt: skip
    live = [PodEvidence(name="still-here", worker_index=0, phase="Failed")]
    ev = use_supervisor_snapshot(Evidence(backend="gke", attempt=3, supervision=sup, pods=live))
    assert [p.name for p in ev.pods] == ["still-here"] and not ev.notes


def _running_gang(api: FakeApi) -> None:
    api.jobsets[JS] = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                       "metadata": {"name": JS, "namespace": NS}, "status": {"replicatedJobsStatus": []}}  # fmt: skip
    api.pods = [api_pod(i, code=None, phase="Running") for i in range(4)]


def _gke_run(tmp_path):
    cfg = tpu_config(str(tmp_path / "store"))
    store = RunStore.for_config(cfg)
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})
    return cfg, store


def test_a_running_gang_whose_supervisor_left_no_verdict_is_supervised_again_not_closed(api, tmp_path):
    from recovery_steps.kernel.records import Ledger, SupervisionRecord, SupervisorLosses

    _running_gang(api)
    cfg, store = _gke_run(tmp_path)
    out = tmp_path / "out"
    r = classify_failure.run(cfg.storage.root, cfg.run_id, 3, JS, out, api_client=make_api_client(api.url))
    assert (out / "decision").read_text() == "resupervise" and "supervisor was lost" in (out / "reason").read_text()
    # The attempt is not closed: no ledger entry, no budget spent; the loss is counted.
    assert store.read_record(RunLayout.LEDGER, Ledger) is None
    assert len(store.read_record(RunLayout.supervisor_losses(3), SupervisorLosses).at) == 1
    assert r.decision.decision == "resupervise"
    # A supervisor that left transient (69) decided nothing either; one that recorded a verdict did.
    store.write_record(RunLayout.supervision(3), SupervisionRecord(attempt=3, jobset=JS, outcome="error",
                                                                   exit_code=69, reason="API 503",
                                                                   detected_at=1.0))  # fmt: skip
    assert classify_failure.run(cfg.storage.root, cfg.run_id, 3, JS, None,
                                api_client=make_api_client(api.url)).decision.decision == "resupervise"  # fmt: skip
    store.write_record(RunLayout.supervision(3), SupervisionRecord(attempt=3, jobset=JS, outcome="stalled",
                                                                   stall_kind="hang", reason="no step",
                                                                   detected_at=1.0))  # fmt: skip
    r = classify_failure.run(cfg.storage.root, cfg.run_id, 3, JS, None, api_client=make_api_client(api.url))
    assert r.decision.decision == "retry" and r.verdict.failure_class == "hang"


def test_a_supervisor_lost_again_and_again_closes_the_attempt(api, tmp_path):
    from recovery_steps.kernel.records import Ledger, SupervisorLosses

    _running_gang(api)
    cfg, store = _gke_run(tmp_path)
    losses = SupervisorLosses(attempt=3, at=[1.0] * classify_failure.MAX_SUPERVISOR_LOSSES)
    store.write_record(RunLayout.supervisor_losses(3), losses)
    r = classify_failure.run(cfg.storage.root, cfg.run_id, 3, JS, None, api_client=make_api_client(api.url))
    assert r.decision.decision != "resupervise"
    assert [a.attempt for a in store.read_record(RunLayout.LEDGER, Ledger).attempts] == [3]
    assert any("lost 10 times" in n for n in r.evidence.notes)


def test_a_finished_or_missing_jobset_is_never_resupervised(api, tmp_path):
    cfg, _ = _gke_run(tmp_path)
    spot_preemption(api)  # the JobSet failed
    r = classify_failure.run(cfg.storage.root, cfg.run_id, 3, JS, None, api_client=make_api_client(api.url))
    assert r.decision.decision == "retry"
    api.jobsets.clear()
    r = classify_failure.run(cfg.storage.root, cfg.run_id, 4, JS, None, api_client=make_api_client(api.url))
    assert r.decision.decision != "resupervise"
