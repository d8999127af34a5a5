"""The exit handler (finalize): the ledger, the lease, the gang of a run that did not succeed; and give-up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.ckpt_factory import restore_record, tiny_config, write_run_config
from support.fake_k8s import FakeCluster, forbidden, status
from support.provision_api import jobset as _jobset
from support.provision_api import store_config as _store_config

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import Decision, ExitCode, FailureClass
from jaxrec.model.records import AttemptRecord, HandOver, Ledger, RunLease
from recovery_steps import finalize, give_up, hand_over, lease
from recovery_steps.retry import append_attempt

RUN = "fin-run"


def validated(store: RunStore) -> RunStore:
    """The run as validate-config leaves it (finalize records nothing for a run that was never validated)."""
    write_run_config(store, tiny_config(run_id=store.run_id))
    return store


def failed(n, cls, before, after, decision=Decision.RETRY, **extra):
    return AttemptRecord(
        attempt=n,
        outcome="failed",
        failure_class=cls,
        reason=f"{cls.value} on worker {n}",
        decision=decision,
        backoff_seconds=4 * (n + 1),
        checkpoint_step_before=before,
        checkpoint_step_after=after,
        closed_at=1.0,
        **extra,
    )


def test_succeeded_after_recoveries(store_root, tmp_path, capsys):
    store = validated(RunStore(store_root, RUN))
    append_attempt(store, failed(0, FailureClass.PREEMPTION, -1, 20))
    append_attempt(store, failed(1, FailureClass.INFRASTRUCTURE, 20, 40))
    restore_record(store, 2, 40)
    store.write_json(RunLayout.checkpoint_manifest(60), {"step": 60})
    code = finalize.main(
        [
            "--store-root",
            store_root,
            "--run-id",
            RUN,
            "--status",
            "Succeeded",
            "--failures",
            "null",
            "--output-dir",
            str(tmp_path / "o"),
            "--workflow",
            "wf-c1",
        ]
    )
    assert code == 0
    assert (tmp_path / "o" / "final-status").read_text() == "Succeeded"
    led = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert led.final_status == "Succeeded"
    assert led.final_reason.startswith("training completed in attempt 2 after recovering from 2 interruption(s)")
    assert "fail" not in led.final_reason.lower()
    done = led.attempts[-1]
    assert (done.attempt, done.outcome, done.checkpoint_step_before, done.checkpoint_step_after) == (
        2,
        "succeeded",
        40,
        60,
    )
    assert done.workflow == "wf-c1"  # the Workflow that ran it to the end (a continuation's, after a hand-over)
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"run {RUN}: Succeeded: {led.final_reason}"
    table = out.splitlines()[1:]
    assert table[0].split() == ["attempt", "class", "decision", "checkpoint", "backoff"]
    assert table[1].split() == ["0", "preemption", "retry", "-1", "->", "20", "4s"]
    assert table[3].split() == ["2", "succeeded", "-", "40", "->", "60", "-"]


def test_failed_after_budget_spent(tmp_path, capsys):
    root = str(tmp_path / "store")
    store = validated(RunStore(root, RUN))
    append_attempt(store, failed(0, FailureClass.APPLICATION, -1, 10))
    append_attempt(
        store,
        failed(
            1,
            FailureClass.APPLICATION,
            10,
            10,
            Decision.STOP,
            decision_reason="application budget spent: 2 application failure(s)",
        ),
    )
    argo_failures = json.dumps(
        [
            {
                "displayName": "give-up",
                "message": "Error (exit code 1)",
                "templateName": "give-up",
                "phase": "Failed",
                "podName": "p",
                "finishedAt": "2024-05-01T10:00:00Z",
            }
        ]
    )
    r = finalize.run(RunStore(root, RUN), "Failed", argo_failures, tmp_path / "o")
    assert r.final_status == "Failed"
    assert r.final_reason.startswith("stopped after attempt 1: application budget spent")
    assert "completed" not in r.final_reason
    assert (tmp_path / "o" / "final-status").read_text() == "Failed"
    led = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert led.final_status == "Failed" and len(led.attempts) == 2


def test_failed_before_any_attempt_uses_argo_failures(tmp_path):
    root = str(tmp_path / "store")
    validated(RunStore(root, RUN))
    nodes = json.dumps([{"displayName": "provision-slice", "message": "Error (exit code 2)", "phase": "Failed"}])
    r = finalize.run(RunStore(root, RUN), "Error", nodes)
    assert (r.final_status, r.final_reason) == ("Failed", "provision-slice failed: Error (exit code 2)")
    r2 = finalize.run(RunStore(root, RUN), "Failed", "{{workflow.failures}}")
    assert r2.final_reason.startswith("the workflow ended before any attempt was classified")


def test_a_run_never_validated_gets_no_ledger_and_one_line(tmp_path, capsys):
    root = tmp_path / "store"
    nodes = json.dumps([{"displayName": "validate-config", "message": "Error (exit code 2)", "phase": "Failed"}])
    store = RunStore(str(root), RUN)
    # validate-config took the lease, then refused the config
    lease.acquire(store, lease.Claimant("uid-a", "wf-a"), 600)
    argv = ["--store-root", str(root), "--run-id", RUN, "--status", "Failed", "--failures", nodes]
    assert finalize.main([*argv, "--holder", "uid-a", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "never validated" in err and "validate-config failed" in err, err
    assert sorted(p.name for p in (root / "runs" / RUN).iterdir() if not p.name.startswith(".")) == ["lease.json"]
    assert store.read_record(RunLayout.LEASE, RunLease).released  # the lease is not left held
    assert not (tmp_path / "o").exists()
    assert finalize.main(["--store-root", str(tmp_path / "elsewhere"), "--run-id", RUN, "--status", "Failed"]) == 2
    assert not (tmp_path / "elsewhere").exists()


def test_finalize_twice_is_idempotent(tmp_path):
    root = str(tmp_path / "store")
    store = validated(RunStore(root, RUN))
    restore_record(store, 0, -1)
    finalize.run(RunStore(root, RUN), "Succeeded")
    finalize.run(RunStore(root, RUN), "Succeeded")
    led = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert [(a.attempt, a.outcome) for a in led.attempts] == [(0, "succeeded")]
    assert led.final_reason == "training completed in attempt 0"


def test_an_attempt_open_when_the_run_was_stopped_is_closed_as_stopped_and_charged_nothing(tmp_path):
    """``argo stop`` mid-attempt: the exit handler stops the gang, and the ledger still lists that attempt."""
    root = str(tmp_path / "store")
    store = validated(RunStore(root, RUN))
    append_attempt(store, failed(0, FailureClass.APPLICATION, -1, 10))
    restore_record(store, 1, 10)
    store.write_json(RunLayout.checkpoint_manifest(20), {"step": 20})
    stop = json.dumps([{"displayName": "train-segment(0)", "message": "Stopped with strategy 'Stop'"}])
    assert [a.attempt for a in finalize.run(RunStore(root, RUN), "Failed", stop).ledger.attempts] == [
        0
    ]  # not the holder's
    r = finalize.run(RunStore(root, RUN), "Failed", stop, closes_open=True, clock=lambda: 5.0, workflow="wf-b")
    first, stopped = r.ledger.attempts
    assert stopped.workflow == "wf-b"
    assert first == failed(0, FailureClass.APPLICATION, -1, 10)  # a closed attempt is never rewritten
    assert (stopped.attempt, stopped.outcome, stopped.failure_class, stopped.decision) == (1, "stopped", None, None)
    assert (stopped.checkpoint_step_before, stopped.checkpoint_step_after, stopped.ended_at) == (10, 20, 5.0)
    assert "train-segment(0) failed: Stopped with strategy 'Stop'" in stopped.reason
    assert r.ledger.by_class() == Ledger(run_id=RUN, attempts=[first]).by_class()  # the stop charged no class
    again = finalize.run(RunStore(root, RUN), "Failed", stop, closes_open=True, clock=lambda: 9.0)
    assert again.ledger.attempts == r.ledger.attempts  # a retry of the exit handler changes nothing


def test_a_resupervised_attempt_is_closed_as_stopped_with_its_gang_named(tmp_path):
    root = str(tmp_path / "store")
    store = validated(RunStore(root, RUN))
    restore_record(store, 0, -1)
    append_attempt(
        store,
        AttemptRecord(attempt=0, outcome="running", started_at=2.0, jobset=f"{RUN}-a0", workflow="wf-a", backend="gke"),
    )
    (stopped,) = finalize.run(RunStore(root, RUN), "Failed", None, closes_open=True).ledger.attempts
    assert (stopped.outcome, stopped.started_at, stopped.jobset, stopped.workflow) == (
        "stopped",
        2.0,
        f"{RUN}-a0",
        "wf-a",
    )


def test_unreadable_ledger_exits_with_message(tmp_path, capsys):
    root = str(tmp_path / "store")
    validated(RunStore(root, RUN)).write_bytes(RunLayout.LEDGER, b"[1, 2")
    assert finalize.main(["--store-root", root, "--run-id", RUN, "--status", "Failed"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("finalize: ") and "unreadable ledger" in err


def test_give_up_says_the_class_and_the_reason_in_one_line():
    assert give_up.verdict("application", "application budget spent:\n 2 failures") == (
        "giving up: class application: application budget spent: 2 failures"
    )
    assert give_up.verdict("weird", " ") == "giving up: class weird (not a known failure class): no reason given"


def test_give_up_as_a_program():
    p = subprocess.run(
        [sys.executable, "-m", "recovery_steps.give_up", "--failure-class", "hang", "--reason", "hang budget spent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1
    assert p.stderr.strip() == (
        "giving up: class hang: hang budget spent; to go on after a fix: argo resubmit (docs/RUNBOOK.md section 4)"
    )
    assert p.stdout == ""


def _give_up(root, cluster, holder="uid-a", *extra):
    args = ["--failure-class", "application", "--reason", "application budget spent: 2 failures"]
    args += ["--store-root", root, "--run-id", GKE_RUN, "--holder", holder, "--workflow", "wf-a"]
    return give_up.main([*args, "--namespace", "training", "--k8s-host", cluster.url, *extra])


def test_give_up_of_the_lease_holder_gives_up_says_how_to_go_on_and_labels_its_workflow(gke, capsys):
    root, _, cluster = gke
    described = {"workflows.argoproj.io/description": "Run continued from attempt 30"}
    cluster.put("workflows", {"metadata": {"name": "wf-a", "annotations": described}, "spec": {}})
    assert _give_up(root, cluster) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "giving up: class application: application budget spent: 2 failures; "
        "to go on after a fix: argo resubmit -n training wf-a (docs/RUNBOOK.md section 4)"
    )
    wf = cluster.objects["workflows"]["wf-a"]
    assert wf["spec"] == {}  # left to fail on its own
    assert wf["metadata"]["labels"] == {"jaxrec/failure-class": "application"}
    assert wf["metadata"]["annotations"]["workflows.argoproj.io/description"] == (
        "giving up: class application: application budget spent: 2 failures\n\nRun continued from attempt 30"
    )


@pytest.mark.parametrize(
    "description, kept",
    [
        ("giving up: class application: r\n\nRun continued from attempt 30", "Run continued from attempt 30"),
        ("giving up: class application: r", None),
        ("Run continued from attempt 30", "Run continued from attempt 30"),
    ],
)
def test_a_resubmitted_workflow_loses_the_give_up_marks_it_copied(description, kept):
    """argo resubmit copies labels and annotations: validate-config of the new Workflow takes the give-up's off."""
    from jaxrec.adapters.kube import Kube, make_api_client

    cluster = FakeCluster()
    meta = {"name": "wf-b", "labels": {"jaxrec/failure-class": "application", "jaxrec/run-id": GKE_RUN}}
    cluster.put("workflows", {"metadata": {**meta, "annotations": {"workflows.argoproj.io/description": description}}})
    try:
        kube = Kube(make_api_client(cluster.url), "training")
        assert lease.clear_give_up_marks(kube, "wf-b")
        assert not lease.clear_give_up_marks(kube, "wf-b")  # nothing left to take
    finally:
        cluster.close()
    wf = cluster.objects["workflows"]["wf-b"]["metadata"]
    assert wf["labels"] == {"jaxrec/run-id": GKE_RUN}
    assert (wf.get("annotations") or {}).get("workflows.argoproj.io/description") == kept
    assert len(cluster.requests_of("PATCH", "/workflows/wf-b")) == 1


def test_give_up_gives_up_all_the_same_when_its_workflow_cannot_be_labelled(gke, capsys):
    root, _, cluster = gke
    cluster.put("workflows", {"metadata": {"name": "wf-a"}, "spec": {}})
    cluster.inject("/workflows/wf-a", 403, status(403, "Forbidden", "patch forbidden"), method="PATCH")
    assert _give_up(root, cluster) == 1
    log, line = capsys.readouterr().err.splitlines()
    assert log.startswith("give-up: the Workflow keeps no label of its class:") and "403" in log
    assert line.startswith("giving up: class application: application budget spent: 2 failures; to go on")


@pytest.mark.parametrize("case", ["released", "another-holder"])
def test_a_replayed_give_up_stops_its_own_workflow_and_says_what_to_run(gke, capsys, case):
    """argo retry of a run that gave up: Argo runs give-up again after the exit handler released the lease."""
    root, store, cluster = gke
    cluster.put("workflows", {"metadata": {"name": "wf-a"}, "spec": {"entrypoint": "main"}})
    lease.release(store, "uid-a")
    if case == "another-holder":
        _take(store, "uid-b")  # the run resubmitted since
    assert _give_up(root, cluster) == 1
    (patch,) = cluster.requests_of("PATCH", "/workflows/wf-a")
    assert patch[2] == {"spec": {"shutdown": "Stop"}}
    assert cluster.objects["workflows"]["wf-a"]["spec"] == {"entrypoint": "main", "shutdown": "Stop"}
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "giving up: class application: application budget spent: 2 failures; this Workflow had already ended "
        "(argo retry replays it; its exit handler released the run): stopped it; to go on after a fix: argo "
        "resubmit -n training wf-a (docs/RUNBOOK.md section 4)"
    )


def test_a_replayed_give_up_that_cannot_stop_its_workflow_says_why(gke, capsys):
    root, store, cluster = gke
    lease.release(store, "uid-a")
    cluster.inject("/workflows/wf-a", 503, status(503, "ServiceUnavailable", "etcd leader changed"), method="PATCH")
    assert _give_up(root, cluster) == int(ExitCode.TRANSIENT)  # retried by the step's retryStrategy
    assert "stop workflow wf-a in training" in capsys.readouterr().err


def test_give_up_with_a_holder_needs_where_it_runs(tmp_path, capsys):
    args = ["--failure-class", "hang", "--reason", "r", "--holder", "uid-a"]
    assert give_up.main(args) == int(ExitCode.CONFIGURATION)
    assert "--holder needs --store-root" in capsys.readouterr().err


# --- a run that ends other than Succeeded stops its gang --------------------------------------------------

GKE_RUN = "lm-v5e-4x4"


def _lease(holder="uid-a", released=False, first_attempt=0):
    return RunLease(
        run_id=GKE_RUN,
        holder=holder,
        holder_name=f"wf-{holder}",
        acquired_at=1.0,
        renewed_at=1.0,
        ttl_s=3600,
        released=released,
        first_attempt=first_attempt,
    )


def _take(store, holder="uid-a", first_attempt=0):
    """The lease as validate-config leaves it: taken after the config compared, confirmed once pinned."""
    lease.acquire(store, lease.Claimant(holder, f"wf-{holder.removeprefix('uid-')}"), 3600)
    lease.confirm(store, holder, first_attempt)


def _handed(holder):
    h = HandOver(
        from_workflow="wf-a", from_uid=holder, to_workflow="c30", to_uid="uid-c", next_attempt=30, at=1.0, backend="gke"
    )
    return Ledger(run_id=GKE_RUN, hand_overs=[h])


@pytest.mark.parametrize(
    "status, current, holder, ledger, stops",
    [
        ("Failed", _lease(), "uid-a", None, True),  # argo stop: Argo runs the exit handler with status Failed
        ("Error", _lease(), "uid-a", Ledger(run_id=GKE_RUN), True),
        ("Succeeded", _lease(), "uid-a", None, False),
        ("Failed", _lease("uid-b"), "uid-a", None, False),  # another workflow holds the run
        ("Failed", _lease(released=True), "uid-a", None, False),
        ("Failed", None, "uid-a", None, False),  # no lease was ever taken: this workflow started no gang
        ("Failed", _lease(), None, None, False),
        ("Failed", _lease(), "uid-a", _handed("uid-a"), False),  # handed over: the continuation's gang
        ("Failed", _lease(), "uid-a", _handed("uid-z"), True),
        # validate-config took the lease and then refused, or never finished: it acts on nothing
        ("Failed", _lease(first_attempt=None), "uid-a", None, False),
    ],
)
def test_stops_gang_table(status, current, holder, ledger, stops):
    assert finalize.stops_gang(status, current, holder, ledger) is stops


@pytest.fixture
def gke(tmp_path):
    """A GKE run held by workflow uid-a, its gang (attempt 2, attempt 1 still going) and another run's JobSet."""
    root = str(tmp_path / "store")
    _store_config(root, "v5e-4x4.yaml")
    store = RunStore(root, GKE_RUN)
    _take(store)
    cluster = FakeCluster()
    for js in (
        _jobset(f"{GKE_RUN}-a2", GKE_RUN),
        _jobset(f"{GKE_RUN}-a1", GKE_RUN, deleting=True),
        _jobset("other-run-a0", "other-run"),
    ):
        cluster.put("jobsets", js)
    yield root, store, cluster
    cluster.close()


def _finalize(root, cluster, status="Failed", holder="uid-a"):
    return finalize.main(
        ["--store-root", root, "--run-id", GKE_RUN, "--status", status, "--holder", holder, "--k8s-host", cluster.url]
    )


def test_a_stopped_run_deletes_its_gang_and_says_which_in_one_line(gke, capsys):
    root, store, cluster = gke
    assert _finalize(root, cluster) == 0
    (delete,) = cluster.requests_of("DELETE", "/jobsets")
    assert delete[1].startswith(f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/training/jobsets/{GKE_RUN}-a2")
    assert delete[2]["propagationPolicy"] == "Foreground"
    assert sorted(cluster.objects["jobsets"]) == [f"{GKE_RUN}-a1", "other-run-a0"]
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "JobSet" in ln]
    assert line == (
        f"finalize: run {GKE_RUN} ended Failed: deleted JobSet {GKE_RUN}-a2 in namespace training "
        f"(foreground); already being deleted: {GKE_RUN}-a1"
    )
    assert store.read_record(RunLayout.LEASE, RunLease).released
    assert store.read_record(RunLayout.LEDGER, Ledger).final_status == "Failed"


@pytest.mark.parametrize("case", ["succeeded", "another-holder", "handed-over"])
def test_the_gang_is_left_alone_when_the_run_succeeded_or_is_not_this_workflows(gke, capsys, case):
    root, store, cluster = gke
    if case == "another-holder":
        lease.release(store, "uid-a")
        _take(store, "uid-b")  # a live submission that took the run
    if case == "handed-over":
        hand_over.pass_lease(store, "uid-a", hand_over.Continuation(f"{GKE_RUN}-c30", "uid-c"), 3600, first_attempt=30)
        hand_over.record(
            store,
            HandOver(
                from_workflow="wf-a",
                from_uid="uid-a",
                to_workflow=f"{GKE_RUN}-c30",
                to_uid="uid-c",
                next_attempt=30,
                at=1.0,
                backend="gke",
            ),
        )
    assert _finalize(root, cluster, "Succeeded" if case == "succeeded" else "Failed") == 0
    assert cluster.requests == []  # not even listed
    assert len(cluster.objects["jobsets"]) == 3


def test_a_holder_that_never_confirmed_records_nothing_and_deletes_nothing(gke, capsys):
    """Its validate-config took the lease, then refused (or died): the gang it came to adopt trains on."""
    root, store, cluster = gke
    store.write_record(
        RunLayout.LEASE, store.read_record(RunLayout.LEASE, RunLease).model_copy(update={"first_attempt": None})
    )
    assert _finalize(root, cluster) == 0
    assert cluster.requests == [] and len(cluster.objects["jobsets"]) == 3
    assert "never validated" in capsys.readouterr().out
    assert store.read_record(RunLayout.LEASE, RunLease).released
    assert store.read_record(RunLayout.LEDGER, Ledger) is None  # no final status written for the run


def test_an_api_outage_leaves_the_lease_held_for_the_retry_that_stops_the_gang(gke, capsys):
    root, store, cluster = gke
    unavailable = status(503, "ServiceUnavailable", "the server is currently unable to handle the request")
    cluster.inject("/jobsets", 503, unavailable)
    assert _finalize(root, cluster) == 69
    err = capsys.readouterr().err
    assert "could not stop run lm-v5e-4x4's gang: Kubernetes API answered 503" in err and "Argo retries" in err
    assert not store.read_record(RunLayout.LEASE, RunLease).released
    cluster.faults.clear()
    assert _finalize(root, cluster) == 0  # Argo's retry of the exit handler
    assert sorted(cluster.objects["jobsets"]) == [f"{GKE_RUN}-a1", "other-run-a0"]
    assert store.read_record(RunLayout.LEASE, RunLease).released
    assert store.read_record(RunLayout.LEDGER, Ledger).final_status == "Failed"


def test_a_refused_delete_names_the_command_that_stops_the_gang_by_hand(gke, capsys):
    root, store, cluster = gke
    cluster.inject("/jobsets", 403, forbidden("list", "jobsets", group="jobset.x-k8s.io", namespace="training"))
    assert _finalize(root, cluster) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "Kubernetes API answered 403" in line
    assert line.endswith("delete the gang by hand: kubectl delete jobsets -n training -l jaxrec/run-id=lm-v5e-4x4")
    assert store.read_record(RunLayout.LEASE, RunLease).released  # no retry comes: the next submission takes over


def test_a_cpu_slice_deletes_its_jobset_through_the_api_as_on_gke(tmp_path, capsys):
    """The CPU slice's gang is a JobSet wherever it runs (the local runner serves its cluster as the Kubernetes API):
    it is stopped as on GKE."""
    root = str(tmp_path / "store")
    run_id = _store_config(root, "local-cpu.yaml")
    store = RunStore(root, run_id)
    _take(store)
    cluster = FakeCluster(namespace="default")
    cluster.put("jobsets", _jobset(f"{run_id}-a0", run_id, namespace="default"))
    try:
        assert (
            finalize.main(
                [
                    "--store-root",
                    root,
                    "--run-id",
                    run_id,
                    "--status",
                    "Failed",
                    "--holder",
                    "uid-a",
                    "--k8s-host",
                    cluster.url,
                ]
            )
            == 0
        )
    finally:
        cluster.close()
    out = capsys.readouterr().out
    assert f"deleted JobSet {run_id}-a0 in namespace default (foreground)" in out, out
    assert cluster.objects["jobsets"] == {}
    assert store.read_record(RunLayout.LEASE, RunLease).released


def test_the_failed_step_named_is_the_same_whatever_order_argo_lists_the_failures_in():
    import itertools

    from jaxrec.model.records import Ledger
    from recovery_steps.finalize import final_reason

    # As Argo v4.0.5 lists them for a provision that failed for good: DAG nodes (no message), the Retry node
    # (its expression), the pod node (its own message); a pod name for each.
    failures = [
        {"displayName": "run-x", "message": "", "podName": "run-x", "finishedAt": "2026-01-01T00:00:09Z"},
        {"displayName": "attempt", "message": "", "podName": "run-x-attempt-1", "finishedAt": "2026-01-01T00:00:09Z"},
        {
            "displayName": "provision-slice",
            "message": "retryStrategy.expression evaluated to false",
            "podName": "run-x-provision-slice-2",
            "finishedAt": "2026-01-01T00:00:08Z",
        },
        {
            "displayName": "provision-slice(2)",
            "message": "main: Error (exit code 3)",
            "podName": "run-x-provision-slice-3",
            "finishedAt": "2026-01-01T00:00:08Z",
        },
    ]
    ledger = Ledger(run_id="x", attempts=[])
    reasons = {final_reason("Failed", ledger, list(p)) for p in itertools.permutations(failures)}
    assert reasons == {"provision-slice(2) failed: main: Error (exit code 3)"}


def test_a_store_outage_at_the_last_lease_release_is_transient_and_the_retry_releases(gcs_emulator, monkeypatch):
    """The exit handler recorded the run's end; the one write left, the lease's release, meets a 503: the step exits
    transient (69) for Argo's retry, which finds the end recorded and releases the lease, never exit 1."""
    from workflows.local.outage import OutageProxy

    proxy = OutageProxy(gcs_emulator.url)
    try:
        for k, v in proxy.env(gcs_emulator.env).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("JAXREC_STORE_RETRY_DEADLINE_S", "0.5")
        root = f"gs://test-bucket/final-release-{id(proxy)}"
        _store_config(root, "v5e-4x4.yaml")
        store = RunStore(root, GKE_RUN)
        _take(store)
        release = lease.release

        def down_then_release(s, holder):  # the outage begins with the release's own requests
            proxy.down_for(60)
            return release(s, holder)

        monkeypatch.setattr(lease, "release", down_then_release)
        args = ["--store-root", root, "--run-id", GKE_RUN, "--status", "Succeeded", "--holder", "uid-a"]
        assert finalize.main(args) == ExitCode.TRANSIENT and proxy.refused >= 1
        proxy.down_for(0)
        monkeypatch.setattr(lease, "release", release)
        assert not store.read_record(RunLayout.LEASE, RunLease).released
        assert finalize.main(args) == 0  # Argo's retry of the exit handler
        assert store.read_record(RunLayout.LEASE, RunLease).released
        assert store.read_record(RunLayout.LEDGER, Ledger).final_status == "Succeeded"
    finally:
        proxy.close()
