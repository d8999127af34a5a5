"""The local stand-in against recordings of Argo's real workflow-controller (v4.0.5), and its lost supervisor.

``tests/data/argo-v4.0.5/<scenario>.json`` are Workflows as the real controller finished them in the
real-controller tier (``tests/k8s/test_argo.py`` through ``standin.agrees``, written with
``JAXREC_RECORD_ARGO=<dir>``): the shipped ``argo/v5e-4x4.yaml`` with the README scenarios' step results.
Replayed through the stand-in's interpreter with the same step results, it must run the same nodes, retry as often
and end in the same phase. Re-record them when the tier's comparison changes what it keeps.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from support import argo_replay

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import SupervisionConfig, load_config
from jaxrec.model.jobset import JobSetParams, jobset_manifest
from workflows.local import executor as local_executor
from workflows.local.cluster import SliceHooks
from workflows.local.engine import ERROR, SUCCEEDED, NodeInfo
from workflows.local.executor import LocalExecutor, pod_deleted

REPO = Path(__file__).resolve().parents[1]
RECORDINGS = REPO / "tests" / "data" / "argo-v4.0.5"
SCENARIOS = ("app-bug", "kill-worker", "preempt", "supervisor-lost")


def _recording(scenario: str) -> dict:
    return json.loads((RECORDINGS / f"{scenario}.json").read_text())


def test_every_scenario_both_can_run_has_a_recording_of_the_real_controller():
    assert sorted(p.stem for p in RECORDINGS.glob("*.json")) == sorted(SCENARIOS)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_stand_in_replays_the_real_controllers_run_to_the_same_nodes_and_phase(scenario):
    rec = _recording(scenario)
    rep = argo_replay.replay(rec)
    assert argo_replay.disagreements(rec, rep) == []
    assert rep.status == rec["phase"] and rep.executor.exit_status == [rec["phase"]]


def test_a_changed_retry_decision_is_a_disagreement():
    # The comparison can fail: a train-segment that is no longer retried after a lost pod is reported.
    rec = _recording("supervisor-lost")
    for t in rec["spec"]["templates"]:
        if t["name"] == "train-segment":
            t["retryStrategy"]["expression"] = "asInt(lastRetry.exitCode) > 0"
    found = argo_replay.disagreements(rec, argo_replay.replay(rec))
    assert any("run by the real controller, not by the stand-in" in d for d in found), found
    assert any("workflow phase: real Succeeded" in d for d in found), found


def test_the_real_controller_ended_the_evicted_supervisors_node_as_the_stand_in_does():
    lost = [n for n in argo_replay.leaves(_recording("supervisor-lost")) if n["templateName"] == "train-segment"]
    first = lost[0]
    model = pod_deleted()
    if first["phase"] == "Error":
        assert (first["phase"], first["message"], first.get("exitCode")) == (model.phase, model.message, None)
    else:  # the kubelet's report of the SIGTERMed pod came first: Failed with the exit code
        assert (first["phase"], first["exitCode"]) == ("Failed", "143")
    assert [n["phase"] for n in lost[1:]] == ["Succeeded"]


# --- the stand-in's own lost supervisor ----------------------------------------------------------------------------

# A worker that runs a few seconds and exits 0 (SIGTERM: 143), so that the gang ends without training.
WORKER = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: exit(143)); time.sleep(3)"


class _LoseSupervisorOnce(SliceHooks):
    def __init__(self):
        self.fired = False

    def on_tick(self, sl):
        if not self.fired:
            self.fired = True
            sl.supervisor_lost.set()


def _segment(tmp_path, hooks):
    cfg = load_config(REPO / "configs" / "local-cpu.yaml")
    store_root = str(tmp_path / "store")
    cfg = cfg.model_copy(
        update={
            "supervision": SupervisionConfig(startup_deadline_s=30, watch_interval_s=0.1, hang_timeout_s=60),
            "slice": cfg.slice.model_copy(update={"hosts": 2}),
        }
    )
    RunStore(store_root, cfg.run_id).write_json(
        RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()}
    )
    js = jobset_manifest(
        cfg,
        JobSetParams(
            name=f"{cfg.run_id}-a0",
            run_id=cfg.run_id,
            store_root=store_root,
            attempt="0",
            restore_step="-1",
            coordinator_port="1",
            metrics_port="0",
        ),
    )
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["command"], pod["containers"][0]["args"] = [sys.executable, "-c", WORKER], []
    command = [
        "python",
        "-m",
        "recovery_steps.train_segment",
        "--store-root",
        store_root,
        "--run-id",
        cfg.run_id,
        "--attempt",
        "0",
        "--jobset-manifest",
        json.dumps(js),
        "--output-dir",
        "/tmp/outputs",
    ]
    ex = LocalExecutor(repo_root=REPO, work_dir=tmp_path / "work", hooks=hooks)
    node = NodeInfo("n1", "train-segment", "train-segment", "train-segment", "0", 0)
    tmpl = {"container": {"command": command}, "outputs": {"parameters": []}}
    return ex, lambda: ex.run_container(node, tmpl)


def test_a_supervisor_lost_in_its_nodes_first_seconds_is_created_again_in_the_same_node(tmp_path):
    ex, run = _segment(tmp_path, _LoseSupervisorOnce())
    res = run()
    assert res.phase == SUCCEEDED and res.exit_code == 0, res
    # One gang, re-attached by the second supervisor: its workers ran to their end once.
    (sl,) = ex.slices
    assert [w.exit_code for w in sl.workers] == [0, 0] and not ex.live
    log = next((tmp_path / "work" / "logs").glob("n1-*.log")).read_text()
    assert "its pod is created again" in log


def test_a_supervisor_lost_later_ends_its_node_as_argo_ends_a_deleted_pod(tmp_path, monkeypatch):
    monkeypatch.setattr(local_executor, "RECENTLY_STARTED_POD_S", 0.0)
    ex, run = _segment(tmp_path, _LoseSupervisorOnce())
    res = run()
    # Error "pod deleted" with no exit code: the retry expression reads -1 (Argo's lastRetry.exitCode default).
    assert (res.phase, res.message, res.exit_code) == (ERROR, "pod deleted", None), res
    (sl,) = ex.slices
    assert ex.live == {sl.jobset: sl}  # the gang runs on for the retried supervisor to re-attach to
    for w in sl.workers:
        sl.signal_worker(w.index, signal.SIGKILL)
        w.proc.wait(timeout=30)
