"""provision-slice: the node check (pure), the Kubernetes side at its HTTP boundary, the local backend."""

from __future__ import annotations

import time
from urllib.parse import urlparse

import pytest
from support.fake_k8s import forbidden
from support.provision_api import JOBSETS, MAINTENANCE, NODES, NS, PODS, REPO, jobset, slice_cluster
from support.provision_api import node as _node
from support.provision_api import store_config as _store_config

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import load_config
from jaxrec.model.snapshot import NodeEvidence
from recovery_steps import provision_slice as ps
from recovery_steps.step import StepError


@pytest.fixture
def kube_factory():
    made = []

    def make(**kw):
        made.append(slice_cluster(**kw))
        return made[-1]

    yield make
    for k in made:
        k.close()


def _deletes(kube):
    return kube.requests_of("DELETE", "/")


def _main(root, run_id, out, kube, *extra):
    return ps.main(
        [
            "--store-root",
            root,
            "--run-id",
            run_id,
            "--attempt",
            "2",
            "--output-dir",
            str(out),
            "--k8s-host",
            kube.url,
            "--pod-timeout",
            "20",
            *extra,
        ]
    )


def test_gke_deletes_old_jobsets_waits_for_pods_and_checks_nodes(tmp_path, kube_factory):
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    kube = kube_factory(
        jobsets=["lm-v5e-4x4-a0", "lm-v5e-4x4-a1"],
        nodes=[_node(f"n{i}", taints=[("google.com/tpu", "NoSchedule")]) for i in range(4)],
    )
    out = tmp_path / "out"
    assert _main(root, run_id, out, kube) == 0
    assert (out / "jobset-name").read_text() == "lm-v5e-4x4-a2"
    assert (out / "coordinator-port").read_text() == "8476"
    assert (out / "metrics-port").read_text() == "9431"
    deletes = [(urlparse(p).path.rsplit("/", 1)[-1], body.get("propagationPolicy")) for _, p, body in _deletes(kube)]
    assert deletes == [("lm-v5e-4x4-a0", "Foreground"), ("lm-v5e-4x4-a1", "Foreground")]
    listed = kube.queries("GET", JOBSETS)
    assert listed[0]["labelSelector"] == "jaxrec/run-id=lm-v5e-4x4"
    pod_polls = kube.queries("GET", PODS)
    assert len(pod_polls) >= 2 and not kube.pods  # waited until the pods were gone
    (node_q,) = kube.queries("GET", NODES)
    assert "cloud.google.com/gke-tpu-topology=4x4" in node_q["labelSelector"]
    assert "cloud.google.com/gke-spot=true" in node_q["labelSelector"]


@pytest.mark.parametrize(
    "nodes, expect",
    [
        ([_node(f"n{i}") for i in range(3)] + [_node("n3", ready=False)], "n3 not Ready"),
        ([_node(f"n{i}") for i in range(3)] + [_node("n3", labels=MAINTENANCE)], "under maintenance"),
        (
            [_node(f"n{i}") for i in range(3)]
            + [_node("n3", taints=[("node.kubernetes.io/unreachable", "NoExecute")])],
            "taint node.kubernetes.io/unreachable",
        ),
        ([_node(f"n{i}") for i in range(3)], "3/4 healthy"),
    ],
    ids=["not-ready", "maintenance", "tainted", "too-few"],
)
def test_gke_unhealthy_slice_is_capacity(tmp_path, kube_factory, capsys, nodes, expect):
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    kube = kube_factory(nodes=nodes)
    assert _main(root, run_id, tmp_path / "out", kube) == 75
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err
    assert not (tmp_path / "out" / "jobset-name").exists()


def test_gke_zero_nodes_is_a_documented_choice(tmp_path, kube_factory):
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    # Only nodes of another topology: nothing matches the slice's selector.
    other = _node("other", labels={"cloud.google.com/gke-tpu-topology": "2x4"})
    kube = kube_factory(nodes=[other])
    assert _main(root, run_id, tmp_path / "out", kube) == 0
    assert _main(root, run_id, tmp_path / "out2", kube, "--require-nodes") == 75


def test_gke_forbidden_is_configuration(tmp_path, kube_factory, capsys):
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    kube = kube_factory()
    kube.inject("/jobsets", 403, forbidden("list", "jobsets", group="jobset.x-k8s.io", namespace=NS))
    assert _main(root, run_id, tmp_path / "out", kube) == 2
    assert "rbac.yaml" in capsys.readouterr().err


def test_gke_pods_that_never_go_are_capacity(tmp_path, kube_factory):
    root = str(tmp_path / "store")
    cfg = load_config(REPO / "configs" / "v5e-4x4.yaml")
    _store_config(root, "v5e-4x4.yaml")
    kube = kube_factory(jobsets=["lm-v5e-4x4-a0"], pods_per_gang=50, nodes=[_node(f"n{i}") for i in range(4)])
    from jaxrec.adapters.kube import make_api_client

    with pytest.raises(StepError) as e:
        ps.provision_gke(
            cfg,
            1,
            make_api_client(kube.url),
            store=RunStore(root, cfg.run_id),
            options=ps.ProvisionOptions(pod_timeout_s=0.3),
        )
    assert e.value.code == 75 and "still present" in str(e.value)


def test_missing_config_is_configuration(tmp_path, capsys):
    code = ps.main(
        ["--store-root", str(tmp_path), "--run-id", "nope", "--attempt", "0", "--output-dir", str(tmp_path / "out")]
    )
    assert code == 2
    assert "validate-config" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # no document for a run that does not exist


def _seen(name: str, pool: str, ready: bool, **kw) -> NodeEvidence:
    """A node as the snapshot holds it."""
    return NodeEvidence(name=name, pool=pool, ready=ready, **kw)


def test_check_slice_table():
    tol = ["google.com/tpu"]
    healthy = [_seen(f"n{i}", "a", True, taints=["google.com/tpu:NoSchedule"]) for i in range(4)]
    assert ps.check_slice(healthy, 4, tol, require_nodes=True).ok
    # A second pool with a broken node does not matter when one pool is whole.
    broken = [_seen("m0", "b", False)]
    assert ps.check_slice(broken + healthy, 4, tol, require_nodes=True).ok
    # Healthy nodes split across pools do not make one slice.
    split = healthy[:2] + [_seen(f"m{i}", "b", True) for i in range(2)]
    verdict = ps.check_slice(split, 4, tol, require_nodes=True)
    assert not verdict.ok and "node pool a: 2/4" in verdict.reason
    assert not ps.check_slice([_seen("c", "a", True, unschedulable=True)] + healthy[:3], 4, tol, require_nodes=True).ok
    assert ps.check_slice([], 4, tol, require_nodes=False).ok
    assert not ps.check_slice([], 4, tol, require_nodes=True).ok
    # PreferNoSchedule is not a blocker; maintenance "false" is not maintenance.
    soft = [
        _seen(
            f"n{i}",
            "a",
            True,
            taints=["x:PreferNoSchedule"],
            labels={"cloud.google.com/active-node-maintenance": "false"},
        )
        for i in range(4)
    ]
    assert ps.check_slice(soft, 4, tol, require_nodes=True).ok


@pytest.mark.parametrize("live", [False, True], ids=["finished", "live-unsupervised"])
def test_a_cpu_slice_clears_earlier_jobsets_through_the_api_and_picks_free_ports(store_root, tmp_path, live):
    """The CPU slice, under the local runner or in a pod: the earlier attempt's gang is a JobSet, deleted through the
    API (a live one that no supervisor decided is refused, as on GKE); the ports it picks are free."""
    from support.fake_k8s import FakeCluster

    run_id = _store_config(store_root, "local-cpu.yaml")
    cluster = FakeCluster(namespace="default")
    cond = [] if live else [{"type": "Failed", "status": "True", "reason": "FailedJobs"}]
    cluster.put("jobsets", {**jobset(f"{run_id}-a0", run_id, namespace="default"), "status": {"conditions": cond}})
    try:
        code = ps.main(
            [
                "--store-root",
                store_root,
                "--run-id",
                run_id,
                "--attempt",
                "1",
                "--output-dir",
                str(tmp_path / "out"),
                "--k8s-host",
                cluster.url,
                "--pod-timeout",
                "5",
            ]
        )
    finally:
        cluster.close()
    deletes = [r[1].split("?")[0].rsplit("/", 1)[-1] for r in cluster.requests_of("DELETE", "/jobsets/")]
    if live:
        assert (code, deletes) == (2, [])
        return
    assert (code, deletes) == (0, [f"{run_id}-a0"])
    out = {f.name: f.read_text() for f in (tmp_path / "out").iterdir()}
    assert out["jobset-name"] == f"{run_id}-a1"
    coord, base = int(out["coordinator-port"]), int(out["metrics-port"])
    assert coord not in range(base, base + 4)
    for port in [coord, *range(base, base + 4)]:
        assert ps._port_free(port)


def _tpu_node(name, *, tpu="4", labels=None):
    n = _node(name, taints=[("google.com/tpu", "NoSchedule")], labels=labels)
    n["status"]["allocatable"] = {"cpu": "111500m", "memory": "190Gi", "google.com/tpu": tpu}
    return n


def _other_run_pod(node, run="other-run", phase="Running"):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{run}-a0-workers-0-0-x",
            "namespace": NS,
            "labels": {"jaxrec/run-id": run, "jobset.sigs.k8s.io/jobset-name": f"{run}-a0"},
        },
        "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "x"}]},
        "status": {"phase": phase},
    }


SOON = str(int(time.time()) + 600)
LATER = str(int(time.time()) + 86400)


@pytest.mark.parametrize(
    "nodes, other_pods, expect",
    [
        ([_tpu_node(f"n{i}") for i in range(3)] + [_tpu_node("n3", tpu="0")], [], "allocatable google.com/tpu 0 < 4"),
        ([_tpu_node(f"n{i}") for i in range(4)], [_other_run_pod("n2")], "running pods of run(s) other-run"),
        (
            [_tpu_node(f"n{i}") for i in range(3)]
            + [_tpu_node("n3", labels={"cloud.google.com/scheduled-maintenance-time": SOON})],
            [],
            "maintenance scheduled in",
        ),
    ],
    ids=["no-allocatable-tpu", "another-runs-pods", "maintenance-soon"],
)
def test_gke_checks_what_it_provisions(tmp_path, kube_factory, capsys, nodes, other_pods, expect):
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    kube = kube_factory(nodes=nodes, other_pods=other_pods)
    assert _main(root, run_id, tmp_path / "out", kube) == 75
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err


def test_gke_passes_a_whole_slice_and_ignores_far_maintenance_and_finished_pods(tmp_path, kube_factory):
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    far = {"cloud.google.com/scheduled-maintenance-time": LATER}
    nodes = [_tpu_node(f"n{i}", labels=far) for i in range(4)]
    kube = kube_factory(nodes=nodes, other_pods=[_other_run_pod("n1", phase="Succeeded")])
    assert _main(root, run_id, tmp_path / "out", kube) == 0
    (q,) = [q for q in kube.queries("GET", PODS) if "!=" in q.get("labelSelector", "")]
    assert q["labelSelector"] == f"jaxrec/run-id,jaxrec/run-id!={run_id}"


def test_maintenance_policy_proceed_uses_the_node():
    soon = _seen("n", "a", True, labels={"cloud.google.com/scheduled-maintenance-time": "1000"})
    wait = ps.SlicePolicy(chips_per_host=4, now=900, maintenance_window_s=3600, wait_for_maintenance=True)
    assert ps.maintenance_due(soon, wait) == "maintenance scheduled in 1 min (within 3600 s)"
    assert ps.maintenance_due(soon, ps.SlicePolicy(now=900, maintenance_window_s=60)) is None
    proceed = ps.SlicePolicy(now=900, maintenance_window_s=3600, wait_for_maintenance=False)
    assert ps.maintenance_due(soon, proceed) is None
    past = _seen("n", "a", True, labels={"cloud.google.com/scheduled-maintenance-time": "800"})
    assert ps.maintenance_due(past, wait) is not None


def _js(name: str, attempt: int, terminal: str | None = None) -> dict:
    status = {"terminalState": terminal} if terminal else {}
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"jaxrec/run-id": "lm-v5e-4x4", "jaxrec/attempt": str(attempt)},
        },
        "status": status,
    }


def test_a_live_gang_nothing_decided_is_never_deleted(tmp_path):
    from jaxrec.model.records import AttemptRecord, Ledger, SupervisionRecord

    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    store = RunStore(root, run_id)
    keep = ps.unsupervised_gang(store, attempt=5)
    # Finished gangs and decided or closed attempts go; the attempt's own live gang stays (train-segment
    # re-attaches to it).
    assert not keep(_js("lm-v5e-4x4-a1", 1, terminal="Failed"))
    assert keep(_js("lm-v5e-4x4-a5", 5))
    decided = SupervisionRecord(attempt=2, jobset="lm-v5e-4x4-a2", outcome="stalled", reason="x", detected_at=1.0)
    store.write_record(RunLayout.supervision(2), decided)
    assert not keep(_js("lm-v5e-4x4-a2", 2))
    store.write_record(RunLayout.LEDGER, Ledger(run_id=run_id, attempts=[AttemptRecord(attempt=3, outcome="failed")]))
    assert not keep(_js("lm-v5e-4x4-a3", 3))
    # A live gang of an earlier attempt that nothing decided: refused, named, nothing deleted.
    with pytest.raises(StepError) as e:
        keep(_js("lm-v5e-4x4-a4", 4))
    assert e.value.code == 2 and "lm-v5e-4x4-a4" in str(e.value) and "kubectl" in str(e.value)
    # An error record that is not a verdict (the supervisor left transient) decides nothing.
    store.write_record(
        RunLayout.supervision(4),
        SupervisionRecord(
            attempt=4, jobset="lm-v5e-4x4-a4", outcome="error", exit_code=69, reason="x", detected_at=1.0
        ),
    )
    with pytest.raises(StepError):
        keep(_js("lm-v5e-4x4-a4", 4))


def test_what_is_decided_is_read_from_the_steps_store_root_not_the_files(tmp_path, kube_factory):
    """``-p store-root=`` moves the run's store away from the file's ``storage.root`` (which the pinned config keeps):
    the supervision record that decided attempt 1 is in the step's store, so its gang is cleared; read from the
    file's root instead, it would look undecided and block the run."""
    from jaxrec.model.records import SupervisionRecord

    root = str(tmp_path / "elsewhere")
    run_id = _store_config(root, "v5e-4x4.yaml")
    assert not load_config(REPO / "configs" / "v5e-4x4.yaml").storage.root.startswith(root)
    decided = SupervisionRecord(attempt=1, jobset=f"{run_id}-a1", outcome="failed", reason="x", detected_at=1.0)
    RunStore(root, run_id).write_record(RunLayout.supervision(1), decided)
    kube = kube_factory(jobsets=[f"{run_id}-a1"], labelled=True, nodes=[_node(f"n{i}") for i in range(4)])
    assert _main(root, run_id, tmp_path / "out", kube) == 0
    assert [urlparse(r[1]).path.rsplit("/", 1)[1] for r in _deletes(kube)] == [f"{run_id}-a1"]


def test_a_local_gang_of_one_without_metrics_takes_no_port_where_no_socket_opens(monkeypatch, tmp_path):
    """The TPU machine lets no process open a socket (bind: errno 97): a gang of one joins no coordinator and,
    with metrics_port 0, serves no endpoint, so provision-slice and the local slice take no port."""
    import errno
    import socket

    from support.fake_k8s import FakeCluster
    from support.trainer_harness import tiny_config

    from jaxrec.adapters.kube import make_api_client
    from workflows.local.cluster import free_port

    def refused(*_a, **_k):
        raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")

    cfg = tiny_config(str(tmp_path / "store"), run_id="one", hosts=1, monitoring={"metrics_port": 0})
    cluster = FakeCluster(namespace="default")  # (the local runner serves its API on a unix socket there)
    monkeypatch.setattr(socket.socket, "bind", refused)
    with pytest.raises(OSError):
        free_port()  # as on that machine
    try:
        out = ps.provision_local(cfg, 0, str(tmp_path / "store"), make_api_client(cluster.url))
    finally:
        monkeypatch.undo()
        cluster.close()
    assert (out.coordinator_port, out.metrics_port) == (0, 0)
