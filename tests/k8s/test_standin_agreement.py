"""The local stand-in (``python -m workflows.local``) against Argo's real workflow-controller (v4.0.5).

Each README scenario both can run is run here on the real controller with the shipped Workflow
(``argo/v5e-4x4.yaml``), as ``test_argo.py`` runs it: step pods as local processes (``podexec``), the JobSet's worker
pods on KWOK, the test ending them with the scenario's exit codes. The finished Workflow is recorded
(``argo_replay.record``) and replayed through the stand-in's interpreter (``workflows.local.engine``) with the real
nodes' results: the stand-in must run the same nodes, retry each template as often, take the same branches, give
the exit handler the same ``{{workflow.status}}`` and end in the same phase. Its attempts must be the ledger's, and
the incidents its builder (``workflows.local.incidents``) makes of them must name the attempts and classes, and the
slice-ready times, that ``recovery_steps.kernel.incidents`` reads from the run store. For the evicted supervisor,
the node the stand-in makes of a lost supervisor must be the node the real controller made.

With ``JAXREC_RECORD_ARGO=<dir>`` each recording is written to ``<dir>/<scenario>.json``; the fast suite replays the
recordings kept in ``tests/data/argo-v4.0.5`` (``tests/test_standin_replay.py``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import argoctl
import pytest
from argorun import ArgoRun, lose_supervisor
from argorun import clean as _clean
from realcluster import RealCluster
from support import argo_replay
from tier import REPO, apply_rbac

from recovery_steps.kernel.config import load_config
from recovery_steps.kernel.incidents import incidents_from_facts, read_attempt_facts
from recovery_steps.kernel.records import SupervisionRecord
from recovery_steps.kernel.store import RunLayout
from workflows.local.executor import pod_deleted
from workflows.local.incidents import Segment, build_incidents

pytestmark = pytest.mark.k8s

# The stand-in's slice-ready time is the provision-slice node's end (whole seconds on the real controller); the
# cluster's is the provision record's time, written by the step before its pod ends.
SLICE_READY_TOLERANCE_S = 5.0


@pytest.fixture
def real_run(real_cluster: RealCluster, argo, tpu_nodes, tmp_path) -> Iterator[ArgoRun]:
    cfg = load_config(REPO / "configs" / "v5e-4x4.yaml")
    apply_rbac(real_cluster, cfg)
    tpu_nodes(4, cfg)
    r = ArgoRun(real_cluster, cfg, tmp_path / "store")
    try:
        yield r
    finally:
        _clean(real_cluster, cfg.namespace)


def _app_bug(r: ArgoRun) -> None:
    for attempt in (0, 1):
        pods = r.workers(attempt)
        r.rc.exit_pod(r.ns, pods[1]["metadata"]["name"], 42)


def _recovered(who: str, code: int) -> Callable[[ArgoRun], None]:
    def drive(r: ArgoRun) -> None:
        pods = r.workers(0)
        r.beat(0, 5)
        for p in pods if who == "all" else pods[2:3]:
            r.rc.exit_pod(r.ns, p["metadata"]["name"], code)
        r.workers(1)
        r.beat(1, 12)
        r.exit_all(1, 0)

    return drive


def _supervisor_lost(r: ArgoRun) -> None:
    r.workers(0)
    r.beat(0, 5)
    lose_supervisor(r)
    r.beat(0, 15)
    r.exit_all(0, 0)


SCENARIOS: dict[str, Callable[[ArgoRun], None]] = {
    "app-bug": _app_bug,
    "kill-worker": _recovered("one", 137),
    "preempt": _recovered("all", 143),
    "supervisor-lost": _supervisor_lost,
}


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


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_stand_in_decides_as_the_real_controller_did(real_run, scenario):
    t0 = time.monotonic()
    real_run.submit()
    SCENARIOS[scenario](real_run)
    wf = real_run.wait_done(200)
    report = argoctl.summary(wf)
    rec = argo_replay.record(wf)
    _save(scenario, rec)
    rep = argo_replay.replay(rec)
    assert argo_replay.disagreements(rec, rep) == [], report
    ledger = real_run.ledger()
    assert rep.attempts() == [(a.attempt, a.outcome, a.failure_class, a.decision) for a in ledger.attempts], report
    assert rep.executor.exit_status == [ledger.argo_status], report
    # Incidents: which attempts, their class, when the next slice was ready.
    classes = {a.attempt: a.failure_class for a in ledger.attempts}
    real = [t.incident for t in incidents_from_facts(read_attempt_facts(real_run.store))]
    mine = _standin_incidents(rep, real_run, classes)
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
    print(f"{scenario}: the stand-in agrees with the real controller ({time.monotonic() - t0:.0f} s)\n{report}")
