"""The local stand-in (``python -m workflows.local``) against Argo's real workflow-controller (v4.0.5).

Each README scenario both can run is run on the real controller with the shipped Workflow (``argo/v5e-4x4.yaml``)
by ``test_argo.py``: step pods as local processes (``podexec``), the JobSet's worker pods on KWOK, the test ending
them with the scenario's exit codes. ``agrees`` records the finished Workflow (``argo_replay.record``) and replays it
through the stand-in's interpreter (``workflows.local.engine``) with the real nodes' results: the stand-in must run
the same nodes, retry each template as often, take the same branches, give the exit handler the same
``{{workflow.status}}`` and end in the same phase. Its attempts must be the ledger's (its incidents are built
from them by the one builder every run uses, ``jaxrec.adapters.incidents``). For the evicted supervisor, the node
the stand-in makes of a lost supervisor must be the node the real controller made. One run serves both checks:
the scenario's own assertions and the stand-in's agreement.

With ``JAXREC_RECORD_ARGO=<dir>`` each recording is written to ``<dir>/<scenario>.json``; the fast suite replays the
recordings kept in ``tests/data/argo-v4.0.5`` (``tests/test_standin_replay.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import argoctl
from argorun import ArgoRun
from support import argo_replay

from workflows.local.executor import pod_deleted


def _save(scenario: str, rec: dict[str, Any]) -> None:
    out = os.environ.get("JAXREC_RECORD_ARGO")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{scenario}.json").write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")


def agrees(r: ArgoRun, wf: dict[str, Any], scenario: str) -> None:
    """The stand-in, replaying the finished Workflow ``wf`` of ``scenario`` with its real nodes' results, runs as
    the real controller ran it and closes the ledger's attempts."""
    report = argoctl.summary(wf)
    rec = argo_replay.record(wf)
    _save(scenario, rec)
    rep = argo_replay.replay(rec)
    assert argo_replay.disagreements(rec, rep) == [], report
    ledger = r.ledger()
    assert rep.attempts() == [(a.attempt, a.outcome, a.failure_class, a.decision) for a in ledger.attempts], report
    assert rep.executor.exit_status == [ledger.argo_status], report
    if scenario == "supervisor-lost":
        lost = [
            n for n in argo_replay.leaves(rec) if n["templateName"] == "train-segment" and n["phase"] != "Succeeded"
        ]
        assert len(lost) == 1, report
        if lost[0]["phase"] == "Error":  # the pod was gone before the controller saw it end
            model = pod_deleted()
            assert (lost[0]["phase"], lost[0].get("message"), lost[0].get("exitCode")) == (
                model.phase,
                model.message,
                None if model.exit_code is None else str(model.exit_code),
            ), report
    print(f"{scenario}: the stand-in agrees with the real controller")
