"""The smallest file of argo/ (``local-cpu.yaml``: 4 CPU hosts, 60 steps, a checkpoint every 10) on the real Argo
workflow-controller, with its JobSet's worker pods running the real trainer.

``podexec`` (the process kubelet) runs every pod bound to its nodes, the step pods and the gang's pods alike, as
local processes: the workers are ``python -m trainer`` with the pod's args and env, four JAX processes joining one
gang through the coordinator address the manifest names (127.0.0.1 and the port provision-slice chose: podexec's
pods share the host's network namespace, as pods with ``hostNetwork`` do), checkpointing to the GCS emulator. A
worker's exit code is the trainer's own; the real Job controller matches it against the podFailurePolicy, the real
JobSet controller fails the gang, and the project's steps classify and recover.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import argoctl
import pytest
from argoctl import LOCAL_ARGO_FILE
from realcluster import RealCluster, wait_for
from tier import HOSTS, INDEX, REPO, CpuHosts

from recovery_steps.kernel.config import load_config
from recovery_steps.kernel.documents import read_ledger, read_worker_reports
from recovery_steps.kernel.k8s import jobset_name
from recovery_steps.kernel.records import SupervisionRecord
from recovery_steps.kernel.store import RunLayout, RunStore

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

TERMINAL = ("Succeeded", "Failed", "Error")
TOTAL_STEPS = load_config(REPO / "configs" / LOCAL_ARGO_FILE).training.total_steps


@dataclass
class TrainerRun:
    """One submission of argo/local-cpu.yaml with a run id and a GCS prefix of its own."""

    rc: RealCluster
    hosts: CpuHosts
    store_root: str
    run_id: str
    name: str = ""
    seconds: float = 0.0
    nodes: set[str] = field(default_factory=set)

    @property
    def ns(self) -> str:
        return self.hosts.namespace

    @property
    def store(self) -> RunStore:
        return RunStore(self.store_root, self.run_id)

    def submit(self) -> str:
        params = {"store-root": self.store_root, "run-id": self.run_id}
        self.name = argoctl.submit(self.rc, REPO / "argo" / LOCAL_ARGO_FILE, params)["metadata"]["name"]
        return self.name

    def wf(self) -> dict[str, Any]:
        return argoctl.workflow(self.rc, self.ns, self.name)

    def wait_done(self, timeout: float) -> dict[str, Any]:
        def done():
            wf = self.wf()
            return wf if (wf.get("status") or {}).get("phase") in TERMINAL else None

        try:
            return wait_for(f"Workflow {self.name} finished", done, timeout, 1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{argoctl.summary(self.wf())}") from None

    def workers(self, attempt: int, timeout: float = 240) -> list[dict[str, Any]]:
        """The attempt's worker pods once all are Running, by completion index."""
        sel = f"jobset.sigs.k8s.io/jobset-name={jobset_name(self.run_id, attempt)}"

        def running():
            pods = [p for p in self.rc.pods(self.ns, sel) if p["status"].get("phase") == "Running"]
            return sorted(pods, key=lambda p: int(p["metadata"]["labels"][INDEX])) if len(pods) >= HOSTS else None

        return self.until(f"{HOSTS} worker pods Running of attempt {attempt}", running, timeout, 0.5)

    def committed_past(self, attempt: int, timeout: float = 300) -> tuple[int, int]:
        """Wait until a checkpoint has committed (manifest written) and the attempt trained past it; both steps."""

        def past():
            steps = [s for s in self.store.checkpoint_steps() if self.store.exists(RunLayout.checkpoint_manifest(s))]
            beats = [
                self.store.read_json(RunLayout.heartbeat(attempt, i))
                for i in range(HOSTS)
                if self.store.exists(RunLayout.heartbeat(attempt, i))
            ]
            step = min((b["step"] for b in beats), default=None) if len(beats) == HOSTS else None
            return (steps[-1], step) if steps and step is not None and step > steps[-1] else None

        return self.until(f"attempt {attempt} past a committed checkpoint", past, timeout, 0.2)

    def until(self, what: str, check: Any, timeout: float, interval: float) -> Any:
        """``wait_for(check)``, failing at once (with the Workflow's nodes) when the Workflow ends first."""
        ended = object()

        def probe():
            got = check()
            return got if got else ended if (self.wf().get("status") or {}).get("phase") in TERMINAL else None

        try:
            got = wait_for(what, probe, timeout, interval)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{argoctl.summary(self.wf())}") from None
        if got is ended:
            raise AssertionError(f"{what}: the Workflow ended first\n{argoctl.summary(self.wf())}")
        return got


def _clean(rc: RealCluster, ns: str, run_id: str) -> None:
    """Delete the run's Workflows, JobSets and pods; wait until no pod of the run is left."""
    from kubernetes import client

    objs = client.CustomObjectsApi(rc.admin)
    sel = f"jaxrec/run-id={run_id}"
    for group, plural in (("argoproj.io", "workflows"), ("jobset.x-k8s.io", "jobsets")):
        version = "v1alpha1" if group == "argoproj.io" else "v1alpha2"
        objs.delete_collection_namespaced_custom_object(group, version, ns, plural, label_selector=sel)
    # Argo's pods go with their Workflow (garbage collector), but not always within the wait: delete them too.
    rc.core().delete_collection_namespaced_pod(ns, label_selector=sel)
    try:
        wait_for(f"no pods of {run_id} left", lambda: not rc.pods(ns, sel), 90, 0.5)
    except AssertionError as e:
        left = [
            (p["metadata"]["name"], p["spec"].get("nodeName"), p["status"].get("phase"),
             p["metadata"].get("deletionTimestamp"), p["metadata"].get("finalizers"))
            for p in rc.pods(ns, sel)
        ]  # fmt: skip
        raise AssertionError(f"{e}: {left}") from None


def _new_run(rc: RealCluster, hosts: CpuHosts, bucket: str) -> TrainerRun:
    run_id = f"tier-{uuid.uuid4().hex[:6]}"
    return TrainerRun(rc, hosts, f"gs://{bucket}/{run_id}", run_id)


BUCKET = "tier-trainers"


@pytest.fixture(scope="module")
def uninterrupted(real_cluster: RealCluster, cpu_hosts: CpuHosts, gcs_emulator: Any) -> Any:
    """One run of the local file that nothing disturbs, ended: the run and its Workflow as it finished."""
    gcs_emulator.create_bucket(BUCKET)
    r = _new_run(real_cluster, cpu_hosts, BUCKET)
    t0 = time.monotonic()
    try:
        r.submit()
        pods = r.workers(0)
        wf = r.wait_done(420)
        r.seconds = time.monotonic() - t0
        r.nodes = {p["spec"]["nodeName"] for p in pods}
        yield r, wf
    finally:
        _clean(real_cluster, r.ns, r.run_id)


@pytest.fixture
def trainer_run(real_cluster: RealCluster, cpu_hosts: CpuHosts, gcs_emulator: Any) -> Any:
    """A run of the local file on the GCS emulator; every Workflow, JobSet and pod of the run deleted afterwards."""
    gcs_emulator.create_bucket(BUCKET)
    r = _new_run(real_cluster, cpu_hosts, BUCKET)
    try:
        yield r
    finally:
        _clean(real_cluster, r.ns, r.run_id)


def _final_reports(r: TrainerRun, attempt: int) -> list[Any]:
    reports, problems = read_worker_reports(r.store, attempt)
    assert not problems, problems
    return sorted(reports, key=lambda w: w.process_index)


def test_a_short_run_of_real_trainers_succeeds(uninterrupted):
    """The gang of four real trainers trains all 60 steps in one attempt, checkpointing to the GCS emulator; the
    supervisor sees the JobSet succeed and the Workflow Succeeds."""
    r, wf = uninterrupted
    report = argoctl.summary(wf)
    assert wf["status"]["phase"] == "Succeeded", report
    assert r.nodes <= {*r.hosts.nodes, "argo-steps"}, r.nodes
    reports = _final_reports(r, 0)
    assert [(w.process_index, w.exit_code, w.last_step) for w in reports] == [
        (i, 0, TOTAL_STEPS) for i in range(HOSTS)
    ], reports
    assert len({w.pid for w in reports}) == HOSTS and len({w.params_digest for w in reports}) == 1, reports
    assert r.store.checkpoint_steps()[-1] == TOTAL_STEPS
    assert r.store.url().startswith("gs://")
    ledger = read_ledger(r.store)
    assert [(a.attempt, a.outcome) for a in ledger.attempts] == [(0, "succeeded")], ledger
    assert ledger.final_status == "Succeeded"
    print(f"real trainers, one attempt: {r.seconds:.0f} s\n{report}")


def test_kill_worker_a_sigkilled_trainer_is_recovered_from_a_real_checkpoint(trainer_run, uninterrupted):
    """README scenario ``kill-worker`` with real processes: one trainer SIGKILLed after a checkpoint committed.
    Its container ends 137 (no podFailurePolicy rule: backoffLimit 0 fails the Job), its peers leave as peer-lost,
    the supervisor ends the attempt, classify-failure says infrastructure and retries, and attempt 1 restores the
    newest checkpoint from the GCS emulator and trains to the last step, ending with the uninterrupted run's
    parameters bit for bit (``data.resume_mode: exact``, the same process count)."""
    t0 = time.monotonic()
    r = trainer_run
    r.submit()
    pods = r.workers(0)
    committed, at = r.committed_past(0)
    victim = pods[2]
    os.kill(r.hosts.pid(victim), signal.SIGKILL)
    wf = r.wait_done(600)
    report = argoctl.summary(wf)
    assert wf["status"]["phase"] == "Succeeded", report
    verdicts = [argoctl.outputs(n) for n in argoctl.pods_of(wf, "classify-failure")]
    assert [(v["failure-class"], v["decision"]) for v in verdicts] == [("infrastructure", "retry")], report
    restored = [int(argoctl.outputs(n)["restore-step"]) for n in argoctl.pods_of(wf, "restore-latest")]
    assert restored[0] == -1 and restored[-1] >= committed > 0, (restored, committed, report)
    ledger = read_ledger(r.store)
    assert [(a.attempt, a.outcome, a.failure_class) for a in ledger.attempts] == [
        (0, "failed", "infrastructure"),
        (1, "succeeded", None),
    ], ledger
    rec = SupervisionRecord.model_validate(r.store.read_json(RunLayout.supervision(0)))
    killed = next(w for w in rec.workers if w.pod == victim["metadata"]["name"])
    assert "137" in killed.last_state, rec.workers
    first = {w.process_index: w for w in _final_reports(r, 0)}
    assert 2 not in first, first  # SIGKILL: no exit report
    assert {w.exit_code for w in first.values()} <= {20, 143}, first
    second = _final_reports(r, 1)
    assert [(w.exit_code, w.restore_step, w.last_step) for w in second] == [(0, restored[-1], TOTAL_STEPS)] * HOSTS, (
        second
    )
    assert {w.params_digest for w in second} == {w.params_digest for w in _final_reports(uninterrupted[0], 0)}
    lost = at - restored[-1]
    print(
        f"kill-worker with real trainers: {time.monotonic() - t0:.0f} s; killed at step >= {at}, "
        f"restored {restored[-1]}, about {lost} steps recomputed\n{report}"
    )
