"""The failure drill's pure parts: which cluster, which run, and the measures it prints from the run store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jaxrec.adapters.incidents import AttemptFacts, incidents_from_facts, read_attempt_facts
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import (
    ProvisionRecord,
    RestoreRecord,
    SupervisionRecord,
    WorkerExitReport,
    WorkerHeartbeat,
)
from workflows import drill

ROOT = Path(__file__).resolve().parents[1]


# -- which cluster ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("context", "yes", "want"),
    [
        ("gke-prod", False, "gke-prod"),  # named: used even when it is not the current one
        ("kind-dev", True, "kind-dev"),
        (None, True, "kind-dev"),  # --yes: the current context
    ],
)
def test_choose_context_uses_the_named_or_confirmed_cluster(context, yes, want):
    assert drill.choose_context(["kind-dev", "gke-prod"], "kind-dev", context, yes) == want


@pytest.mark.parametrize(
    ("context", "yes", "current", "words"),
    [
        (None, False, "kind-dev", "--context <name> (current context: kind-dev) or confirm"),
        ("gke-typo", True, "kind-dev", "--context gke-typo: no such context"),
        (None, True, None, "current context: none"),
    ],
)
def test_choose_context_refuses_an_unnamed_cluster(context, yes, current, words):
    with pytest.raises(drill.DrillError, match=words.replace("(", r"\(").replace(")", r"\)")):
        drill.choose_context(["kind-dev", "gke-prod"], current, context, yes)


def _kubeconfig(tmp_path: Path) -> Path:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "dev",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_main_refuses_in_one_line_before_any_api_call(tmp_path, capsys):
    code = drill.main(
        [
            "--workflow",
            str(ROOT / "argo/local-cpu.yaml"),
            "--inject",
            "delete-worker",
            "--kubeconfig",
            str(_kubeconfig(tmp_path)),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [
        "drill: the drill deletes pods and evicts nodes: name the cluster with --context <name> "
        "(current context: dev) or confirm the current one with --yes"
    ]


# -- which run ----------------------------------------------------------------------------------------------


def test_load_target_takes_the_file_as_it_is_with_declared_overrides():
    path = ROOT / "argo/local-cpu.yaml"
    t = drill.load_target(path, ["run-id=drill-1", "store-root=gs://bucket/runs-root"], "training")
    assert (t.run_id, t.store_root, t.namespace) == ("drill-1", "gs://bucket/runs-root", "training")
    original = yaml.safe_load(path.read_text())
    params = {p["name"]: p["value"] for p in t.doc["spec"]["arguments"]["parameters"]}
    assert params["run-id"] == "drill-1" and params["accept-safe-changes"] == "false"
    assert t.doc["spec"]["templates"] == original["spec"]["templates"]  # nothing rewritten beyond parameters
    assert {p["name"]: p["value"] for p in original["spec"]["arguments"]["parameters"]}["run-id"] == "local-cpu"


@pytest.mark.parametrize(
    ("params", "words"),
    [(["runid=x"], "-p runid=x: not name=value of a declared parameter"), (["run-id"], "-p run-id: not name=value")],
)
def test_load_target_refuses_an_undeclared_parameter(params, words):
    with pytest.raises(drill.DrillError, match=words):
        drill.load_target(ROOT / "argo/local-cpu.yaml", params, None)


def test_load_target_refuses_a_file_that_is_not_a_workflow(tmp_path):
    path = tmp_path / "rbac.yaml"
    shutil.copy(ROOT / "argo/rbac.yaml", path)
    with pytest.raises(drill.DrillError, match="not an Argo Workflow; give one of the files in argo/"):
        drill.load_target(path, [], None)


# -- the measures -------------------------------------------------------------------------------------------


def _sup(attempt: int, outcome: str, detected: float, stopped: float, last_step: int) -> SupervisionRecord:
    return SupervisionRecord(
        attempt=attempt,
        jobset=f"r-a{attempt}",
        outcome=outcome,
        reason="r",
        detected_at=detected,
        stopped_at=stopped,
        last_step=last_step,
    )


def _report(
    attempt: int, i: int, *, started: float, restored: float, first: float, last: int, restore: int, sps: float = 10.0
) -> WorkerExitReport:
    return WorkerExitReport(
        run_id="r",
        attempt=attempt,
        process_index=i,
        process_count=2,
        exit_code=0,
        exit_name="OK",
        last_step=last,
        restore_step=restore,
        started_at=started,
        restored_at=restored,
        first_step_at=first,
        compile_seconds=1.5 + i,
        steps_per_second=sps - i,
    )


def _restore(attempt: int, step: int) -> RestoreRecord:
    return RestoreRecord(
        attempt=attempt, run_id="r", config_hash="h", exit_code=0, restore_step=step, restore_path="", decided_at=0
    )


def _next_attempt(restore: int, last: int) -> AttemptFacts:
    return AttemptFacts(
        attempt=2,
        supervision=_sup(2, "succeeded", 200.0, 201.0, last),
        provision=ProvisionRecord(exit_code=0, message="ok", at=110.0),
        restore=_restore(2, restore),
        reports=(
            _report(2, 0, started=112.0, restored=118.0, first=120.0, last=last, restore=restore),
            _report(2, 1, started=113.0, restored=119.0, first=121.0, last=last, restore=restore),
        ),
    )


def test_incident_times_each_phase_from_the_failed_attempt_and_the_next():
    failed = AttemptFacts(
        attempt=1,
        supervision=_sup(1, "failed", 101.0, 104.0, 25),
        heartbeats=(WorkerHeartbeat(process_index=0, step=27, at=100.5),),
    )
    [t] = incidents_from_facts([_next_attempt(20, 60), failed], {1: ("delete-worker", 100.0)})
    i = t.incident
    assert (i.attempt, i.scenario, i.injected_at, i.detected_at, i.stopped_at) == (1, "delete-worker", 100, 101, 104)
    assert (i.slice_ready_at, i.workers_started_at, i.restored_at, i.first_step_at) == (110, 113, 119, 121)
    assert (i.pre_failure_step, i.restored_step, i.steps_lost, i.compile_seconds) == (27, 20, 7, 2.5)
    # steps 21..27: the first after the restore at 121, the other 6 at the slowest worker's 9 steps/s
    assert t.recovered_estimated and i.recovered_at == pytest.approx(121 + 6 / 9)
    lines = drill.measures_table([t])
    assert lines[1].split() == [
        "1",
        "delete-worker",
        "-",
        "1.0",
        "4.0",
        "10.0",
        "13.0",
        "19.0",
        "2.5",
        "21.7~",
        "7",
        "20",
    ]
    assert lines[-1].startswith("~ estimated")


@pytest.mark.parametrize(
    ("restore", "last", "recovered", "estimated", "lost"),
    [
        (30, 60, 121.0, False, 0),  # saved at the failure (preemption): back at the first step
        (20, 24, None, False, 10),  # the next attempt never got back to step 30: no recovery time
    ],
)
def test_recovery_time_is_measured_not_guessed_when_it_can_be(restore, last, recovered, estimated, lost):
    failed = AttemptFacts(attempt=1, supervision=_sup(1, "stalled", 101.0, 104.0, 30))
    [t] = incidents_from_facts([failed, _next_attempt(restore, last)])
    assert (t.incident.recovered_at, t.recovered_estimated, t.incident.steps_lost) == (recovered, estimated, lost)


def test_only_a_supervisors_failure_verdict_is_an_incident():
    facts = [
        AttemptFacts(attempt=1, supervision=_sup(1, "succeeded", 1, 2, 10)),
        AttemptFacts(attempt=2),  # no verdict (a lost supervisor, or still running)
        AttemptFacts(attempt=3, supervision=_sup(3, "failed", 5, 6, 12)),
    ]
    [t] = incidents_from_facts(facts)
    assert (t.incident.attempt, t.incident.slice_ready_at, t.incident.pre_failure_step) == (3, None, 12)


def test_read_attempt_facts_reads_what_the_steps_write(tmp_path):
    store = RunStore(str(tmp_path), "r")
    store.write_record(RunLayout.supervision(1), _sup(1, "failed", 101.0, 104.0, 25))
    store.write_record(RunLayout.heartbeat(1, 0), WorkerHeartbeat(process_index=0, step=26, at=100.0))
    store.write_bytes(RunLayout.heartbeat(1, 1), b"{torn")
    store.write_record(RunLayout.provision_record(2), ProvisionRecord(exit_code=0, message="ok", at=110.0))
    store.write_record(RunLayout.restore_record(2), _restore(2, 20))
    rep = _report(2, 0, started=112.0, restored=118.0, first=120.0, last=40, restore=20)
    store.write_record(RunLayout.worker_report(2, 0), rep)
    one, two = read_attempt_facts(store)
    assert (one.attempt, one.progress, len(one.heartbeats)) == (1, 26, 1)
    assert (two.provision.at, two.restore.restore_step, [r.process_index for r in two.reports]) == (110.0, 20, [0])


def test_has_checkpoint_counts_only_a_step_whose_manifest_is_written(tmp_path):
    """``--after-checkpoint``: a step orbax is still writing (no manifest yet) is not a checkpoint to drill after."""
    store = RunStore(str(tmp_path), "r")
    store.write_bytes(f"{RunLayout.checkpoint(10)}/state/part", b"x")
    store.write_bytes(RunLayout.checkpoint_manifest(10), b"{}")
    store.write_bytes(f"{RunLayout.checkpoint(20)}/state/part", b"x")
    assert drill.has_checkpoint(store, 10)
    assert not drill.has_checkpoint(store, 11)  # step 20's save is in flight
    store.write_bytes(RunLayout.checkpoint_manifest(20), b"{}")
    assert drill.has_checkpoint(store, 11)


# -- the kill -------------------------------------------------------------------------------------------------

_UNSHARE = shutil.which("unshare")


def _in_pid_namespace() -> bool:
    if _UNSHARE is None or os.geteuid() != 0:
        return False
    return subprocess.run([_UNSHARE, "-pf", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_pid_namespace(), reason="needs root and PID namespaces (unshare -pf --mount-proc)")
@pytest.mark.parametrize(("trainer_is_init", "want"), [(False, 0), (True, 3)])
def test_kill_script_sigkills_the_trainer_unless_it_is_pid_1(tmp_path, trainer_is_init, want):
    # Inside its own PID namespace, so that the script sees only the processes of this test.
    fake = "import time; time.sleep(30)"
    script = tmp_path / "kill.py"
    script.write_text(drill._KILL_TRAINER)
    if trainer_is_init:
        body = f"exec {sys.executable} -c '{fake}' -m trainer"
        cmd = [_UNSHARE, "-pf", "--mount-proc", "sh", "-c", body]
        init = subprocess.Popen(cmd)
        try:
            time.sleep(0.5)
            kids = subprocess.run(["pgrep", "-P", str(init.pid)], capture_output=True, text=True).stdout.split()
            enter = ["nsenter", "-t", kids[0], "-p", "-m", sys.executable, str(script)]
            assert subprocess.run(enter, timeout=30).returncode == want
            assert init.poll() is None  # still alive: nothing from inside can SIGKILL a namespace's init
        finally:
            init.kill()
            init.wait(timeout=30)
        return
    py = sys.executable
    body = f"{py} -c '{fake}' -m trainer & sleep 0.3; {py} {script}; echo rc=$?; wait $!; echo w=$?"
    out = subprocess.run(
        [_UNSHARE, "-pf", "--mount-proc", "sh", "-c", body], capture_output=True, text=True, timeout=30
    )
    assert out.stdout.split() == [f"rc={want}", "w=137"]  # the sleeper ended by SIGKILL (128 + 9)


# -- which pods are workers ---------------------------------------------------------------------------------


def _matches(selector: str, labels: dict[str, str]) -> bool:
    """A label selector of ``key=value`` and bare ``key`` (exists) terms, as the API server reads them."""
    for term in selector.split(","):
        key, _, value = term.partition("=")
        if key not in labels or ("=" in term and labels[key] != value):
            return False
    return True


WORKFLOW_FILES = sorted(p.name for p in (ROOT / "argo").glob("*.yaml") if p.name.count(".") == 1 and p.stem != "rbac")


@pytest.mark.parametrize("name", WORKFLOW_FILES)
def test_the_drill_picks_its_victim_among_the_workers_never_a_step_pod(name):
    """Step pods carry the run and attempt labels too: the drill's selector matches none of them, and matches a
    worker pod (the attempt's labels of the JobSet's pod template, plus the JobSet controller's own)."""
    doc = yaml.safe_load((ROOT / "argo" / name).read_text())
    assert doc["kind"] == "Workflow"
    sel = drill.workers_selector("r1", 3)
    steps = [t for t in doc["spec"]["templates"] if (t.get("metadata") or {}).get("labels")]
    assert steps, "no step template carries labels: the check would prove nothing"
    for t in steps:
        labels = {k: "r1" if "run-id" in k else "3" for k in t["metadata"]["labels"]}
        assert not _matches(sel, labels), f"the drill's worker selector matches step {t['name']}'s pods: {labels}"
    worker = {"jaxrec/run-id": "r1", "jaxrec/attempt": "3", "jobset.sigs.k8s.io/jobset-name": "r1-a3"}
    assert _matches(sel, worker)


def test_each_world_performs_the_verb_of_every_fault_it_runs():
    """The drill's scene has the verb of each row it injects, the local scene that of each row a local run acts on
    (the trainer's faults and the withheld workers have none); every verb a row names is one of ``Verbs``."""
    from workflows.faults import FAULTS, Verbs
    from workflows.local.inject import LocalScene

    verbs = {n for n in vars(Verbs) if not n.startswith("_")}
    assert {f.verb for f in FAULTS if f.verb} <= verbs
    for f in FAULTS:
        if f.on_cluster:
            assert f.verb and callable(getattr(drill.Scene, f.verb, None)), f.name
        acts_locally = f.trigger in ("watch", "after-failure", "hosts")
        assert acts_locally == (f.trigger is not None and f.verb is not None), f.name
        if acts_locally:
            assert callable(getattr(LocalScene, f.verb, None)), f.name
