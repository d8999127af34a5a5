"""The run lease: one live workflow per run id; a second submission fails in one line and deletes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.fake_k8s import FakeCluster, status
from support.provision_api import jobset, slice_cluster
from support.provision_api import node as _node
from support.provision_api import store_config as _store_config

from jaxrec.adapters.kube import make_api_client
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import Ledger, RunLease
from recovery_steps import finalize, lease, provision_slice, validate_config
from workflows.local.engine import WorkflowRun
from workflows.local.outage import OutageProxy

REPO = Path(__file__).resolve().parents[1]
CLUSTER = "0b6f6d3e-kube-system-uid"
HERE = lease.Site(namespace="training", cluster=CLUSTER)


def _lease(holder="uid-a", renewed=1000.0, ttl=600.0, released=False, namespace=None, cluster=None):
    return RunLease(
        run_id="r",
        holder=holder,
        holder_name=f"wf-{holder}",
        acquired_at=900.0,
        renewed_at=renewed,
        ttl_s=ttl,
        released=released,
        namespace=namespace,
        cluster=cluster,
    )


@pytest.mark.parametrize(
    "current, holder, at, alive, ok",
    [
        (None, "uid-b", 1000, None, True),
        (_lease(), "uid-a", 1100, None, True),  # renewal by the holder
        (_lease(), "uid-b", 1100, None, False),  # held and live
        (_lease(), "uid-b", 1600, None, True),  # expired at renewed + ttl
        (_lease(released=True), "uid-b", 1100, None, True),
        (_lease(), "uid-b", 1100, False, True),  # the holder's Workflow is gone
        (_lease(), "uid-b", 1100, True, False),
        (_lease(), "uid-b", 1600, True, False),  # expired, but its Workflow is known to run: never taken over
        (_lease(), "uid-b", 1600, False, True),
    ],
)
def test_decide_table(current, holder, at, alive, ok):
    assert lease.decide(current, holder, at, alive).ok is ok


def test_a_refusal_is_one_line_naming_the_holder_and_the_way_out():
    reason = lease.decide(_lease(), "uid-b", 1100).reason
    assert (
        "\n" not in reason and "wf-uid-a" in reason and "argo stop wf-uid-a" in reason and "expires in 500 s" in reason
    )
    alive = lease.decide(_lease(namespace="training"), "uid-b", 1700, holder_alive=True).reason
    assert "\n" not in alive and "still running although its lease expired 100 s ago" in alive
    assert "namespace training" in alive and "argo stop -n training wf-uid-a" in alive


def test_two_holders_cannot_both_win_and_release_frees_it(store_root):
    store = RunStore(store_root, "r")
    clock = iter([1000.0, 1001.0, 1002.0, 1003.0]).__next__
    lease.acquire(store, lease.Claimant("uid-a", "wf-a"), 600, clock=clock)
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(store, lease.Claimant("uid-b", "wf-b"), 600, clock=clock)
    assert not lease.release(store, "uid-b")  # never another's lease
    assert lease.release(store, "uid-a")
    assert lease.acquire(store, lease.Claimant("uid-b", "wf-b"), 600, clock=clock).holder == "uid-b"
    assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-b"


def _validate(cfg_file, root, out, holder):
    return validate_config.main(
        [
            "--config",
            str(cfg_file),
            "--store-root",
            root,
            "--output-dir",
            str(out),
            "--holder",
            holder,
            "--holder-name",
            f"wf-{holder}",
        ]
    )


def test_a_second_submission_of_a_local_run_fails_at_validate_config(tmp_path, capsys):
    cfg_file = REPO / "configs" / "local-cpu.yaml"
    root = str(tmp_path / "store")
    assert _validate(cfg_file, root, tmp_path / "o1", "uid-a") == 0
    capsys.readouterr()
    assert _validate(cfg_file, root, tmp_path / "o2", "uid-b") == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert line.startswith("configuration: run 'local-cpu' is held by workflow wf-uid-a")
    assert not (tmp_path / "o2" / "first-attempt").exists()
    # The loser's exit handler leaves the run's ledger alone; the holder's releases the lease.
    store = RunStore(root, "local-cpu")
    assert (
        finalize.main(["--store-root", root, "--run-id", "local-cpu", "--status", "Failed", "--holder", "uid-b"]) == 0
    )
    assert store.read_record(RunLayout.LEDGER, Ledger) is None
    assert (
        finalize.main(["--store-root", root, "--run-id", "local-cpu", "--status", "Succeeded", "--holder", "uid-a"])
        == 0
    )
    assert store.read_record(RunLayout.LEASE, RunLease).released
    assert _validate(cfg_file, root, tmp_path / "o3", "uid-b") == 0


def test_local_workflow_runs_have_distinct_uids():
    wf = {"spec": {"entrypoint": "x", "templates": []}, "metadata": {"name": "same"}}
    a, b = WorkflowRun(wf, executor=None), WorkflowRun(wf, executor=None)
    assert a.name == b.name and a.uid != b.uid
    assert a._global_names()["workflow.uid"] == a.uid


def _cluster_id(argo: FakeCluster, uid: str | None) -> None:
    """The cluster's id as the lease reads it, the uid of namespace kube-system; None: RBAC refuses that read."""
    if uid is None:
        msg = (
            'namespaces "kube-system" is forbidden: User "system:serviceaccount:training:jax-recovery" cannot get '
            'resource "namespaces" in API group "" in the namespace "kube-system"'
        )
        refused = status(403, "Forbidden", msg, name="kube-system", kind="namespaces")
        argo.inject("/api/v1/namespaces/kube-system", 403, refused)
        return
    argo.put("namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kube-system", "uid": uid}})


def _argo(*workflows: dict, cluster: str | None = CLUSTER, namespace: str = "training") -> FakeCluster:
    """The API with the Argo Workflow objects and the kube-system namespace the lease's checks read."""
    argo = FakeCluster(namespace=namespace)
    _cluster_id(argo, cluster)
    argo.put("workflows", *workflows)
    return argo


def test_workflow_alive_reads_the_holders_workflow_object_in_its_own_cluster_and_namespace():
    running = {"metadata": {"name": "wf-uid-a", "uid": "uid-a"}, "status": {"phase": "Running"}}
    argo = _argo(running)
    here = _lease(namespace="training", cluster=CLUSTER)
    try:
        site, alive = lease.on_gke(make_api_client(argo.url), "training")
        assert site == HERE
        assert alive(here) is True
        argo.put("workflows", {**running, "status": {"phase": "Failed"}})
        assert alive(here) is False
        argo.put("workflows", {**running, "metadata": {"name": "wf-uid-a", "uid": "other"}})
        assert alive(here) is False  # resubmitted under the same name: another object
        argo.remove("workflows", "wf-uid-a")
        assert alive(here) is False  # deleted: its exit handler never ran
        # Elsewhere the same 404 says nothing: another cluster, another namespace, a lease naming no cluster.
        asked = len(argo.requests)
        for there in (
            _lease(namespace="training", cluster="another-cluster"),
            _lease(namespace="research", cluster=CLUSTER),
            _lease(namespace="training"),
            _lease(),
        ):
            assert alive(there) is None
        assert len(argo.requests) == asked  # not even asked
    finally:
        argo.close()


def test_an_unreadable_cluster_id_trusts_no_404():
    argo = _argo(cluster=None)
    try:
        site, alive = lease.on_gke(make_api_client(argo.url), "training")
        assert site == lease.Site(namespace="training") and lease.cluster_id(make_api_client(argo.url)) is None
        assert alive(_lease(namespace="training", cluster=CLUSTER)) is None
    finally:
        argo.close()


def test_the_lease_names_the_holders_namespace_and_cluster_and_a_renewal_keeps_them(store_root):
    store = RunStore(store_root, "r")
    clock = iter([1000.0, 1100.0, 1200.0]).__next__
    lease.acquire(store, lease.Claimant("uid-a", "wf-a", HERE), 600, clock=clock)
    # id unreadable
    lease.acquire(store, lease.Claimant("uid-a", "wf-a", lease.Site(namespace="training")), 600, clock=clock)
    held = store.read_record(RunLayout.LEASE, RunLease)
    assert (held.namespace, held.cluster, held.acquired_at, held.renewed_at) == ("training", CLUSTER, 1000.0, 1100.0)
    # Another cluster's workflow cannot tell whether uid-a runs: the TTL decides, never a 404.
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(
            store,
            lease.Claimant("uid-b", "wf-b", lease.Site("training", "other")),
            600,
            is_alive=lambda _: None,
            clock=clock,
        )


# --- renewal while a segment runs ------------------------------------------------------------------


def test_renew_if_due_reads_nothing_before_it_is_due_and_then_renews(tmp_path):
    store = RunStore(str(tmp_path / "store"), "r")
    lease.acquire(store, lease.Claimant("uid-a", "wf-a", HERE), 3600, clock=lambda: 1000.0)
    first = lease.renew_if_due(store, "uid-a", 3600, 1010.0)
    assert first.status is lease.RenewStatus.RENEWED and first.next_at == 1010.0 + 600
    assert store.read_record(RunLayout.LEASE, RunLease).renewed_at == 1010.0
    # Not due: nothing is read, so not even a damaged lease is noticed.
    store.write_bytes(RunLayout.LEASE, b'{"run_id": "r", "holder"')
    quiet = lease.renew_if_due(store, "uid-a", 3600, 1500.0, next_at=first.next_at)
    assert (quiet.status, quiet.next_at, quiet.line) == (lease.RenewStatus.NOT_DUE, first.next_at, "")
    # Due, and the lease cannot be read: a status, never an exception; tried again a minute later.
    failed = lease.renew_if_due(store, "uid-a", 3600, 1700.0, next_at=quiet.next_at)
    assert failed.status is lease.RenewStatus.UNAVAILABLE and failed.next_at == 1760.0
    assert "could not renew the lease of run 'r'" in failed.line and "\n" not in failed.line


def test_renew_if_due_never_takes_a_lease_it_lost(store_root):
    store = RunStore(store_root, "r")
    lease.acquire(store, lease.Claimant("uid-a", "wf-a"), 60, clock=lambda: 1000.0)
    # expired, taken over elsewhere
    lease.acquire(store, lease.Claimant("uid-b", "wf-b", HERE), 60, clock=lambda: 2000.0)
    lost = lease.renew_if_due(store, "uid-a", 60, 2001.0)
    assert lost.status is lease.RenewStatus.LOST and lost.next_at == 2011.0  # ttl/6
    assert "now held by workflow wf-b (uid uid-b, namespace training)" in lost.line
    assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-b"
    lease.release(store, "uid-b")
    assert lease.renew_if_due(store, "uid-b", 60, 2002.0).status is lease.RenewStatus.LOST


def test_renew_if_due_rides_out_a_store_outage(gcs_emulator, monkeypatch):
    proxy = OutageProxy(gcs_emulator.url)
    try:
        for k, v in proxy.env(gcs_emulator.env).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("JAXREC_STORE_RETRY_DEADLINE_S", "0.5")
        store = RunStore(f"gs://test-bucket/renew-outage-{id(proxy)}", "r")
        lease.acquire(store, lease.Claimant("uid-a", "wf-a"), 3600, clock=lambda: 1000.0)
        proxy.down_for(60)
        down = lease.renew_if_due(store, "uid-a", 3600, 1700.0)
        assert down.status is lease.RenewStatus.UNAVAILABLE and proxy.refused >= 1
        proxy.down_for(0)
        back = lease.renew_if_due(store, "uid-a", 3600, down.next_at)
        assert back.status is lease.RenewStatus.RENEWED
        assert store.read_record(RunLayout.LEASE, RunLease).renewed_at == down.next_at
    finally:
        proxy.close()


def _kube_with_workflow(holder_running: bool) -> FakeCluster:
    """provision-slice's cluster (the run's JobSet of attempt 0, a whole slice) with the cluster id and, when
    ``holder_running``, the lease holder's Workflow object (Running)."""
    kube = slice_cluster(jobsets=["lm-v5e-4x4-a0"], nodes=[_node(f"n{i}") for i in range(4)])
    _cluster_id(kube, CLUSTER)
    if holder_running:
        wf = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": {"name": "wf-a", "uid": "uid-a"}}
        kube.put("workflows", {**wf, "status": {"phase": "Running"}})
    return kube


@pytest.mark.parametrize(
    "holder_site, holder_running, taken",
    [
        (HERE, True, False),
        (HERE, False, True),  # deleted: its exit handler never ran
        (lease.Site("training", "another-cluster"), False, False),  # a 404 here says nothing about it
        (lease.Site("research", CLUSTER), False, False),
    ],
    ids=["holder-running", "holder-deleted", "holder-in-another-cluster", "holder-in-another-namespace"],
)
def test_provision_slice_of_a_second_submission_deletes_no_live_gang(
    tmp_path, capsys, holder_site, holder_running, taken
):
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    store = RunStore(root, run_id)
    lease.acquire(store, lease.Claimant("uid-a", "wf-a", holder_site), 3600)
    kube = _kube_with_workflow(holder_running)
    try:
        code = provision_slice.main(
            [
                "--store-root",
                root,
                "--run-id",
                run_id,
                "--attempt",
                "1",
                "--output-dir",
                str(tmp_path / "o"),
                "--k8s-host",
                kube.url,
                "--holder",
                "uid-b",
                "--holder-name",
                "wf-b",
            ]
        )
    finally:
        kube.close()
    deletes = [r for r in kube.requests if r[0] == "DELETE"]
    if not taken:
        assert code == 2 and "held by workflow wf-a" in capsys.readouterr().err
        assert not deletes and list(kube.jobsets) == ["lm-v5e-4x4-a0"]
        assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-a"
    else:
        assert code == 0 and len(deletes) == 1
        held = store.read_record(RunLayout.LEASE, RunLease)
        assert (held.holder, held.namespace, held.cluster) == ("uid-b", "training", CLUSTER)


def test_a_replayed_provision_slice_stops_its_workflow_and_touches_nothing(tmp_path, capsys):
    """argo retry of a Workflow that failed at provision-slice: its exit handler released the lease; the replayed
    step would take the run back unconfirmed (nothing it did recorded), so it stops the Workflow and says to
    resubmit, with no JobSet deleted and the lease left released."""
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    store = RunStore(root, run_id)
    lease.acquire(store, lease.Claimant("uid-a", "wf-a", HERE), 3600)
    lease.release(store, "uid-a")
    kube = _kube_with_workflow(True)
    try:
        args = ["--store-root", root, "--run-id", run_id, "--attempt", "1", "--output-dir", str(tmp_path / "o")]
        code = provision_slice.main([*args, "--k8s-host", kube.url, "--holder", "uid-a", "--holder-name", "wf-a"])
    finally:
        kube.close()
    assert code == 2
    err = capsys.readouterr().err
    assert "this Workflow had already ended (argo retry replays it" in err and "argo resubmit -n training wf-a" in err
    (patch,) = kube.requests_of("PATCH", "/workflows/wf-a")
    assert patch[2] == {"spec": {"shutdown": "Stop"}}
    assert not [r for r in kube.requests if r[0] == "DELETE"] and list(kube.jobsets) == ["lm-v5e-4x4-a0"]
    assert store.read_record(RunLayout.LEASE, RunLease).released


@pytest.mark.parametrize(
    "current, replayed",
    [
        (None, False),  # nothing was ever taken
        (_lease(), False),  # held: this Workflow acts
        (_lease(released=True), True),  # its own exit handler released it
        (_lease(holder="uid-b", released=True), False),  # another's: the lease's own rules decide
    ],
)
def test_ended_here_is_only_the_holders_own_release(current, replayed):
    assert lease.ended_here(current, "uid-a") is replayed


def _validate_as(args: list[str], out: Path, uid: str) -> int:
    """validate-config of the workflow with uid ``uid`` (named wf-<uid>)."""
    return validate_config.main([*args, "--output-dir", str(out), "--holder", uid, "--holder-name", f"wf-{uid}"])


def test_validate_config_on_gke_names_the_site_and_takes_over_only_a_holder_known_gone(tmp_path, capsys):
    cfg_file = REPO / "configs" / "v5e-4x4.yaml"
    root = str(tmp_path / "store")
    argo = _argo()
    try:
        args = ["--config", str(cfg_file), "--store-root", root, "--k8s-host", argo.url]
        assert _validate_as(args, tmp_path / "o1", "uid-a") == 0
        store = RunStore(root, "lm-v5e-4x4")
        held = store.read_record(RunLayout.LEASE, RunLease)
        assert (held.holder, held.namespace, held.cluster) == ("uid-a", "training", CLUSTER)
        # Another cluster cannot see wf-uid-a: its 404 is no proof, so the lease stands.
        _cluster_id(argo, "another-cluster")
        assert _validate_as(args, tmp_path / "o2", "uid-b") == 2
        assert "held by workflow wf-uid-a (uid uid-a, namespace training" in capsys.readouterr().err
        # The same cluster and namespace: wf-uid-a is not there (deleted), so the run is taken over.
        _cluster_id(argo, CLUSTER)
        assert _validate_as(args, tmp_path / "o3", "uid-b") == 0
        assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-b"
    finally:
        argo.close()


@pytest.mark.parametrize("gang", ["running", "finished", "gone"])
def test_the_local_file_in_a_pod_names_its_cluster_so_a_resubmission_takes_over_a_deleted_holder(
    tmp_path, capsys, monkeypatch, gang
):
    """``argo/local-cpu.yaml`` submitted to a cluster: its lease names the namespace and cluster like a TPU run's,
    so after ``argo delete`` the same file submitted again takes the run at once (under the local runner the TTL
    decides: no cluster to ask). It continues at the deleted Workflow's attempt when that attempt's gang still
    trains and nothing decided it (train-segment re-attaches); past it otherwise."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    cfg_file = REPO / "configs" / "local-cpu.yaml"
    root = str(tmp_path / "store")
    argo = _argo(namespace="default")
    try:
        args = ["--config", str(cfg_file), "--store-root", root, "--k8s-host", argo.url]
        assert _validate_as(args, tmp_path / "o1", "uid-a") == 0
        store = RunStore(root, "local-cpu")
        held = store.read_record(RunLayout.LEASE, RunLease)
        assert (held.holder, held.namespace, held.cluster) == ("uid-a", "default", CLUSTER)
        store.write_json(RunLayout.heartbeat(0, 0), {"process_index": 0, "step": 12, "at": 1.0})  # attempt 0 trained
        if gang != "gone":
            cond = [{"type": "Completed", "status": "True"}] if gang == "finished" else []
            argo.put(
                "jobsets",
                {
                    "apiVersion": "jobset.x-k8s.io/v1alpha2",
                    "kind": "JobSet",
                    "metadata": {"name": "local-cpu-a0", "namespace": "default"},
                    "status": {"conditions": cond},
                },
            )
        capsys.readouterr()
        assert _validate_as(args, tmp_path / "o2", "uid-b") == 0, capsys.readouterr().err
        assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-b"
        err = capsys.readouterr().err
        first = (tmp_path / "o2" / "first-attempt").read_text()
        if gang == "running":
            assert first == "0" and "continuing at attempt 0, its gang kept" in err, err
        else:
            assert first == "1" and "continuing" not in err, err
    finally:
        argo.close()


def _left_running(argo: FakeCluster, store: RunStore, run_id: str) -> None:
    """Attempt 0 of a Workflow since deleted: it trained, nothing decided or closed it, its JobSet still runs."""
    store.write_json(RunLayout.heartbeat(0, 0), {"process_index": 0, "step": 12, "at": 1.0})
    argo.put("jobsets", {**jobset(f"{run_id}-a0", run_id, namespace="default"), "status": {"conditions": []}})


@pytest.fixture
def left_gang(tmp_path, monkeypatch):
    """``argo/local-cpu.yaml`` in a pod: a first Workflow (uid-a) validated and trained attempt 0, then was deleted
    with its gang still training. Yields the fake API, validate-config's arguments and the run store."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    root = str(tmp_path / "store")
    argo = _argo(namespace="default")
    try:
        args = ["--config", str(REPO / "configs" / "local-cpu.yaml"), "--store-root", root, "--k8s-host", argo.url]
        assert _validate_as(args, tmp_path / "o1", "uid-a") == 0
        store = RunStore(root, "local-cpu")
        assert store.read_record(RunLayout.LEASE, RunLease).first_attempt == 0
        _left_running(argo, store, "local-cpu")
        yield argo, args, store
    finally:
        argo.close()


def test_a_resubmission_whose_config_is_refused_takes_nothing_and_its_exit_handler_deletes_nothing(
    tmp_path, capsys, left_gang
):
    """After ``argo delete`` the gang trains on; a resubmission with a changed config (even a safe change, without
    --accept-safe-changes) is refused before it takes the run lease, so its exit handler finds it holds nothing and
    the gang it came to adopt is not deleted."""
    argo, args, store = left_gang
    changed = tmp_path / "changed.yaml"
    data = yaml.safe_load((REPO / "configs" / "local-cpu.yaml").read_text())
    data["supervision"] = {**data.get("supervision", {}), "watch_interval_s": 7}
    changed.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    refused = ["--config", str(changed), *args[2:]]
    assert _validate_as(refused, tmp_path / "o2", "uid-b") == 2
    assert "differs from the one this run was started with" in capsys.readouterr().err
    held = store.read_record(RunLayout.LEASE, RunLease)
    assert (held.holder, held.first_attempt) == ("uid-a", 0)  # not taken
    code = finalize.main(
        [
            "--store-root",
            store.root,
            "--run-id",
            "local-cpu",
            "--status",
            "Failed",
            "--holder",
            "uid-b",
            "--k8s-host",
            argo.url,
        ]
    )
    assert code == 0 and argo.requests_of("DELETE", "/") == []
    assert store.read_record(RunLayout.LEDGER, Ledger) is None  # the run's ledger untouched


@pytest.mark.parametrize(
    "answer, code", [((503, "ServiceUnavailable"), 69), ((429, "TooManyRequests"), 69), ((403, "Forbidden"), 2)]
)
def test_an_unreadable_jobset_of_an_open_attempt_is_never_taken_for_not_running(
    tmp_path, capsys, left_gang, answer, code
):
    """The numbering would move past a live gang, which the next provision-slice refuses to delete (the run stops):
    validate-config exits 69 (retried) for a transient answer, 2 for a refusal, and takes no lease either way."""
    argo, args, store = left_gang
    jobset_reads = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{argo.ns}/jobsets/"
    argo.inject(jobset_reads, answer[0], status(*answer, "etcdserver: request timed out"))
    capsys.readouterr()
    assert _validate_as(args, tmp_path / "o2", "uid-b") == code
    err = capsys.readouterr().err
    assert f"cannot read JobSet local-cpu-a0 of open attempt 0: Kubernetes API answered {answer[0]}" in err, err
    assert "Traceback" not in err and not (tmp_path / "o2" / "first-attempt").exists()
    assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-a"
    argo.faults.clear()  # the API answers again: the retry continues the live attempt
    assert _validate_as(args, tmp_path / "o3", "uid-b") == 0
    assert (tmp_path / "o3" / "first-attempt").read_text() == "0"
    assert store.read_record(RunLayout.LEASE, RunLease).first_attempt == 0
