"""The shipped Workflow (argo/v5e-4x4.yaml, unchanged but for ``argo submit -p store-root=...``) on the real Argo
workflow-controller (v4.0.5), against the real API server, Job and JobSet controllers, scheduler and webhooks.

Every step pod runs its real step program as a local process (``podexec``, a simulated kubelet: it also writes the
WorkflowTaskResult Argo's wait container would write). The JobSet's worker pods stay on KWOK (simulated): a test
makes a worker exit with a code (``exit_pod``) and writes the heartbeats the trainer would write. What follows is
decided by the real controllers: retryStrategy expressions, ``depends`` and ``when``, parameter passing, the nested
attempt DAG, the exit handler and the run mutex, and by the project's steps under the project's RBAC.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import argoctl
import pytest
import yaml
from argoctl import ARGO_FILE
from realcluster import RealCluster, netns_listeners, wait_for
from tier import HOSTS, INDEX, REPO, apply_rbac

from recovery_steps.kernel.config import JobConfig, load_config
from recovery_steps.kernel.names import jobset_name
from recovery_steps.kernel.records import Ledger, SupervisionRecord, WorkerHeartbeat
from recovery_steps.kernel.store import RunLayout, RunStore

pytestmark = pytest.mark.k8s

# How long after its start the supervisor's node is evicted. Argo v4.0.5 treats a pod that vanishes within
# RECENTLY_STARTED_POD_DURATION (10 s) of its node's start as not yet synced and creates it again for the same node
# (workflow/controller/operator.go podReconciliation, ``recentlyStarted``); later, the node is Error "pod deleted"
# and the retryStrategy decides. The shipped train-segment retryStrategy has no maxDuration (asserted below), so
# no age of the segment makes Argo refuse the retry.
RAN_LONGER_S = 15


@dataclass
class ArgoRun:
    """One submission of the shipped Workflow with a run store of the test's own."""

    rc: RealCluster
    cfg: JobConfig
    store_root: Path
    name: str = ""

    @property
    def ns(self) -> str:
        return self.cfg.namespace

    @property
    def store(self) -> RunStore:
        return RunStore(str(self.store_root), self.cfg.run_id)

    def submit(self) -> str:
        wf = argoctl.submit(self.rc, REPO / "argo" / ARGO_FILE, {"store-root": str(self.store_root)})
        self.name = wf["metadata"]["name"]
        return self.name

    def wf(self) -> dict[str, Any]:
        return argoctl.workflow(self.rc, self.ns, self.name)

    def wait_done(self, timeout: float) -> dict[str, Any]:
        return argoctl.wait_finished(self.rc, self.ns, self.name, timeout)

    def workers(self, attempt: int, timeout: float = 180) -> list[dict[str, Any]]:
        """The attempt's worker pods once all are Running (by completion index)."""
        sel = f"jobset.sigs.k8s.io/jobset-name={jobset_name(self.cfg.run_id, attempt)}"

        def running():
            pods = [p for p in self.rc.pods(self.ns, sel) if p["status"].get("phase") == "Running"]
            return sorted(pods, key=lambda p: int(p["metadata"]["labels"][INDEX])) if len(pods) >= HOSTS else None

        try:
            return wait_for(f"{HOSTS} worker pods Running of attempt {attempt}", running, timeout, 0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{argoctl.summary(self.wf())}") from None

    def beat(self, attempt: int, step: int, checkpoint: int | None = None) -> None:
        """Every worker's heartbeat at ``step`` (what the trainer writes to the run store)."""
        t = time.time()
        for i in range(HOSTS):
            b = WorkerHeartbeat(process_index=i, step=step, checkpoint_step=checkpoint, at=t, first_step_at=t)
            self.store.write_json(RunLayout.heartbeat(attempt, i), b.model_dump())

    def ledger(self) -> Ledger:
        return Ledger.model_validate(self.store.read_json(RunLayout.LEDGER))

    def exit_all(self, attempt: int, code: int) -> None:
        for p in self.workers(attempt):
            self.rc.exit_pod(self.ns, p["metadata"]["name"], code)


@pytest.fixture
def argo_run(real_cluster: RealCluster, argo, tpu_nodes, tmp_path) -> Iterator[ArgoRun]:
    """The shipped config's RBAC applied in its namespace, a TPU node pool for its slice, a store of the test's
    own; every Workflow, JobSet and pod of the namespace deleted afterwards."""
    cfg = load_config(REPO / "configs" / "v5e-4x4.yaml")
    apply_rbac(real_cluster, cfg)
    tpu_nodes(HOSTS, cfg)
    r = ArgoRun(real_cluster, cfg, tmp_path / "store")
    try:
        yield r
    finally:
        _clean(real_cluster, cfg.namespace)


def _clean(rc: RealCluster, ns: str) -> None:
    from kubernetes import client

    objs = client.CustomObjectsApi(rc.admin)
    for group, version, plural in (
        ("argoproj.io", "v1alpha1", "workflows"),
        ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    ):
        objs.delete_collection_namespaced_custom_object(group, version, ns, plural)
    wait_for(f"no pods left in {ns}", lambda: not rc.pods(ns), 90, 0.5)


def test_the_controller_listens_only_inside_its_own_network_namespace(real_cluster, argo):
    """Argo v4.0.5 binds its health server to ``:6060`` (all interfaces, hard-coded): it is inside a network
    namespace whose only interface is loopback, so nothing outside this machine's test process can reach it."""
    pid = argo.proc.pid
    assert argoctl.netns_of(pid) != argoctl.netns_of("self")
    with open(f"/proc/{pid}/net/dev") as f:
        interfaces = [line.split(":")[0].strip() for line in f.read().splitlines()[2:]]
    assert interfaces == ["lo"], interfaces
    inside = netns_listeners(pid)
    assert any(port == 6060 for _, port in inside), inside  # the listener this design exists for is there
    assert (("127.0.0.1", argo.forwarder.port)) in inside
    real_cluster.check_alive()


def test_app_bug_fails_the_workflow_with_class_application_once_its_budget_is_spent(argo_run):
    """README scenario ``app-bug``: an exception in the training step on every attempt (exit 42, podFailurePolicy
    FailJob) -> Failed with class ``application`` once its budget (1) is spent; train-segment is never retried."""
    t0 = time.monotonic()
    argo_run.submit()
    for attempt in (0, 1):
        pods = argo_run.workers(attempt)
        argo_run.rc.exit_pod(argo_run.ns, pods[1]["metadata"]["name"], 42)
    wf = argo_run.wait_done(300)
    report = argoctl.summary(wf)
    assert wf["status"]["phase"] == "Failed", report
    verdicts = [argoctl.outputs(n) for n in argoctl.pods_of(wf, "classify-failure")]
    assert [(v["failure-class"], v["decision"]) for v in verdicts] == [
        ("application", "retry"),
        ("application", "stop"),
    ], report
    segments = argoctl.pods_of(wf, "train-segment")
    assert [n["outputs"]["exitCode"] for n in segments] == ["1", "1"], report  # the verdict: no Argo retry
    assert [argoctl.outputs(n)["outcome"] for n in segments] == ["failed", "failed"], report
    (give_up,) = argoctl.pods_of(wf, "give-up")
    assert give_up["phase"] == "Failed", report
    (final,) = argoctl.pods_of(wf, "exit-handler")
    assert argoctl.outputs(final)["final-status"] == "Failed", report
    ledger = argo_run.ledger()
    assert [(a.attempt, a.failure_class, a.decision) for a in ledger.attempts] == [
        (0, "application", "retry"),
        (1, "application", "stop"),
    ]
    assert ledger.final_status == "Failed"
    print(f"app-bug on the real controller: {time.monotonic() - t0:.0f} s\n{report}")


# README scenario -> what the worker pods report (KWOK: the exit code of the trainer's container), the class
# classify-failure gives it.
RECOVERABLE = {
    # SIGKILL of one worker: 137 has no podFailurePolicy rule, so backoffLimit 0 fails the Job.
    "kill-worker": ("one", 137, "infrastructure"),
    # SIGTERM to every worker, state saved in the shutdown window: exit 143 (FailJob rule).
    "preempt": ("all", 143, "preemption"),
}


@pytest.mark.parametrize("scenario", sorted(RECOVERABLE))
def test_a_recoverable_failure_is_a_new_attempt_and_the_run_succeeds(argo_run, scenario):
    """README scenarios ``kill-worker`` and ``preempt``: the supervisor ends attempt 0 (exit 1, not retried by
    Argo), classify-failure decides ``retry``, the nested attempt DAG runs provision-slice, restore-latest and
    train-segment for attempt 1, whose gang completes: the Workflow Succeeds and the exit handler says so."""
    who, code, cls = RECOVERABLE[scenario]
    t0 = time.monotonic()
    argo_run.submit()
    pods = argo_run.workers(0)
    argo_run.beat(0, 5)
    for p in pods if who == "all" else pods[2:3]:
        argo_run.rc.exit_pod(argo_run.ns, p["metadata"]["name"], code)
    argo_run.workers(1)
    argo_run.beat(1, 12)
    argo_run.exit_all(1, 0)
    wf = argo_run.wait_done(300)
    report = argoctl.summary(wf)
    assert wf["status"]["phase"] == "Succeeded", report
    verdicts = [argoctl.outputs(n) for n in argoctl.pods_of(wf, "classify-failure")]
    assert [(v["failure-class"], v["decision"], v["next-attempt"]) for v in verdicts] == [(cls, "retry", "1")], report
    segments = argoctl.pods_of(wf, "train-segment")
    assert [(n["outputs"]["exitCode"], argoctl.outputs(n)["outcome"]) for n in segments] == [
        ("1", "failed"),
        ("0", "succeeded"),
    ], report
    assert [argoctl.outputs(n)["restore-step"] for n in argoctl.pods_of(wf, "restore-latest")] == ["-1", "-1"], report
    (final,) = argoctl.pods_of(wf, "exit-handler")
    assert argoctl.outputs(final)["final-status"] == "Succeeded", report
    ledger = argo_run.ledger()
    assert [(a.attempt, a.outcome, a.failure_class) for a in ledger.attempts] == [
        (0, "failed", cls),
        (1, "succeeded", None),
    ]
    assert ledger.final_status == "Succeeded"
    print(f"{scenario} on the real controller: {time.monotonic() - t0:.0f} s\n{report}")


def _supervisor_pod(r: ArgoRun, not_uid: str = "") -> dict[str, Any]:
    """A Running pod of train-segment (any try) other than ``not_uid``."""

    def running():
        for p in r.rc.pods(r.ns, f"workflows.argoproj.io/workflow={r.name}"):
            node = (p["metadata"].get("annotations") or {}).get("workflows.argoproj.io/node-name", "")
            if ".train-segment(" in node and p["status"].get("phase") == "Running" and p["metadata"]["uid"] != not_uid:
                return p
        return None

    return wait_for("a train-segment pod Running" + (" after the lost one" if not_uid else ""), running, 180, 0.5)


def lose_supervisor(r: ArgoRun) -> dict[str, Any]:
    """Evict the Running train-segment pod (the Eviction API, as a node drain does) once the controller has had its
    node Running longer than RAN_LONGER_S; wait until its retry runs. The evicted pod."""
    from kubernetes import client

    first = _supervisor_pod(r)
    node = wait_for(
        "train-segment Running in the Workflow",
        lambda: next((n for n in argoctl.pods_of(r.wf(), "train-segment") if n["phase"] == "Running"), None),
        60,
        0.5,
    )
    started = datetime.strptime(node["startedAt"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    time.sleep(max(0.0, started + RAN_LONGER_S - time.time()))
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=first["metadata"]["name"], namespace=r.ns))
    r.rc.core().create_namespaced_pod_eviction(first["metadata"]["name"], r.ns, body)
    _supervisor_pod(r, not_uid=first["metadata"]["uid"])
    return first


def test_supervisor_lost_an_evicted_supervisor_is_retried_and_reattaches_to_the_running_gang(argo_run):
    """README scenario ``supervisor-lost``, the way a node drain does it: the train-segment pod is evicted
    (Eviction API: SIGTERM, exit 143) once the controller has had it Running longer than RAN_LONGER_S. Argo
    retries the step (Error "pod deleted", or Failed 143: neither is the supervisor's verdict), the new supervisor
    re-attaches to the same JobSet, the gang keeps training (same worker pods) and no attempt is closed; the run
    Succeeds on attempt 0."""
    wf = yaml.safe_load((REPO / "argo" / ARGO_FILE).read_text())
    segment = next(t for t in wf["spec"]["templates"] if t["name"] == "train-segment")
    assert "maxDuration" not in segment["retryStrategy"]  # a retry is never refused for the segment's age
    argo_run.submit()
    workers = argo_run.workers(0)
    argo_run.beat(0, 5)
    lose_supervisor(argo_run)
    argo_run.beat(0, 15)
    assert [p["metadata"]["uid"] for p in argo_run.workers(0)] == [p["metadata"]["uid"] for p in workers]
    argo_run.exit_all(0, 0)
    wf = argo_run.wait_done(300)
    report = argoctl.summary(wf)
    assert wf["status"]["phase"] == "Succeeded", report
    *lost, last = argoctl.pods_of(wf, "train-segment")
    # The kubelet reports the SIGTERMed supervisor Failed (exit 143), then the pod is removed: the controller
    # retries a node it saw Failed 143, or Error "pod deleted" when the removal came first.
    assert [(n["phase"], (n.get("outputs") or {}).get("exitCode")) for n in lost] in (
        [("Failed", "143")],
        [("Error", None)],
    ), report
    assert (last["phase"], last["outputs"]["exitCode"]) == ("Succeeded", "0"), report
    assert not argoctl.pods_of(wf, "classify-failure"), report
    rec = SupervisionRecord.model_validate(argo_run.store.read_json(RunLayout.supervision(0)))
    assert rec.outcome == "succeeded" and rec.reattached, rec
    ledger = argo_run.ledger()
    assert [(a.attempt, a.outcome) for a in ledger.attempts] == [(0, "succeeded")], ledger
    print(f"supervisor-lost on the real controller: retried after {lost[0]['phase']} ({lost[0].get('message')})")
