"""The local stand-in (``python -m workflows.local``) against Argo's real workflow-controller (v4.0.5).

Each README scenario both can run is run on the real controller with the shipped Workflow (``argo/v5e-4x4.yaml``)
by ``test_argo.py``: step pods as local processes (``podexec``), the JobSet's worker pods on KWOK, the test ending
them with the scenario's exit codes. ``agrees`` records the finished Workflow (``argo_replay.record``) and replays it
through the stand-in's interpreter (``workflows.local.engine``) with the real nodes' results: the stand-in must run
the same nodes, retry each template as often, take the same branches, give the exit handler the same
``{{workflow.status}}`` and end in the same phase. Its attempts must be the ledger's, and the incidents its builder
(``workflows.local.incidents``) makes of them must name the attempts and classes, and the slice-ready times, that
``jaxrec.adapters.incidents`` reads from the run store. For the evicted supervisor, the node the stand-in
makes of a lost supervisor must be the node the real controller made. One run serves both checks: the scenario's
own assertions and the stand-in's agreement.

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

from jaxrec.adapters.incidents import incidents_from_facts, read_attempt_facts
from jaxrec.adapters.store import RunLayout
from jaxrec.model.records import SupervisionRecord
from workflows.local.executor import pod_deleted
from workflows.local.incidents import Segment, build_incidents

# The stand-in's slice-ready time is the provision-slice node's end (whole seconds on the real controller); the
# cluster's is the provision record's time, written by the step before its pod ends.
SLICE_READY_TOLERANCE_S = 5.0


def _standin_incidents(rep: argo_replay.Replay, r: ArgoRun, classes: dict) -> list:
    """The stand-in's incident builder over the replayed run: one segment per attempt's gang (a re-attached
    supervisor keeps its gang), timed as the stand-in's executor times it, from the supervision record."""
    segments = []
    for attempt in sorted({int(n.attempt) for n, _ in rep.nodes if n.template == "train-segment"}):
        tries = [res for n, res in rep.nodes if n.template == "train-segment" and int(n.attempt) == attempt]
        sup = r.store.read_record(RunLayout.supervision(attempt), SupervisionRecord)
        failed = tries[-1].phase == "Failed" and sup is not None and sup.outcome in ("failed", "stalled")
        ended = (sup.stopped_at if sup and sup.stopped_at else None) or tries[-1].finished_at
        segments.append(Segment(attempt, tries[0].started_at, ended, failed, sup.detected_at if sup else None))
    provision_done = [
        res.finished_at for n, res in rep.nodes if n.template == "provision-slice" and res.phase == "Succeeded"
    ]
    return build_incidents(segments, [], provision_done, [], classes)


def _save(scenario: str, rec: dict[str, Any]) -> None:
    out = os.environ.get("JAXREC_RECORD_ARGO")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{scenario}.json").write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")


def agrees(r: ArgoRun, wf: dict[str, Any], scenario: str) -> None:
    """The stand-in, replaying the finished Workflow ``wf`` of ``scenario`` with its real nodes' results, runs as
    the real controller ran it, closes the ledger's attempts and builds the run store's incidents."""
    report = argoctl.summary(wf)
    rec = argo_replay.record(wf)
    _save(scenario, rec)
    rep = argo_replay.replay(rec)
    assert argo_replay.disagreements(rec, rep) == [], report
    ledger = r.ledger()
    assert rep.attempts() == [(a.attempt, a.outcome, a.failure_class, a.decision) for a in ledger.attempts], report
    assert rep.executor.exit_status == [ledger.argo_status], report
    # Incidents: which attempts, their class, when the next slice was ready.
    classes = {a.attempt: a.failure_class for a in ledger.attempts}
    real = [t.incident for t in incidents_from_facts(read_attempt_facts(r.store))]
    mine = _standin_incidents(rep, r, classes)
    assert [(i.attempt, i.failure_class) for i in mine] == [(i.attempt, i.failure_class) for i in real], report
    for a, b in zip(mine, real, strict=True):
        assert (a.slice_ready_at is None) == (b.slice_ready_at is None), (a, b)
        if a.slice_ready_at is not None:
            assert abs(a.slice_ready_at - b.slice_ready_at) <= SLICE_READY_TOLERANCE_S, (a, b)
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
