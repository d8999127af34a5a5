"""``python -m workflows.drill``'s code against the real controllers with real trainers: the drill submits
argo/local-cpu.yaml (``-p run-id``, ``-p store-root`` on the GCS emulator), waits until the gang of four real
trainers has passed its step, injects the failure itself, and measures the incident from the run store. Nothing in
the test plays the trainer: heartbeats, checkpoints, exit codes and exit reports are the workers' own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from argoctl import LOCAL_ARGO_FILE
from realcluster import RealCluster, wait_for
from tier import REPO, CpuHosts
from trainers import BUCKET, final_digest

from recovery_steps.kernel.documents import read_ledger
from recovery_steps.kernel.records import SupervisionRecord
from recovery_steps.kernel.store import RunLayout, RunStore
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
        self.store = RunStore(root, self.run_id)
        self.lines: list[str] = []

    def run(self, fault: drill.Fault, after_step: int) -> drill.DrillResult:
        cluster = drill.Cluster(self.rc.admin, self.target.namespace)
        t0 = time.monotonic()
        res = drill.run_drill(
            cluster, self.target, fault, after_step=after_step, timeout_s=600, say=self.lines.append, store=self.store
        )
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


def test_drill_drain_node_real_trainers(trainer_drill, uninterrupted):
    """``drain-node``: the drill cordons the node of the last worker and evicts the run's pods on it (the Eviction
    API: DisruptionTarget, SIGTERM to the trainer). The Job fails by its podFailurePolicy, the attempt is
    classified preemption, the next gang lands on the nodes left and restores the newest checkpoint."""
    d = trainer_drill
    res = d.run(drill.Fault.DRAIN_NODE, after_step=12)
    node = res.injected.split("drained node ")[1].split()[0]
    t = _one_incident(res, drill.Fault.DRAIN_NODE)
    assert t.incident.failure_class == "preemption", t.incident
    assert d.rc.node(node)["spec"].get("unschedulable") is True  # the drill leaves it cordoned (RUNBOOK: uncordon)
    assert node not in {w.node for w in d.supervision(1).workers}, d.supervision(1).workers
    assert t.incident.restored_step is not None and t.incident.restored_step >= 10, t.incident
    ledger = read_ledger(d.store)
    assert [(a.attempt, a.outcome, a.failure_class) for a in ledger.attempts] == [
        (0, "failed", "preemption"),
        (1, "succeeded", None),
    ], ledger
    # data.resume_mode exact, the same process count: the recovered run ends where the undisturbed one did.
    assert final_digest(d) == final_digest(uninterrupted[0])


def test_drill_corrupt_checkpoint_real_trainers(trainer_drill, uninterrupted):
    """``corrupt-checkpoint``: the drill deletes a worker pod and, once every worker of the attempt has stopped,
    flips a byte of the newest checkpoint on the GCS emulator. restore-latest finds the damage (CRC32C against the
    manifest), quarantines the step and the next attempt restores the one before it."""
    d = trainer_drill
    res = d.run(drill.Fault.CORRUPT_CHECKPOINT, after_step=25)
    corrupted = int(res.injected.split("/checkpoints/")[1].split("/")[0])
    t = _one_incident(res, drill.Fault.CORRUPT_CHECKPOINT)
    quarantined = d.store.children(RunLayout.QUARANTINE)
    assert any(q.split("-")[0].split(".")[0] == str(corrupted) for q in quarantined), (corrupted, quarantined)
    assert t.incident.restored_step is not None and t.incident.restored_step < corrupted, t.incident
    # A deleted pod gets SIGTERM and its grace: the gang stops together (143) as for any SIGTERM.
    assert t.incident.failure_class == "preemption", t.incident
    assert final_digest(d) == final_digest(uninterrupted[0])


def test_drill_resubmit_real_trainers(trainer_drill, uninterrupted):
    """``resubmit``: the drill deletes the Workflow (no exit handler runs; the gang, which the Workflow does not own,
    trains on) and submits the same file again. The new Workflow's validate-config takes the run lease at once (the
    old holder's Workflow is gone from the same cluster and namespace), continues at attempt 0, and its supervisor
    re-attaches to the gang that never stopped: no attempt closed, no incident, no step lost."""
    d = trainer_drill
    res = d.run(drill.Fault.RESUBMIT, after_step=10)
    assert (res.phase, res.final_status, res.incidents) == ("Succeeded", "Succeeded", []), res
    assert res.injected.startswith("deleted the workflow and submitted it again as "), res.injected
    ledger = read_ledger(d.store)
    assert [(a.attempt, a.outcome) for a in ledger.attempts] == [(0, "succeeded")], ledger
    assert d.supervision(0).reattached, d.supervision(0)
    assert final_digest(d) == final_digest(uninterrupted[0])
