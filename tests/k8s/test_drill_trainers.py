"""``python -m workflows.drill``'s code against the real controllers with real trainers: the drill submits
argo/local-cpu.yaml (``-p run-id``, ``-p store-root`` on the GCS emulator; its job on two hosts, 30 steps, a
checkpoint every 5, as the chaos runs'), waits until the gang of real
trainers has passed its step, injects the failure itself, and measures the incident from the run store. Nothing in
the test plays the trainer: heartbeats, checkpoints, exit codes and exit reports are the workers' own.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import argoctl
import pytest
from argoctl import LOCAL_ARGO_FILE
from realcluster import RealCluster, wait_for
from tier import REPO, CpuHosts, CpuHostsPools, kube_exec, worker_like_pod
from trainers import BUCKET, CHAOS_HOSTS, CHAOS_STEPS, chaos_shape, final_digest, final_reports, with_local_tier

from jaxrec.adapters.documents import read_ledger
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.names import NODEPOOL_LABEL
from jaxrec.model.records import SupervisionRecord
from workflows import drill

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


class TrainerDrill:
    """One drill of the local file with a run id and a GCS prefix of its own."""

    def __init__(self, rc: RealCluster, hosts: CpuHosts, bucket: str):
        self.rc, self.hosts = rc, hosts
        self.run_id = f"drill-{uuid.uuid4().hex[:6]}"
        root = f"gs://{bucket}/{self.run_id}"
        params = [f"store-root={root}", f"run-id={self.run_id}"]
        self.target = drill.load_target(REPO / "argo" / LOCAL_ARGO_FILE, params, None)
        # The file's job on two hosts, 30 steps, a checkpoint every 5 (the chaos runs' shape): the drill finds a gang
        # of two as it finds one of four, at half the start-up; test_argo_trainer runs the file as shipped.
        argoctl.edit_carried_config(self.target.doc, chaos_shape)
        self.store = RunStore(root, self.run_id)
        self.lines: list[str] = []

    def run(self, fault: drill.Fault, after_step: int, after_checkpoint: int | None = None) -> drill.DrillResult:
        cluster = drill.Cluster(self.rc.admin, self.target.namespace)
        t0 = time.monotonic()
        injection = drill.Injection(fault, after_step, after_checkpoint)
        res = drill.run_drill(cluster, self.target, injection, timeout_s=200, store=self.store, say=self.lines.append)
        print("\n".join([*self.lines, *drill.measures_table(res.incidents), f"{time.monotonic() - t0:.0f} s"]))
        return res

    def supervision(self, attempt: int) -> SupervisionRecord:
        return SupervisionRecord.model_validate(self.store.read_json(RunLayout.supervision(attempt)))


@pytest.fixture
def trainer_drill(real_cluster: RealCluster, cpu_hosts: CpuHosts, gcs_emulator) -> Iterator[TrainerDrill]:
    """A drill of its own; afterwards its Workflows and JobSets are deleted and every node is schedulable again."""
    gcs_emulator.create_bucket(BUCKET)
    d = TrainerDrill(real_cluster, cpu_hosts, BUCKET)
    try:
        yield d
    finally:
        from kubernetes import client

        objs = client.CustomObjectsApi(real_cluster.admin)
        sel = f"jaxrec/run-id={d.run_id}"
        ns = d.target.namespace
        kinds = (("argoproj.io", "v1alpha1", "workflows"), ("jobset.x-k8s.io", "v1alpha2", "jobsets"))
        for group, version, plural in kinds:
            objs.delete_collection_namespaced_custom_object(group, version, ns, plural, label_selector=sel)
        # Argo's pods go with their Workflow (garbage collector), but not always within the wait: delete them too.
        real_cluster.core().delete_collection_namespaced_pod(ns, label_selector=sel)
        for node in real_cluster.core().list_node().items:
            if node.spec.unschedulable:
                real_cluster.core().patch_node(node.metadata.name, {"spec": {"unschedulable": False}})
        wait_for(f"no pods of {d.run_id} left", lambda: not real_cluster.pods(ns, sel), 90, 0.5)


def _one_incident(res: drill.DrillResult, fault: drill.Fault) -> drill.TimedIncident:
    assert (res.phase, res.final_status) == ("Succeeded", "Succeeded"), res
    [t] = res.incidents
    inc = t.incident
    assert (inc.attempt, inc.scenario) == (0, str(fault)), inc
    assert inc.injected_at <= inc.detected_at <= inc.stopped_at <= inc.slice_ready_at, inc
    assert inc.slice_ready_at <= inc.workers_started_at <= inc.restored_at, inc
    assert inc.steps_lost is not None and inc.steps_lost >= 0, inc
    return t


SPARE_POOLS = {"cpu-a": CpuHostsPools.FIRST, "cpu-b": CpuHostsPools.SPARE}


@contextmanager
def two_node_pools(rc: RealCluster, namespace: str, run_id: str) -> Iterator[None]:
    """The gang's nodes in two node pools (GKE's pool label), the first gang on ``cpu-a``: ``cpu-b``'s nodes stay
    cordoned until attempt 0's workers are bound, as a spare slice that came up while the first one trained."""
    core = rc.core()
    for pool, nodes in SPARE_POOLS.items():
        for n in nodes:
            core.patch_node(n, {"metadata": {"labels": {NODEPOOL_LABEL: pool}}})
            if pool == "cpu-b":
                core.patch_node(n, {"spec": {"unschedulable": True}})
    sel = f"jobset.sigs.k8s.io/jobset-name={run_id}-a0"

    def spare_up() -> None:
        wait_for("attempt 0's workers bound", lambda: _bound(rc.pods(namespace, sel)) == CHAOS_HOSTS, 180, 0.2)
        for n in SPARE_POOLS["cpu-b"]:
            core.patch_node(n, {"spec": {"unschedulable": False}})

    up = threading.Thread(target=spare_up, name="spare-pool", daemon=True)
    up.start()
    try:
        yield
    finally:
        up.join(timeout=1)
        for nodes in SPARE_POOLS.values():
            for n in nodes:
                core.patch_node(n, {"metadata": {"labels": {NODEPOOL_LABEL: None}}, "spec": {"unschedulable": False}})


def _bound(pods: list[dict]) -> int:
    return sum(1 for p in pods if p["spec"].get("nodeName"))


def test_drill_drain_node_real_trainers(trainer_drill, chaos_uninterrupted):
    """``drain-node``, level 2: the drill cordons the node of the last worker and evicts the run's pods on it (the
    Eviction API: DisruptionTarget, SIGTERM to the trainer). The Job fails by its podFailurePolicy, the attempt is
    classified preemption, and the next gang asks for any node pool but the one it left (level 2): it lands on the
    spare pool's nodes and restores the newest checkpoint from the bucket."""
    d = trainer_drill
    with two_node_pools(d.rc, d.target.namespace, d.run_id):
        res = d.run(drill.Fault.DRAIN_NODE, after_step=12, after_checkpoint=10)
        first, second = d.supervision(0), d.supervision(1)
    node = res.injected.split("drained node ")[1].split()[0]
    t = _one_incident(res, drill.Fault.DRAIN_NODE)
    assert t.incident.failure_class == "preemption", t.incident
    assert not d.rc.node(node)["spec"].get("unschedulable")  # uncordoned once the Workflow ended
    assert f"drill: uncordoned node {node}" in d.lines, d.lines
    assert {w.node for w in first.workers} <= set(SPARE_POOLS["cpu-a"]), first.workers
    assert (second.placement or "").startswith("level 2: the last attempt was preempted on node pool cpu-a"), second
    assert {w.node for w in second.workers} <= set(SPARE_POOLS["cpu-b"]), second.workers
    assert t.incident.restored_step is not None and t.incident.restored_step >= 10, t.incident
    ledger = read_ledger(d.store)
    assert [(a.attempt, a.outcome, a.failure_class) for a in ledger.attempts] == [
        (0, "failed", "preemption"),
        (1, "succeeded", None),
    ], ledger
    # data.resume_mode exact, the same process count: the recovered run ends where the undisturbed one did.
    assert final_digest(d) == final_digest(chaos_uninterrupted[0])


def test_drill_corrupt_latest_real_trainers(trainer_drill, chaos_uninterrupted):
    """``corrupt-latest``: the drill deletes a worker pod and, once every worker of the attempt has stopped,
    flips bytes of the newest checkpoint on the GCS emulator. restore-latest finds the damage (CRC32C against the
    manifest), quarantines the step and the next attempt restores the one before it."""
    d = trainer_drill
    res = d.run(drill.Fault.CORRUPT_LATEST, after_step=18)
    corrupted = int(res.injected.split("/checkpoints/")[1].split("/")[0])
    t = _one_incident(res, drill.Fault.CORRUPT_LATEST)
    quarantined = d.store.children(RunLayout.QUARANTINE)
    assert any(q.split("-")[0].split(".")[0] == str(corrupted) for q in quarantined), (corrupted, quarantined)
    assert t.incident.restored_step is not None and t.incident.restored_step < corrupted, t.incident
    # A deleted pod gets SIGTERM and its grace: the gang stops together (143) as for any SIGTERM.
    assert t.incident.failure_class == "preemption", t.incident
    assert final_digest(d) == final_digest(chaos_uninterrupted[0])


def test_drill_delete_workflow_real_trainers(trainer_drill, chaos_uninterrupted):
    """``delete-workflow``: the drill deletes the Workflow (no exit handler runs; the gang, which the Workflow does not
    own, trains on) and submits the same file again. The new Workflow's validate-config takes the run lease at once (the
    old holder's Workflow is gone from the same cluster and namespace), continues at attempt 0, and its supervisor
    re-attaches to the gang that never stopped: no attempt closed, no incident, no step lost."""
    d = trainer_drill
    res = d.run(drill.Fault.DELETE_WORKFLOW, after_step=10)
    assert (res.phase, res.final_status, res.incidents) == ("Succeeded", "Succeeded", []), res
    assert res.injected.startswith("deleted the workflow and submitted it again as "), res.injected
    ledger = read_ledger(d.store)
    assert [(a.attempt, a.outcome) for a in ledger.attempts] == [(0, "succeeded")], ledger
    assert d.supervision(0).reattached, d.supervision(0)
    assert final_digest(d) == final_digest(chaos_uninterrupted[0])


def test_drill_kill_worker_real_trainers(trainer_drill, chaos_uninterrupted):
    """``kill-worker``: the drill execs into the last worker, through the API server's exec subresource to
    podexec's kubelet endpoint, and SIGKILLs its trainer there. The generated pod shares its process namespace, so
    the trainer is not PID 1 and the kill lands: the container ends 137, the attempt is classified
    infrastructure, the next attempt restores the newest checkpoint. With the host-local tier on, as the level 0
    test's job: the ladder's two ends measured on one job (docs/PERFORMANCE.md)."""
    d = trainer_drill
    argoctl.edit_carried_config(d.target.doc, with_local_tier)
    res = d.run(drill.Fault.KILL_WORKER, after_step=12, after_checkpoint=10)
    victim = res.injected.split("SIGKILLed the trainer in ")[1].split()[0]
    t = _one_incident(res, drill.Fault.KILL_WORKER)
    assert t.incident.failure_class == "infrastructure", t.incident
    killed = next(w for w in d.supervision(0).workers if w.pod == victim)
    assert "137" in killed.last_state, d.supervision(0).workers
    # The Argo UI says why: the failed segment's node message carries the supervisor's line (its container's
    # termination message, the file podexec gives each container as the kubelet does).
    nodes = drill.Cluster(d.rc.admin, d.target.namespace).workflow(res.workflow)["status"]["nodes"].values()
    failed = [n.get("message") or "" for n in nodes if n.get("templateName") == "train-segment" and n["type"] == "Pod"]
    assert any("main: Error (exit code 1): " in m and "failed (exit code 137, SIGKILL)" in m for m in failed), failed
    assert t.incident.restored_step is not None and t.incident.restored_step >= 10, t.incident
    # The new gang's nodes hold the parts (each host's own and its peer's): a step newer than the last in GCS.
    assert t.incident.restore_tier in ("local", "peer") and t.incident.restored_step > 10, t.incident
    ledger = read_ledger(d.store)
    assert [(a.attempt, a.outcome, a.failure_class) for a in ledger.attempts] == [
        (0, "failed", "infrastructure"),
        (1, "succeeded", None),
    ], ledger
    # The killed trainer wrote no exit report (SIGKILL); its peer left as peer-lost or on the stop's SIGTERM; the
    # next attempt's gang restored the incident's step and trained to the last one.
    first = {w.process_index: w for w in final_reports(d, 0)}
    assert killed.index not in first and {w.exit_code for w in first.values()} <= {20, 143}, first
    second = final_reports(d, 1)
    assert [(w.exit_code, w.restore_step, w.last_step) for w in second] == [
        (0, t.incident.restored_step, CHAOS_STEPS)
    ] * CHAOS_HOSTS, second
    assert final_digest(d) == final_digest(chaos_uninterrupted[0])


def test_drill_kill_worker_in_place_real_trainers(trainer_drill, chaos_uninterrupted):
    """Level 0 on the real controllers: the carried config allows restarts in place, so each worker's container
    runs the agent and the trainer is its child. The drill's exec SIGKILLs the trainer; the pod runs on; the
    supervisor classifies the attempt, closes it at level 0 and restarts every trainer in its pod: one JobSet, one
    segment, no classify-failure, and the uninterrupted run's parameters. Each restarted trainer reads its part of
    the step the gang had reached from its own node (the host-local tier)."""
    d = trainer_drill

    def ladder(cfg):
        with_local_tier(cfg)
        cfg["retry"].update(in_place_budget=2)

    argoctl.edit_carried_config(d.target.doc, ladder)
    res = d.run(drill.Fault.KILL_WORKER, after_step=12, after_checkpoint=10)
    assert (res.phase, res.final_status) == ("Succeeded", "Succeeded"), res
    [t] = res.incidents
    inc = t.incident
    assert (inc.attempt, inc.scenario, inc.failure_class) == (0, "kill-worker", "infrastructure"), inc
    assert inc.restored_step is not None and inc.restored_step > 10 and inc.restore_tier == "local", inc
    ledger = read_ledger(d.store)
    assert [(a.attempt, a.level, a.jobset) for a in ledger.attempts[:1]] == [(0, 0, f"{d.run_id}-a0")], ledger
    nodes = drill.Cluster(d.rc.admin, d.target.namespace).workflow(res.workflow)["status"]["nodes"].values()
    ran = sorted(n["templateName"] for n in nodes if n["type"] == "Pod")
    assert ran.count("train-segment") == 1 and "classify-failure" not in ran, ran
    segment = next(n for n in nodes if n.get("templateName") == "train-segment" and n["type"] == "Pod")
    said = {p["name"]: p.get("value", "") for p in segment["outputs"]["parameters"]}
    assert said["restarted-in-place"].startswith("attempt 0 (infrastructure: "), said  # the Argo UI shows it
    assert said["placement"].startswith("level 0: "), said
    second = final_reports(d, 1)
    assert [(w.exit_code, w.restore_step) for w in second] == [(0, inc.restored_step)] * CHAOS_HOSTS, second
    assert final_digest(d) == final_digest(chaos_uninterrupted[0])


def test_drill_refuses_kill_worker_when_the_trainer_is_pid_1(real_cluster, argo, namespace):
    """A worker pod without shareProcessNamespace (a Workflow generated before the pods shared it) has the trainer
    as PID 1 of its PID namespace, which nothing inside the pod can SIGKILL: the drill says so in one DrillError,
    and the trainer still runs."""
    # A worker pod carries its JobSet's label: the drill picks its victims by it, never a step pod.
    labels = {drill.RUN_ID_LABEL: "pid-one", drill.ATTEMPT_LABEL: "0", drill.JOBSET_NAME_LABEL: "pid-one-a0"}
    pod = worker_like_pod(real_cluster, namespace, "pid-one-0", share=False, labels=labels)
    target = drill.Target(doc={}, namespace=namespace, run_id="pid-one", store_root="")
    cluster = drill.Cluster(real_cluster.admin, namespace)
    with pytest.raises(drill.DrillError, match=f"pod {pod}: the trainer is PID 1 of its container") as e:
        drill.inject(cluster, None, target, "", drill.Fault.KILL_WORKER, 0)
    assert "shareProcessNamespace" in str(e.value)
    assert kube_exec(real_cluster, namespace, pod, ["sh", "-c", "exit 0"])[2] == 0  # still running
    assert real_cluster.core().read_namespaced_pod(pod, namespace).status.phase == "Running"
