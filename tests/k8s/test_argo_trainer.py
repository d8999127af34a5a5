"""The smallest file of argo/ (``local-cpu.yaml``: 4 CPU hosts, 60 steps, a checkpoint every 10) on the real Argo
workflow-controller, with its JobSet's worker pods running the real trainer.

``podexec`` (the process kubelet) runs every pod bound to its nodes, the step pods and the gang's pods alike, as
local processes: the workers are ``python -m trainer`` with the pod's args and env, four JAX processes joining one
gang through the coordinator address the manifest names (127.0.0.1 and the port provision-slice chose: podexec's
pods share the host's network namespace, as pods with ``hostNetwork`` do), checkpointing to the GCS emulator. A
worker's exit code is the trainer's own; the real Job controller matches it against the podFailurePolicy, the real
JobSet controller fails the gang, and the project's steps classify and recover. The recoveries of real trainers
(a SIGKILLed trainer, a drained node, a corrupt checkpoint, a resubmission) are the drill's
(``test_drill_trainers.py``), on the chaos runs' smaller job.
"""

from __future__ import annotations

import argoctl
import pytest
from tier import HOSTS
from trainers import TOTAL_STEPS, final_reports

from jaxrec.adapters.documents import read_ledger
from jaxrec.adapters.store import RunLayout
from jaxrec.model.records import SupervisionRecord

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


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
