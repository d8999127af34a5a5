"""``python -m workflows.drill`` against the real controllers: the shipped Workflow submitted by the drill, one
failure injected by it, the run ending as it should, and the measures the drill prints.

Argo's workflow-controller runs the steps (``podexec`` runs each step pod's program); the JobSet's worker pods
stay on KWOK, so the test plays the trainer: it writes the heartbeats the workers would write and ends the next
attempt's gang. What the drill deletes or evicts, and everything that follows, is decided by the real API server,
Job, JobSet and Argo controllers and the project's steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import argoctl
import pytest
from argoctl import ARGO_FILE
from realcluster import RealCluster, wait_for
from tier import HOSTS, INDEX, REPO, apply_rbac

from jaxrec.adapters.documents import read_ledger
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import load_config
from jaxrec.model.names import jobset_name
from jaxrec.model.records import WorkerHeartbeat
from workflows import drill

pytestmark = pytest.mark.k8s


class Drilled:
    """The drill run in a thread (as a user runs it from a laptop), its result or error kept."""

    def __init__(self, rc: RealCluster, store_root: str, fault: drill.Fault, after_step: int, timeout_s: float = 420):
        self.rc = rc
        self.target = drill.load_target(REPO / "argo" / ARGO_FILE, [f"store-root={store_root}"], None)
        argoctl.edit_carried_config(self.target.doc, argoctl.tier_backoff)
        self.store = RunStore(store_root, self.target.run_id)
        self.lines: list[str] = []
        self.result: drill.DrillResult | None = None
        self.error: BaseException | None = None
        cluster = drill.Cluster(rc.admin, self.target.namespace)
        kw = {"timeout_s": timeout_s, "say": self.lines.append, "store": self.store}
        injection = drill.Injection(fault, after_step)
        self.thread = threading.Thread(target=self._run, args=(cluster, injection), kwargs=kw, daemon=True)
        self.thread.start()

    def _run(self, cluster: drill.Cluster, injection: drill.Injection, **kw: Any) -> None:
        try:
            self.result = drill.run_drill(cluster, self.target, injection, **kw)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test thread
            self.error = e

    def workers(self, attempt: int) -> list[dict[str, Any]]:
        """The attempt's worker pods once all are Running, by completion index."""
        sel = f"jobset.sigs.k8s.io/jobset-name={jobset_name(self.target.run_id, attempt)}"

        def running():
            pods = [p for p in self.rc.pods(self.target.namespace, sel) if p["status"].get("phase") == "Running"]
            return sorted(pods, key=lambda p: int(p["metadata"]["labels"][INDEX])) if len(pods) >= HOSTS else None

        return wait_for(f"{HOSTS} worker pods of attempt {attempt} Running", running, 240, 0.5)

    def beat(self, attempt: int, step: int) -> None:
        t = time.time()
        for i in range(HOSTS):
            hb = WorkerHeartbeat(process_index=i, step=step, at=t, first_step_at=t)
            self.store.write_record(RunLayout.heartbeat(attempt, i), hb)

    def wait(self) -> drill.DrillResult:
        self.thread.join(200)
        assert not self.thread.is_alive(), "the drill did not end"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@pytest.fixture
def drilled_ns(real_cluster: RealCluster, argo, tpu_nodes) -> Iterator[str]:
    cfg = load_config(REPO / "configs" / ARGO_FILE)
    apply_rbac(real_cluster, cfg)
    tpu_nodes(HOSTS, cfg)
    try:
        yield cfg.namespace
    finally:
        from kubernetes import client

        objs = client.CustomObjectsApi(real_cluster.admin)
        objs.delete_collection_namespaced_custom_object("argoproj.io", "v1alpha1", cfg.namespace, "workflows")
        objs.delete_collection_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", cfg.namespace, "jobsets")
        wait_for(f"no pods left in {cfg.namespace}", lambda: not real_cluster.pods(cfg.namespace), 90, 0.5)
        gone = lambda: not objs.list_namespaced_custom_object(*drill.JOBSET, cfg.namespace, "jobsets")["items"]  # noqa: E731
        wait_for(f"no JobSets left in {cfg.namespace}", gone, 90, 0.5)  # the next drill refuses a run id in use


def test_drill_delete_worker_is_recovered_and_measured(real_cluster, drilled_ns, tmp_path):
    """The drill deletes one worker pod of attempt 0 once the run passed step 20: the real Job controller fails
    the gang's Job, the supervisor ends the attempt, classify-failure retries, attempt 1 succeeds; the drill
    prints one incident with its class and the time of each phase it can see in the run store."""
    d = Drilled(real_cluster, str(tmp_path / "store"), drill.Fault.DELETE_WORKER, after_step=20)
    first = d.workers(0)
    d.beat(0, 25)
    wait_for("the drill to inject", lambda: len(d.lines) >= 2 or d.error, 120, 0.5)
    assert d.error is None, d.error
    victim = first[-1]["metadata"]["name"]
    assert d.lines[1] == f"drill: at step 25 of attempt 0: deleted worker pod {victim}"
    d.workers(1)
    d.beat(1, 30)
    for p in d.workers(1):
        real_cluster.exit_pod(drilled_ns, p["metadata"]["name"], 0)
    res = d.wait()
    assert (res.phase, res.final_status) == ("Succeeded", "Succeeded")
    [t] = res.incidents
    inc = t.incident
    assert (inc.attempt, inc.scenario, inc.pre_failure_step, inc.restored_step, inc.steps_lost) == (
        0,
        "delete-worker",
        25,
        0,
        25,
    )
    # The deleted pod's container ends 143, as the trainer does on the SIGTERM of a pod deletion (KWOK's stage plays
    # the kubelet): a graceful exit, classified preemption, as docs/RUNBOOK.md's drill table says.
    assert inc.failure_class == "preemption"
    assert inc.injected_at <= inc.detected_at <= inc.stopped_at <= inc.slice_ready_at, inc
    table = drill.measures_table(res.incidents)
    print("\n".join([*d.lines, *table]))
    assert table[1].split()[:3] == ["0", "delete-worker", str(inc.failure_class)]


def test_drill_supervisor_lost_leaves_the_gang_training_and_closes_no_attempt(real_cluster, drilled_ns, tmp_path):
    """The drill evicts the train-segment pod (as a drain of its node does): Argo retries the step, the new
    supervisor re-attaches to the same gang, which keeps its pods; the run Succeeds on attempt 0 with no incident."""
    d = Drilled(real_cluster, str(tmp_path / "store"), drill.Fault.SUPERVISOR_LOST, after_step=20)
    first = d.workers(0)
    d.beat(0, 25)
    wait_for("the drill to inject", lambda: len(d.lines) >= 2 or d.error, 120, 0.5)
    assert d.error is None, d.error
    assert d.lines[1].startswith("drill: at step 25 of attempt 0: evicted supervisor pod "), d.lines
    d.beat(0, 30)
    assert [p["metadata"]["uid"] for p in d.workers(0)] == [p["metadata"]["uid"] for p in first]
    store = d.store
    for p in first:
        real_cluster.exit_pod(drilled_ns, p["metadata"]["name"], 0)
    res = d.wait()
    assert (res.phase, res.final_status, res.incidents) == ("Succeeded", "Succeeded", [])
    rec = store.read_json(RunLayout.supervision(0))
    assert rec["outcome"] == "succeeded" and rec["reattached"], rec
    assert [a.attempt for a in read_ledger(store).attempts] == [0]


def test_the_drill_refuses_a_run_id_in_use_before_it_submits_anything(real_cluster, drilled_ns, tmp_path):
    """A run id whose store holds a config, or whose label is on a pod in the namespace, is not drilled: nothing is
    submitted, nothing is touched, and the one line names the fix."""
    target = drill.load_target(REPO / "argo" / ARGO_FILE, [f"store-root={tmp_path / 'store'}"], None)
    store = RunStore(str(tmp_path / "store"), target.run_id)
    cluster = drill.Cluster(real_cluster.admin, target.namespace)
    store.write_bytes(RunLayout.CONFIG, b"{}")
    with pytest.raises(drill.DrillError, match=r"already has config.json in .*not drilled; .*-p run-id=drill-"):
        drill.run_drill(
            cluster, target, drill.Injection(drill.Fault.DELETE_WORKER, after_step=1), timeout_s=60, store=store
        )
    store.delete(RunLayout.CONFIG)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "someone-elses", "labels": {"jaxrec/run-id": target.run_id}},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }
    real_cluster.core().create_namespaced_pod(drilled_ns, pod)
    try:
        with pytest.raises(drill.DrillError, match=rf"run {target.run_id} is in use in namespace .*pod/someone-elses"):
            drill.run_drill(
                cluster, target, drill.Injection(drill.Fault.DELETE_WORKER, after_step=1), timeout_s=60, store=store
            )
    finally:
        real_cluster.core().delete_namespaced_pod("someone-elses", drilled_ns, grace_period_seconds=0)
    from kubernetes import client

    wfs = client.CustomObjectsApi(real_cluster.admin).list_namespaced_custom_object(
        *drill.ARGO[:2], drilled_ns, "workflows"
    )
    assert wfs["items"] == []  # nothing was submitted


def test_a_drill_that_cannot_go_on_stops_its_workflow_and_the_gang_goes_with_it(real_cluster, drilled_ns, tmp_path):
    """The run never reaches --after-step before --timeout: the drill stops the Workflow it submitted (argo stop), so
    its exit handler deletes the gang, and the ledger closes the attempt as stopped, charged to no class."""
    d = Drilled(real_cluster, str(tmp_path / "store"), drill.Fault.DELETE_WORKER, after_step=10**6, timeout_s=20)
    d.workers(0)
    d.beat(0, 5)
    d.thread.join(120)
    assert isinstance(d.error, drill.DrillError) and "timed out waiting for run" in str(d.error), d.error
    assert any(ln.startswith("drill: stopped workflow ") for ln in d.lines), d.lines
    sel = f"jaxrec/run-id={d.target.run_id}"
    from kubernetes import client

    objs = client.CustomObjectsApi(real_cluster.admin)

    def jobsets() -> list[dict]:
        return objs.list_namespaced_custom_object(*drill.JOBSET, drilled_ns, "jobsets", label_selector=sel)["items"]

    wait_for("the exit handler to delete the gang", lambda: not jobsets(), 180, 1.0)
    ledger = wait_for(
        "the ledger's final status", lambda: (led := read_ledger(d.store)) and led.final_status and led, 120, 1.0
    )
    assert ledger.final_status == "Failed", ledger
    assert [(a.attempt, a.outcome, a.failure_class) for a in ledger.attempts] == [(0, "stopped", None)], ledger
