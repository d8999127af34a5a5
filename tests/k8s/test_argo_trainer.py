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
from typing import Any

import argoctl
import pytest
from realcluster import RealCluster
from tier import HOSTS, CpuHosts
from trainers import TOTAL_STEPS, clean_run, final_digest, final_reports, new_run

from recovery_steps.kernel.documents import read_ledger
from recovery_steps.kernel.records import SupervisionRecord
from recovery_steps.kernel.store import RunLayout

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.fixture
def trainer_run(real_cluster: RealCluster, cpu_hosts: CpuHosts, gcs_emulator: Any) -> Any:
    """A run of the local file on the GCS emulator; every Workflow, JobSet and pod of the run deleted afterwards."""
    r = new_run(real_cluster, cpu_hosts, gcs_emulator)
    try:
        yield r
    finally:
        clean_run(real_cluster, r.ns, r.run_id)


def test_a_short_run_of_real_trainers_succeeds(uninterrupted):
    """The gang of four real trainers trains all 60 steps in one attempt, checkpointing to the GCS emulator; the
    supervisor sees the JobSet succeed and the Workflow Succeeds."""
    r, wf = uninterrupted
    report = argoctl.summary(wf)
    assert wf["status"]["phase"] == "Succeeded", report
    assert r.nodes <= {*r.hosts.nodes, "argo-steps"}, r.nodes
    reports = final_reports(r, 0)
    assert [(w.process_index, w.exit_code, w.last_step) for w in reports] == [
        (i, 0, TOTAL_STEPS) for i in range(HOSTS)
    ], reports
    assert len({w.params_digest for w in reports}) == 1, reports
    # Four processes, one per pod; each reports its pid in its own pod's PID namespace (the same in every pod).
    rec = SupervisionRecord.model_validate(r.store.read_json(RunLayout.supervision(0)))
    assert len({w.pod for w in rec.workers}) == HOSTS and len({w.pid for w in reports}) == 1, (rec.workers, reports)
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
    wf = r.wait_done(200)
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
    first = {w.process_index: w for w in final_reports(r, 0)}
    assert 2 not in first, first  # SIGKILL: no exit report
    assert {w.exit_code for w in first.values()} <= {20, 143}, first
    second = final_reports(r, 1)
    assert [(w.exit_code, w.restore_step, w.last_step) for w in second] == [(0, restored[-1], TOTAL_STEPS)] * HOSTS, (
        second
    )
    assert final_digest(r) == final_digest(uninterrupted[0])
    lost = at - restored[-1]
    print(
        f"kill-worker with real trainers: {time.monotonic() - t0:.0f} s; killed at step >= {at}, "
        f"restored {restored[-1]}, about {lost} steps recomputed\n{report}"
    )
