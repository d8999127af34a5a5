"""train-segment, the attempt's supervisor, against the Kubernetes API faked at its HTTP boundary."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from support.fake_k8s import FakeCluster, iso, node, pod, status

from jaxrec.adapters.store import AttemptRef, RunLayout, RunStore
from jaxrec.model.config import StorageConfig, SupervisionConfig, load_config
from jaxrec.model.contract import ExitCode
from jaxrec.model.jobset import JobSetParams, jobset_manifest
from jaxrec.model.records import STARTUP_ATTEMPTS_READ, SupervisionRecord, WorkerExitReport, WorkerHeartbeat
from recovery_steps import train_segment as ts
from recovery_steps.step import StepError
from recovery_steps.supervision import STALE_VIEW_LIMIT_S

REPO = Path(__file__).resolve().parents[1]
HOSTS = 4


def _cfg(root: Path, **supervision):
    cfg = load_config(REPO / "configs" / "v5e-4x4.yaml")
    sup = {
        "watch_interval_s": 0.05,
        "heartbeat_interval_s": 1,
        "hang_timeout_s": 30,
        "compile_grace_s": 60,
        "force_delete_grace_s": 0,
        **supervision,
    }
    storage = StorageConfig(root=str(root), durable_mount=True)  # a local store stands in for the bucket
    cfg = cfg.model_copy(update={"storage": storage, "supervision": SupervisionConfig(**sup)})
    RunStore(str(root), cfg.run_id).write_json(
        RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()}
    )
    return cfg


def _params(cfg, attempt=0):
    """The attempt's JobSet parameters, as the step's arguments carry them (``_flags``)."""
    return JobSetParams(
        name=f"{cfg.run_id}-a{attempt}",
        run_id=cfg.run_id,
        store_root=cfg.storage.root,
        attempt=str(attempt),
        restore_step="-1",
        coordinator_port="8476",
        metrics_port="9431",
    )


def _flags(cfg, attempt=0):
    """The step's arguments for the JobSet's parameters beyond the run, store root and attempt."""
    p = _params(cfg, attempt)
    return [
        "--jobset-name",
        p.name,
        "--restore-step",
        p.restore_step,
        "--coordinator-port",
        p.coordinator_port,
        "--metrics-port",
        p.metrics_port,
    ]


def _manifest(cfg, attempt=0):
    return jobset_manifest(cfg, _params(cfg, attempt))


def _job(js, conditions=()):
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": f"{js}-workers-0",
            "namespace": "training",
            "labels": {"jobset.sigs.k8s.io/jobset-name": js},
        },
        "spec": {"parallelism": HOSTS, "completions": HOSTS, "completionMode": "Indexed", "backoffLimit": 0},
        "status": {"conditions": list(conditions), "active": HOSTS},
    }


def _gang(c, js, t, **pod_kw):
    """Every worker pod of the JobSet, one per node, in the same state."""
    for i in range(HOSTS):
        c.put("pods", pod(js, i, t, node=f"gke-tpu-{i}", **pod_kw))


def _beat(store, attempt, step, t, ckpt=None):
    for i in range(HOSTS):
        b = WorkerHeartbeat(process_index=i, step=step, checkpoint_step=ckpt, at=t, first_step_at=t)
        store.write_json(RunLayout.heartbeat(attempt, i), b.model_dump())


def _run_joining(cfg, tmp_path, cluster, timers: list[threading.Timer]):
    """``_run``, then every timer the cluster's script started joined (bounded): the record and the log lines."""
    try:
        rec, lines, _ = _run(cfg, tmp_path, cluster)
    finally:
        for t in timers:
            t.join(timeout=5)
    return rec, lines


def _run(cfg, tmp_path, cluster, attempt=0):
    lines: list[str] = []
    progress = tmp_path / "progress"
    rec = ts.run(
        AttemptRef(cfg.storage.root, cfg.run_id, attempt),
        _params(cfg, attempt),
        tmp_path / "out",
        gang=ts.kube_gang(k8s_host=cluster.url),
        io=ts.SupervisorIO(progress_file=str(progress), say=lines.append),
    )
    return rec, lines, progress


def _run_on_clock(cfg, tmp_path, cluster, clock):
    """Supervise attempt 0 with the supervisor's clock ``clock`` (a test moves it on); its record."""
    return ts.run(
        AttemptRef(cfg.storage.root, cfg.run_id, 0),
        _params(cfg),
        tmp_path / "out",
        gang=ts.kube_gang(k8s_host=cluster.url),
        io=ts.SupervisorIO(clock=clock, say=lambda _: None),
    )


@pytest.fixture
def cluster():
    c = FakeCluster()
    for i in range(HOSTS):
        c.nodes[f"gke-tpu-{i}"] = node(f"gke-tpu-{i}")
    yield c
    c.close()


def test_creates_the_jobset_and_follows_it_to_success(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    js = f"{cfg.run_id}-a0"
    t0 = time.time()

    def created(c, obj):
        c.put("jobs", _job(js))
        for i in range(HOSTS):
            c.put("pods", pod(js, i, t0))

    def scheduled(c):
        for i in range(HOSTS):
            c.put("pods", pod(js, i, t0 + 1, node=f"gke-tpu-{i}"))

    def running(c):
        _gang(c, js, t0 + 2, phase="Running", running=True)

    def stepping(c):
        _beat(store, 0, 5, time.time(), ckpt=None)

    def done(c):
        _gang(c, js, t0 + 9, phase="Succeeded", exit_code=0)
        c.put("jobs", _job(js, [{"type": "Complete", "status": "True", "lastTransitionTime": iso(t0 + 9)}]))
        obj = dict(c.objects["jobsets"][js])
        c.put("jobsets", {**obj, "status": {"terminalState": "Completed"}})

    cluster.on_create = created
    cluster.script = [scheduled, running, stepping, lambda c: None, done]
    rec, lines, progress = _run(cfg, tmp_path, cluster)

    assert rec.outcome == "succeeded" and not rec.reattached
    (post,) = cluster.requests_of("POST", "/jobsets")
    assert post[2]["metadata"]["name"] == js and post[2]["spec"] == _manifest(cfg)["spec"]
    assert not cluster.requests_of("DELETE", "/jobsets/")
    assert {"workers scheduled 4/4", "workers running 4/4", "step 5"} <= set(lines)
    assert progress.read_text() == f"5/{cfg.training.total_steps}"
    saved = SupervisionRecord.model_validate(store.read_json(RunLayout.supervision(0)))
    assert saved == rec
    assert all(w.scheduled_at and w.started_at and w.first_step_at and w.last_step == 5 for w in rec.workers)
    assert (tmp_path / "out" / "outcome").read_text() == "succeeded"
    assert (tmp_path / "out" / "last-step").read_text() == "5"


def test_reattaches_and_ends_at_failure_target_force_deleting_the_pod_on_the_lost_node(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    js = f"{cfg.run_id}-a1"
    t0 = time.time() - 100
    manifest = _manifest(cfg, 1)
    cluster.put(
        "jobsets",
        {
            **manifest,
            "metadata": {**manifest["metadata"], "creationTimestamp": iso(t0)},
            "status": {"replicatedJobsStatus": [{"name": "workers", "active": 1}]},
        },
    )
    cluster.put("jobs", _job(js))
    for i in range(HOSTS):
        cluster.put("pods", pod(js, i, t0, node=f"gke-tpu-{i}", phase="Running", running=True, attempt="1"))
    _beat(store, 1, 17, time.time(), ckpt=10)

    def node_lost(c):
        c.nodes["gke-tpu-3"] = node("gke-tpu-3", ready=None, unreachable=True)
        msg = (
            "Container trainer for pod training/" + js + "-workers-0-2-x2z failed with exit code 20 matching "
            "FailJob rule at index 3"
        )
        c.put(
            "jobs",
            _job(
                js,
                [
                    {
                        "type": "FailureTarget",
                        "status": "True",
                        "reason": "PodFailurePolicy",
                        "message": msg,
                        "lastTransitionTime": iso(time.time()),
                    }
                ],
            ),
        )

    node_lost(cluster)  # both are there when the supervisor (re-)attaches: FailureTarget decides
    rec, lines, _ = _run(cfg, tmp_path, cluster, attempt=1)

    assert not cluster.requests_of("POST", "/jobsets"), "a second gang was created"
    assert rec.reattached and any("re-attached" in ln for ln in lines)
    assert rec.outcome == "failed" and rec.stall_kind is None and "FailureTarget" in rec.reason
    (delete,) = cluster.requests_of("DELETE", f"/jobsets/{js}")
    q = parse_qs(urlparse(delete[1]).query)
    assert "Foreground" in (q.get("propagationPolicy", []) + [delete[2].get("propagationPolicy")])
    stuck = f"{js}-workers-0-3-x3z"
    (forced,) = cluster.requests_of("DELETE", f"/pods/{stuck}")
    assert parse_qs(urlparse(forced[1]).query)["gracePeriodSeconds"] == ["0"]
    assert rec.force_deleted == [stuck] and rec.stopped_at is not None and rec.stopped_at >= rec.detected_at
    assert "node gke-tpu-3: Ready=None unreachable" in rec.evidence
    assert rec.checkpoint_step == 10 and rec.last_step == 17


def test_a_worker_never_scheduled_is_a_capacity_stall_and_the_gang_is_deleted(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store", startup_deadline_s=0.3)
    js = f"{cfg.run_id}-a0"

    def created(c, obj):
        c.put("jobs", _job(js))
        t = time.time()
        for i in range(HOSTS - 1):
            c.put("pods", pod(js, i, t, node=f"gke-tpu-{i}", phase="Running", running=True))
        c.put("pods", pod(js, HOSTS - 1, t, unschedulable=True))

    cluster.on_create = created
    rec, lines, _ = _run(cfg, tmp_path, cluster)

    assert (rec.outcome, rec.stall_kind) == ("stalled", "capacity")
    assert "worker 3: unschedulable" in rec.reason and "Insufficient google.com/tpu" in rec.reason
    assert cluster.requests_of("DELETE", f"/jobsets/{js}") and not cluster.objects["pods"]
    assert rec.workers[3].scheduled_at is None and rec.workers[0].started_at is not None
    assert (tmp_path / "out" / "stall-kind").read_text() == "capacity"


def test_image_pull_backoff_past_its_deadline_is_a_configuration_stall(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store", image_pull_deadline_s=0.3)
    js = f"{cfg.run_id}-a0"

    def created(c, obj):
        t = time.time()
        for i in range(HOSTS):
            c.put(
                "pods",
                pod(
                    js,
                    i,
                    t,
                    node=f"gke-tpu-{i}",
                    waiting=(
                        "ImagePullBackOff",
                        'Back-off pulling image "us-docker.pkg.dev/p/ml/worker:typo": ErrImagePull: '
                        'failed to resolve reference "us-docker.pkg.dev/p/ml/worker:typo": not found',
                    ),
                ),
            )

    cluster.on_create = created
    rec, _, _ = _run(cfg, tmp_path, cluster)
    assert (rec.outcome, rec.stall_kind) == ("stalled", "configuration")
    assert "ImagePullBackOff" in rec.reason and "worker:typo" in rec.reason


def test_an_expired_watch_is_listed_again(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store")
    js = f"{cfg.run_id}-a0"

    def created(c, obj):
        _gang(c, js, time.time(), phase="Running", running=True)

    def expire(c):
        c.compact("pods")  # this watch's resourceVersion is now too old: ERROR 410

    def finish(c):
        _gang(c, js, time.time(), phase="Succeeded", exit_code=0)

    cluster.on_create = created
    cluster.script = [lambda c: None, expire, finish]
    rec, _, _ = _run(cfg, tmp_path, cluster)
    lists = [r for r in cluster.requests_of("GET", "/pods?") if "watch=" not in r[1]]
    assert len(lists) >= 2
    assert rec.outcome == "succeeded"


def test_the_jobset_of_another_attempt_is_refused(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store")
    m = _manifest(cfg, 0)
    m["metadata"]["labels"]["jaxrec/attempt"] = "7"
    cluster.put("jobsets", m)
    with pytest.raises(StepError) as e:
        _run(cfg, tmp_path, cluster)
    assert "belongs to attempt 7" in str(e.value) and e.value.code == 2


def test_unreachable_api_and_bad_manifest_are_one_line_each(tmp_path, capsys):
    cfg = _cfg(tmp_path / "store")
    common = [
        "--store-root",
        cfg.storage.root,
        "--run-id",
        cfg.run_id,
        "--attempt",
        "0",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    code = ts.main([*common, *_flags(cfg), "--k8s-host", "http://127.0.0.1:9"])
    err = capsys.readouterr().err.strip().splitlines()
    # No answer at all is transient (69): Argo retries the step in place.
    assert code == 69 and len(err) == 1 and err[0].startswith("train-segment: Kubernetes API unreachable")
    assert (
        json.loads((Path(cfg.storage.root) / "runs" / cfg.run_id / RunLayout.supervision(0)).read_text())["exit_code"]
        == 69
    )
    code = ts.main([*common, "--jobset-manifest", "{kind: Job", "--k8s-host", "http://127.0.0.1:9"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--jobset-manifest" in err[0]


def _verb(method: str, path: str) -> tuple[str, str, str]:
    u = urlparse(path)
    parts = u.path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    coll = next(p for p in ("jobsets", "jobs", "pods", "nodes", "events") if p in parts)
    item = parts.index(coll) + 1 < len(parts)
    q = parse_qs(u.query)
    verb = {"POST": "create", "DELETE": "delete"}.get(method) or (
        "get" if item else ("watch" if q.get("watch", ["false"])[0].lower() == "true" else "list")
    )
    return group, coll, verb


def _granted_by_the_role(used: set[tuple[str, str, str]]) -> None:
    """Every (group, resource, verb) the supervisor used is in the Role (nodes: the ClusterRole) rbac.py writes."""
    from workflows.rbac import NODE_RULES, ROLE_RULES

    for group, res, verb in used:
        rules = NODE_RULES if res == "nodes" else ROLE_RULES
        assert any(group in r["apiGroups"] and res in r["resources"] and verb in r["verbs"] for r in rules), (
            group,
            res,
            verb,
        )


def test_rbac_grants_every_call_the_supervisor_makes(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store", startup_deadline_s=0.2)
    js = f"{cfg.run_id}-a0"

    def created(c, obj):
        c.put("jobs", _job(js))
        _gang(c, js, time.time(), phase="Running", running=True)
        c.nodes["gke-tpu-0"] = node("gke-tpu-0", ready=None, unreachable=True)

    cluster.on_create = created
    rec, _, _ = _run(cfg, tmp_path, cluster)
    assert rec.stall_kind == "node-lost" and rec.force_deleted
    used = {_verb(m, p) for m, p, _ in cluster.requests}
    assert {v for _, _, v in used} >= {"create", "get", "list", "watch", "delete"}
    _granted_by_the_role(used)


@pytest.mark.parametrize(("answer", "code"), [(500, 69), (429, 69), (503, 69), (403, 2), (422, 2)])
def test_a_refused_create_is_transient_or_configuration_by_its_status(tmp_path, cluster, capsys, answer, code):
    cfg = _cfg(tmp_path / "store")
    # The 500 is what the real API server answers while JobSet's webhook server is down (real-controller tier).
    msg = (
        (
            'Internal error occurred: failed calling webhook "mjobset.kb.io": failed to call webhook: Post '
            '"https://jobset-webhook-service.jobset-system.svc:443/mutate-jobset-x-k8s-io-v1alpha2-jobset?timeout=10s":'
            " dial tcp 10.96.12.7:443: connect: connection refused"
        )
        if answer == 500
        else "no"
    )
    cluster.fail_create = (answer, status(answer, "InternalError" if answer >= 500 else "Forbidden", msg))
    common = [
        "--store-root",
        cfg.storage.root,
        "--run-id",
        cfg.run_id,
        "--attempt",
        "0",
        "--output-dir",
        str(tmp_path / "out"),
        "--k8s-host",
        cluster.url,
    ]
    assert ts.main([*common, *_flags(cfg)]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"answered {answer}" in err[0]
    assert not cluster.objects["jobsets"]


def test_an_unreadable_heartbeat_keeps_the_last_one_read(tmp_path):
    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    _beat(store, 0, 9, 1000.0)
    last = {b.process_index: b for b in ts.read_heartbeats(store, 0, HOSTS)[0]}
    beat0 = Path(cfg.storage.root) / "runs" / cfg.run_id / RunLayout.heartbeat(0, 0)
    beat0.write_text("{torn")
    beats, failed = ts.read_heartbeats(store, 0, HOSTS, last)
    assert [b.step for b in beats] == [9] * HOSTS and beats[0] == last[0]
    assert list(failed) == [0] and "DocumentError" in failed[0]
    beats, failed = ts.read_heartbeats(store, 0, HOSTS)
    assert [b.process_index for b in beats] == [1, 2, 3] and list(failed) == [0]  # nothing read before: unreadable


def test_a_store_outage_costs_one_heartbeat_read_per_round_not_one_per_host(tmp_path, monkeypatch):
    """One observation takes a bounded time: after the store fails one worker's read, the others are not read this
    round; each keeps its last beat and is named unread, so the hang clock of none of them counts through it."""
    from google.api_core.exceptions import ServiceUnavailable

    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    for i in range(HOSTS):
        _beat(store, i, 9, 1000.0)
    last = {b.process_index: b for b in ts.read_heartbeats(store, 0, HOSTS)[0]}
    reads = []

    def down(self, rel, model):
        reads.append(rel)
        raise ServiceUnavailable("backend error")

    monkeypatch.setattr(RunStore, "read_record", down)
    beats, failed = ts.read_heartbeats(store, 0, HOSTS, last)
    assert len(reads) == 1 and beats == [last[i] for i in range(HOSTS)]
    assert sorted(failed) == list(range(HOSTS)) and "ServiceUnavailable" in failed[0]
    assert all(failed[i].startswith("not read this round: the store failed worker 0's read") for i in range(1, HOSTS))


def test_a_retry_after_the_stop_reports_the_recorded_verdict_and_creates_no_gang(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    decided = SupervisionRecord(
        attempt=0, jobset=f"{cfg.run_id}-a0", outcome="failed", reason="exit 42", detected_at=time.time()
    )
    store.write_record(RunLayout.supervision(0), decided)
    rec, lines, _ = _run(cfg, tmp_path, cluster)
    assert rec.outcome == "failed" and rec.reason == "exit 42"
    assert not cluster.requests_of("POST", "/jobsets") and any("decided by an earlier try" in ln for ln in lines)


def test_a_lease_held_by_another_workflow_in_another_namespace_ends_this_ones_gang(tmp_path, cluster):
    """A holder elsewhere cannot see this gang, which would write the run's checkpoints beside its own."""
    from recovery_steps import lease

    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    lease.acquire(store, lease.Claimant("uid-other", "wf-other", lease.Site(namespace="elsewhere", cluster="c1")), 3600)
    with pytest.raises(StepError) as e:
        ts.run(
            AttemptRef(cfg.storage.root, cfg.run_id, 0),
            _params(cfg),
            tmp_path / "out",
            gang=ts.kube_gang(k8s_host=cluster.url),
            holder="uid-mine",
            io=ts.SupervisorIO(say=lambda _: None),
        )
    assert e.value.code == 2 and "wf-other" in str(e.value) and "deleted" in str(e.value)
    assert cluster.requests_of("DELETE", "/jobsets/")


@pytest.mark.parametrize("namespace", ["same", None], ids=["same-namespace", "namespace-unknown"])
def test_a_lease_lost_to_a_holder_here_leaves_the_gang_to_it(tmp_path, cluster, namespace):
    """A resubmission in the same namespace may have adopted this very gang: the stale supervisor exits, deleting
    nothing (a lease that names no place is no evidence either)."""
    from recovery_steps import lease

    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    site = lease.Site(namespace=cfg.namespace if namespace else None, cluster="c1" if namespace else None)
    lease.acquire(store, lease.Claimant("uid-other", "wf-other", site), 3600)
    with pytest.raises(StepError) as e:
        ts.run(
            AttemptRef(cfg.storage.root, cfg.run_id, 0),
            _params(cfg),
            tmp_path / "out",
            gang=ts.kube_gang(k8s_host=cluster.url),
            holder="uid-mine",
            io=ts.SupervisorIO(say=lambda _: None),
        )
    assert e.value.code == 2 and "wf-other" in str(e.value) and "left to the run's holder" in str(e.value)
    assert not cluster.requests_of("DELETE", "/jobsets/")


def test_the_supervisor_renews_the_lease_it_holds(tmp_path, cluster):
    from jaxrec.model.records import RunLease
    from recovery_steps import lease

    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    lease.acquire(store, lease.Claimant("uid-mine", "wf-mine"), 3600)
    before = store.read_record(RunLayout.LEASE, RunLease).renewed_at
    js = f"{cfg.run_id}-a0"
    t0 = time.time()

    def done(c):
        _gang(c, js, t0, phase="Succeeded", exit_code=0)
        c.put("jobsets", {**c.objects["jobsets"][js], "status": {"terminalState": "Completed"}})

    cluster.script = [lambda c: time.sleep(0.05), done]
    rec = ts.run(
        AttemptRef(cfg.storage.root, cfg.run_id, 0),
        _params(cfg),
        tmp_path / "out",
        gang=ts.kube_gang(k8s_host=cluster.url),
        holder="uid-mine",
        io=ts.SupervisorIO(say=lambda _: None),
    )
    assert rec.outcome == "succeeded"
    after = store.read_record(RunLayout.LEASE, RunLease)
    assert after.holder == "uid-mine" and after.renewed_at > before


# --- a node shutting down, and image pulls that fail for a while -------------------------------------------------


def _shutting_down(name, since, *, spot=True):
    """A node as its kubelet reports it once a graceful shutdown starts (kubernetes pkg/kubelet/nodeshutdown)."""
    n = node(name, ready=False)
    n["status"]["conditions"][0].update(
        reason="KubeletNotReady", message="node is shutting down", lastTransitionTime=iso(since)
    )
    if spot:
        n["metadata"]["labels"]["cloud.google.com/gke-spot"] = "true"
    return n


def _running_gang(js):
    def created(c, obj):
        c.put("jobs", _job(js))
        _gang(c, js, time.time(), phase="Running", running=True)

    return created


def test_a_node_shutting_down_is_not_lost_before_its_grace_the_failed_pod_ends_the_attempt(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store")  # node_lost_grace_s: the default 120 s
    js = f"{cfg.run_id}-a0"

    def shutdown(c):
        c.nodes["gke-tpu-3"] = _shutting_down("gke-tpu-3", time.time())

    def killed(c):
        time.sleep(0.5)  # the supervisor decides several times while the node is NotReady
        c.put("pods", pod(js, 3, time.time(), node="gke-tpu-3", phase="Failed", exit_code=143))

    cluster.on_create = _running_gang(js)
    cluster.script = [shutdown, lambda c: None, killed]
    rec, _, _ = _run(cfg, tmp_path, cluster)
    assert (rec.outcome, rec.stall_kind) == ("failed", None), rec.reason
    assert "worker 3 failed (exit code 143" in rec.reason
    (n3,) = [n for n in rec.snapshot.nodes if n.name == "gke-tpu-3"]
    assert (n3.ready, n3.ready_message, n3.spot) == (False, "node is shutting down", True)


def test_a_node_lost_past_its_grace_names_the_kubelets_reason_and_classifies_as_a_preemption(tmp_path, cluster):
    from recovery_steps.classify import classify
    from recovery_steps.evidence import Evidence

    cfg = _cfg(tmp_path / "store", node_lost_grace_s=1)
    js = f"{cfg.run_id}-a0"

    def shutdown(c):
        c.nodes["gke-tpu-2"] = _shutting_down("gke-tpu-2", time.time())

    cluster.on_create = _running_gang(js)
    cluster.script = [shutdown]
    rec, _, _ = _run(cfg, tmp_path, cluster)
    assert (rec.outcome, rec.stall_kind) == ("stalled", "node-lost")
    assert "node gke-tpu-2 is NotReady (KubeletNotReady: node is shutting down, Spot)" in rec.reason
    assert "(grace 1 s)" in rec.reason
    v = classify(Evidence(backend="gke", attempt=0, supervision=rec))
    assert v.failure_class == "preemption" and "gke-tpu-2 was shutting down" in v.reason, v.reason


REGISTRY_503 = (
    'rpc error: code = Unknown desc = failed to pull and unpack image "us-docker.pkg.dev/p/ml/worker:1": '
    "unexpected status code https://us-docker.pkg.dev/v2/p/ml/worker/blobs/sha256:9f2c: 503 Service "
    "Unavailable"
)


def test_a_transient_pull_error_then_a_slow_pull_is_not_a_configuration_stall(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store", image_pull_deadline_s=0.3)  # transient_pull_deadline_s: the default 900 s
    js = f"{cfg.run_id}-a0"
    back_off = f'Back-off pulling image "us-docker.pkg.dev/p/ml/worker:1": ErrImagePull: {REGISTRY_503}'

    def created(c, obj):
        c.put("jobs", _job(js))
        _gang(c, js, time.time(), waiting=("ErrImagePull", REGISTRY_503))

    def backing_off(c):
        _gang(c, js, time.time(), waiting=("ImagePullBackOff", back_off))

    def slow_pull(c):
        time.sleep(0.8)  # the kubelet pulls; the pods still show the cached back-off, past image_pull_deadline_s

    def running(c):
        _gang(c, js, time.time(), phase="Running", running=True)

    def done(c):
        _gang(c, js, time.time(), phase="Succeeded", exit_code=0)

    cluster.on_create = created
    cluster.script = [backing_off, slow_pull, running, done]
    rec, _, _ = _run(cfg, tmp_path, cluster)
    assert rec.outcome == "succeeded", rec.reason


def test_an_image_not_found_is_configuration_even_when_the_back_off_no_longer_says_why(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store", image_pull_deadline_s=0.6)
    js = f"{cfg.run_id}-a0"
    image = "us-docker.pkg.dev/p/ml/worker:typo"
    not_found = f'failed to pull and unpack image "{image}": failed to resolve reference "{image}": {image}: not found'

    def created(c, obj):
        c.put("jobs", _job(js))
        _gang(c, js, time.time(), waiting=("ErrImagePull", not_found))

    def old_kubelet_back_off(c):
        for i in range(HOSTS):
            c.put(
                "pods",
                pod(
                    js,
                    i,
                    time.time(),
                    node=f"gke-tpu-{i}",
                    waiting=("ImagePullBackOff", f'Back-off pulling image "{image}"'),
                ),
            )

    cluster.on_create = created
    cluster.script = [lambda c: time.sleep(0.2), old_kubelet_back_off]
    rec, _, _ = _run(cfg, tmp_path, cluster)
    assert (rec.outcome, rec.stall_kind) == ("stalled", "configuration"), rec.reason
    # The bare back-off (a kubelet before 1.32) is judged, and timed, by the pull error seen before it.
    assert "waiting ImagePullBackOff" in rec.reason and "deadline 0.6 s for a permanent failure" in rec.reason
    assert f"(last error: {not_found})" in rec.reason


def test_an_output_dir_that_cannot_be_written_is_refused_before_any_jobset_is_created(tmp_path, cluster, capsys):
    cfg = _cfg(tmp_path / "store")
    with pytest.raises(SystemExit) as e:
        ts.main(
            [
                "--store-root",
                cfg.storage.root,
                "--run-id",
                cfg.run_id,
                "--attempt",
                "0",
                "--k8s-host",
                cluster.url,
                *_flags(cfg),
                "--output-dir",
                "/sys/kernel/x",
            ]
        )
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not cluster.requests_of("POST", "/jobsets")


# --- heartbeats that cannot be read: no evidence of absence or of silence -----------------------------------------


def _other_schema(store, attempt):
    """Heartbeats of a newer trainer: a field this supervisor's record does not know (records forbid extras)."""
    for i in range(HOSTS):
        b = WorkerHeartbeat(process_index=i, step=7, at=time.time(), first_step_at=time.time()).model_dump()
        store.write_json(RunLayout.heartbeat(attempt, i), {**b, "tokens_per_s": 1e6})


def _succeed(js):
    def done(c):
        _gang(c, js, time.time(), phase="Succeeded", exit_code=0)

    return done


def test_a_reattached_supervisor_whose_first_heartbeat_reads_fail_judges_no_hang(tmp_path, cluster):
    """The gang has run for days: a beat never read is unreadable, not a missing first step past compile grace."""
    cfg = _cfg(tmp_path / "store")  # compile_grace_s 60, hang_timeout_s 30
    store = RunStore(cfg.storage.root, cfg.run_id)
    js = f"{cfg.run_id}-a0"
    t0 = time.time() - 3 * 86400
    manifest = _manifest(cfg)
    cluster.put("jobsets", {**manifest, "metadata": {**manifest["metadata"], "creationTimestamp": iso(t0)}})
    cluster.put("jobs", _job(js))
    _gang(cluster, js, t0, phase="Running", running=True)
    _other_schema(store, 0)
    cluster.script = [lambda c: None, lambda c: None, _succeed(js)]
    rec, _, _ = _run(cfg, tmp_path, cluster)
    assert rec.reattached and rec.outcome == "succeeded", rec.reason
    assert any(e.startswith("heartbeat of worker 0: unreadable") and "tokens_per_s" in e for e in rec.evidence)


def test_a_store_outage_longer_than_the_hang_timeout_is_no_hang(tmp_path, cluster, monkeypatch):
    """The kept beat ages while the store cannot be read: that time does not count towards hang_timeout_s."""
    cfg = _cfg(tmp_path / "store")  # hang_timeout_s 30
    store = RunStore(cfg.storage.root, cfg.run_id)
    js = f"{cfg.run_id}-a0"
    skew = {"s": 0.0, "down": False}
    assert STALE_VIEW_LIMIT_S / 2 > 3 * cfg.supervision.hang_timeout_s
    read = RunStore.read_record

    def read_record(self, rel, model):
        if skew["down"] and "heartbeats" in rel:
            raise OSError(5, "Input/output error")
        return read(self, rel, model)

    def outage(c):
        # Past the hang timeout, short of the stale-view limit by more than one round's clock read: the supervisor
        # may read its clock just before the flip and date the failed read from there.
        skew.update(down=True, s=STALE_VIEW_LIMIT_S / 2)

    monkeypatch.setattr(RunStore, "read_record", read_record)
    cluster.on_create = _running_gang(js)
    _beat(store, 0, 5, time.time())
    cluster.script = [lambda c: None, outage, lambda c: None, lambda c: None, _succeed(js)]
    rec = _run_on_clock(cfg, tmp_path, cluster, lambda: time.time() + skew["s"])
    assert rec.outcome == "succeeded", rec.reason
    assert rec.last_step == 5 and any("unreadable for" in e and "Input/output error" in e for e in rec.evidence)


def _report(store, attempt: int, i: int, code: int) -> None:
    name = ExitCode(code).name
    rep = WorkerExitReport(
        run_id=store.run_id, attempt=attempt, process_index=i, process_count=HOSTS, exit_code=code, exit_name=name
    )
    store.write_record(RunLayout.worker_report(attempt, i), rep)


@pytest.mark.parametrize(
    ("codes", "outcome", "fragment"),
    [
        ((0, 0, 0, 0), "succeeded", "every worker succeeded (4/4), as their exit reports say"),
        ((143, 143), "failed", "deleted by someone else"),
    ],
)
def test_a_gang_that_ran_and_is_gone_is_never_created_again(tmp_path, cluster, codes, outcome, fragment):
    """A late retry of the supervisor finds no JobSet, but the attempt's workers reported their exits: its gang
    was created and is gone (cleaned away once completed, or deleted by someone else). Absent is not "never
    created": no second gang of the attempt, started again from its restore step; the verdict comes from the
    reports."""
    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    for i, code in enumerate(codes):
        _report(store, 0, i, code)
    rec, lines, _ = _run(cfg, tmp_path, cluster)
    assert not cluster.requests_of("POST", "/jobsets"), "a second gang was created"
    assert rec.outcome == outcome and fragment in rec.reason, rec.reason
    assert any("not creating a second gang" in ln for ln in lines), lines


# --- the JobSet the step renders from the run's pinned config -------------------------------------------------------


def _segment_main(cfg, tmp_path, cluster, *extra):
    """The step program for attempt 0 against ``cluster`` (``extra``: its JobSet's parameters or an override)."""
    run = ["--store-root", cfg.storage.root, "--run-id", cfg.run_id, "--attempt", "0"]
    return ts.main([*run, "--output-dir", str(tmp_path / "out"), "--k8s-host", cluster.url, *extra])


def _refuse_creates(cluster):
    """The API refuses every create (422): the step ends right after it rendered and posted the JobSet."""
    cluster.fail_create = (422, status(422, "Invalid", "no"))


def _posted(cluster):
    return [body for _, _, body in cluster.requests_of("POST", "/jobsets")]


def test_the_step_renders_the_jobset_of_the_pinned_config_and_the_attempts_parameters(tmp_path, cluster, capsys):
    cfg = _cfg(tmp_path / "store")
    # The run's pinned config, not the file the Workflow was generated from: another image, another grace.
    pinned = cfg.model_copy(
        update={"image": "example.com/worker:pinned", "slice": cfg.slice.model_copy(update={"termination_grace_s": 45})}
    )
    RunStore(cfg.storage.root, cfg.run_id).write_json(
        RunLayout.CONFIG, {"config": pinned.model_dump(mode="json"), "hash": pinned.config_hash()}
    )
    _refuse_creates(cluster)
    flags = ["--jobset-name", f"{cfg.run_id}-a0", "--restore-step", "1500"]
    flags += ["--coordinator-port", "41234", "--metrics-port", "9431"]
    assert _segment_main(cfg, tmp_path, cluster, *flags) == 2
    expected = jobset_manifest(
        pinned,
        JobSetParams(
            name=f"{cfg.run_id}-a0",
            run_id=cfg.run_id,
            store_root=cfg.storage.root,
            attempt="0",
            restore_step="1500",
            coordinator_port="41234",
            metrics_port="9431",
        ),
    )
    assert _posted(cluster) == [expected]
    pod_spec = expected["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod_spec["containers"][0]["image"] == "example.com/worker:pinned"
    assert pod_spec["terminationGracePeriodSeconds"] == 45
    assert "--restore-step" in pod_spec["containers"][0]["args"] and "1500" in pod_spec["containers"][0]["args"]
    capsys.readouterr()


def test_a_resubmission_with_a_safe_change_re_pins_the_config_the_segment_renders_from(tmp_path, cluster, capsys):
    from recovery_steps import validate_config

    cfg = _cfg(tmp_path / "store")
    path = tmp_path / "job.yaml"

    def submit(c, *accept):
        path.write_text(json.dumps(c.model_dump(mode="json")))
        return validate_config.main(["--config", str(path), "--output-dir", str(tmp_path / "vc"), *accept])

    assert submit(cfg) == 0
    changed = cfg.model_copy(update={"image": "example.com/worker:fixed"})  # safe: a new image may fix a bug
    assert submit(changed) == 2  # refused unless accepted: the pinned config stays
    assert submit(changed, "--accept-safe-changes", "true") == 0
    _refuse_creates(cluster)
    assert _segment_main(cfg, tmp_path, cluster, *_flags(cfg)) == 2
    (posted,) = _posted(cluster)
    assert posted == _manifest(changed)
    assert posted["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "example.com/worker:fixed"
    )
    capsys.readouterr()


@pytest.mark.parametrize(
    ("document", "says"),
    [
        (None, "run validate-config first"),
        ("{torn", "validate-config"),
        ({"config": {"run_id": "x"}, "hash": "h"}, "validate-config"),
    ],
    ids=["absent", "not-json", "invalid-config"],
)
def test_a_missing_or_bad_pinned_config_is_one_line_and_configuration(tmp_path, cluster, capsys, document, says):
    cfg = _cfg(tmp_path / "store")
    config = Path(cfg.storage.root) / "runs" / cfg.run_id / RunLayout.CONFIG
    if document is None:
        config.unlink()
    else:
        config.write_text(document if isinstance(document, str) else json.dumps(document))
    assert _segment_main(cfg, tmp_path, cluster, *_flags(cfg)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train-segment: ") and says in err[0], err
    assert "Traceback" not in err[0] and not cluster.requests


def test_a_store_that_cannot_be_read_is_transient_not_an_absent_config(tmp_path, cluster, capsys, monkeypatch):
    cfg = _cfg(tmp_path / "store")
    read = RunStore.read_bytes

    def read_bytes(self, rel):
        if rel == RunLayout.CONFIG:
            raise OSError(5, "Input/output error")
        return read(self, rel)

    monkeypatch.setattr(RunStore, "read_bytes", read_bytes)
    assert _segment_main(cfg, tmp_path, cluster, *_flags(cfg)) == ExitCode.TRANSIENT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Input/output error" in err[0] and "validate-config" not in err[0], err
    assert not cluster.requests


def test_without_an_override_the_jobsets_parameters_are_required(tmp_path, cluster, capsys):
    cfg = _cfg(tmp_path / "store")
    with pytest.raises(SystemExit) as e:
        _segment_main(cfg, tmp_path, cluster, "--jobset-name", f"{cfg.run_id}-a0")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert "--restore-step, --coordinator-port, --metrics-port" in err[0] and not cluster.requests


def test_a_pinned_config_that_renders_no_jobset_is_one_line_and_configuration(tmp_path, cluster, capsys, monkeypatch):
    cfg = _cfg(tmp_path / "store")

    def unrenderable(cfg, params):
        raise KeyError("v9x")

    monkeypatch.setattr(ts, "jobset_manifest", unrenderable)
    assert _segment_main(cfg, tmp_path, cluster, *_flags(cfg)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "renders no JobSet (KeyError: 'v9x')" in err[0] and "validate-config" in err[0], err
    assert not cluster.requests


# --- a view of the cluster that cannot be refreshed: only terminal facts, clocks from when it is current again ----

UNAVAILABLE = status(503, "ServiceUnavailable", "the server is currently unable to handle the request")


def test_an_api_outage_at_start_up_is_no_capacity_stall(tmp_path, cluster):
    """An API server restarting while the gang starts: three pods exist, the nodes cannot be read, and the start-up
    deadline passes during the outage. No stall is judged on that view; the fourth pod comes once the API is back
    (the Job controller was down with it), and the attempt succeeds."""
    import threading

    cfg = _cfg(tmp_path / "store", startup_deadline_s=0.3)
    js = f"{cfg.run_id}-a0"
    timers: list[threading.Timer] = []

    def back(c):
        c.put("pods", pod(js, HOSTS - 1, time.time(), node=f"gke-tpu-{HOSTS - 1}", phase="Running", running=True))
        c.faults.clear()
        timers.append(threading.Timer(0.6, _succeed(js), (c,)))
        timers[-1].start()

    def created(c, obj):
        c.put("jobs", _job(js))
        t = time.time()
        for i in range(HOSTS - 1):
            c.put("pods", pod(js, i, t, node=f"gke-tpu-{i}", phase="Running", running=True))
        c.inject("/nodes/", 503, UNAVAILABLE)
        timers.append(threading.Timer(1.5, back, (c,)))
        timers[-1].start()

    cluster.on_create = created
    rec, lines = _run_joining(cfg, tmp_path, cluster, timers)
    assert rec.outcome == "succeeded", rec.reason
    assert any("the cluster view is not current" in line and "node gke-tpu-0" in line for line in lines), lines


def test_a_view_unreadable_past_its_limit_ends_the_step_as_transient_and_leaves_the_gang(
    tmp_path, cluster, monkeypatch
):
    cfg = _cfg(tmp_path / "store")
    js = f"{cfg.run_id}-a0"
    monkeypatch.setattr(ts, "STALE_VIEW_LIMIT_S", 0.5)

    def created(c, obj):
        _running_gang(js)(c, obj)
        c.inject("/nodes/", 503, UNAVAILABLE)

    cluster.on_create = created
    with pytest.raises(StepError) as e:
        _run(cfg, tmp_path, cluster)
    assert e.value.code == ExitCode.TRANSIENT
    assert "the cluster view has been unreadable" in str(e.value) and "left running" in str(e.value)
    assert not cluster.requests_of("DELETE", f"/jobsets/{js}") and js in cluster.objects["jobsets"]


def test_a_heartbeat_unreadable_past_its_limit_ends_the_step_as_transient_and_leaves_the_gang(
    tmp_path, cluster, monkeypatch
):
    """A worker's heartbeat that stays unreadable (torn here; a store that keeps failing its reads the same) past
    ``STALE_VIEW_LIMIT_S``: no hang is judged on it, and the step ends transient (69) for a new supervisor, the
    gang left running for it to re-attach."""
    cfg = _cfg(tmp_path / "store")
    js = f"{cfg.run_id}-a0"
    monkeypatch.setattr(ts, "STALE_VIEW_LIMIT_S", 0.5)
    store = RunStore(cfg.storage.root, cfg.run_id)
    _beat(store, 0, 9, time.time())
    (Path(cfg.storage.root) / "runs" / cfg.run_id / RunLayout.heartbeat(0, 2)).write_text("{torn")
    cluster.on_create = _running_gang(js)
    with pytest.raises(StepError) as e:
        _run(cfg, tmp_path, cluster)
    assert e.value.code == ExitCode.TRANSIENT
    assert "worker 2's heartbeat has been unreadable" in str(e.value) and "left running" in str(e.value), e.value
    assert not cluster.requests_of("DELETE", f"/jobsets/{js}") and js in cluster.objects["jobsets"]


# --- a JobSet no controller has acted on: no stall, and a bounded wait -------------------------------------------


def test_a_jobset_its_controller_acts_on_late_is_no_capacity_stall(tmp_path, cluster, monkeypatch):
    """The JobSet controller creates the Job a while after every start-up deadline (it was restarting): the
    supervisor judges no stall on a JobSet with neither Job nor pod, and the gang it then creates succeeds."""
    from recovery_steps import supervision

    for module in (supervision, ts):
        monkeypatch.setattr(module, "MISSING_PODS_GRACE_S", 1.5)  # creation times are whole seconds
    cfg = _cfg(tmp_path / "store", startup_deadline_s=1.5)
    js = f"{cfg.run_id}-a0"
    timers: list[threading.Timer] = []

    def acts(c):
        job = _job(js)
        job["metadata"]["creationTimestamp"] = iso(time.time())  # the Job's pods get their grace from it
        c.put("jobs", job)
        _gang(c, js, time.time(), phase="Running", running=True)
        timers.append(threading.Timer(0.5, _succeed(js), (c,)))
        timers[-1].start()

    def created(c, obj):
        timers.append(threading.Timer(2.5, acts, (c,)))
        timers[-1].start()

    cluster.on_create = created
    rec, lines = _run_joining(cfg, tmp_path, cluster, timers)
    assert rec.outcome == "succeeded", rec.reason
    assert any("the JobSet controller has not acted on it yet" in line for line in lines), lines


def test_a_jobset_no_controller_acts_on_ends_the_step_as_transient_past_its_limit_and_is_left(
    tmp_path, cluster, monkeypatch
):
    cfg = _cfg(tmp_path / "store", startup_deadline_s=0.1)
    js = f"{cfg.run_id}-a0"
    monkeypatch.setattr(ts, "JOBSET_UNACTED_LIMIT_S", 0.5)
    with pytest.raises(StepError) as e:
        _run(cfg, tmp_path, cluster)
    assert e.value.code == ExitCode.TRANSIENT
    assert f"JobSet {js} has had no Job for" in str(e.value) and "the JobSet controller has not acted" in str(e.value)
    assert not cluster.requests_of("DELETE", f"/jobsets/{js}") and js in cluster.objects["jobsets"]


# --- a refusal of the gang's pods: ended as soon as the Job reports it ---------------------------------------------


def test_a_pod_the_api_refuses_by_policy_ends_the_attempt_as_soon_as_the_job_reports_it(tmp_path, cluster):
    """Pod Security refuses one worker pod (hostPath): the Job controller's FailedCreate event says so, and the
    attempt ends as configuration at once, not at the start-up deadline as capacity; every call is in the Role."""
    cfg = _cfg(tmp_path / "store", startup_deadline_s=5)
    js = f"{cfg.run_id}-a0"
    refusal = (
        f'Error creating: pods "{js}-workers-0-3-x8k2p" is forbidden: violates PodSecurity "baseline:latest": '
        'hostPath volumes (volume "tpu-dev")'
    )

    def created(c, obj):
        c.put("jobs", _job(js))
        t = time.time()
        for i in range(HOSTS - 1):
            c.put("pods", pod(js, i, t, node=f"gke-tpu-{i}", phase="Running", running=True))
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{js}-workers-0.1"},
            "involvedObject": {"kind": "Job", "name": f"{js}-workers-0", "namespace": "training"},
            "type": "Warning",
            "reason": "FailedCreate",
            "message": refusal,
        }
        c.put("events", event)

    cluster.on_create = created
    t0 = time.monotonic()
    rec, _, _ = _run(cfg, tmp_path, cluster)
    assert (rec.outcome, rec.stall_kind) == ("stalled", "configuration"), rec.reason
    assert "could not create its worker pods: the namespace's Pod Security admission" in rec.reason
    assert time.monotonic() - t0 < 5
    used = {_verb(m, p) for m, p, _ in cluster.requests}
    assert ("", "events", "list") in used
    _granted_by_the_role(used)


def test_a_heartbeat_read_the_store_answered_only_after_retries_is_no_evidence_of_silence(
    tmp_path, cluster, monkeypatch
):
    """A 429 storm that the storage client retries through: reads come back late with the beat the worker wrote
    before (its own writes were held as long). Time spent so does not count towards hang_timeout_s."""
    cfg = _cfg(tmp_path / "store")  # hang_timeout_s 30
    store = RunStore(cfg.storage.root, cfg.run_id)
    js = f"{cfg.run_id}-a0"
    monkeypatch.setattr(ts, "SLOW_HEARTBEAT_READ_S", 0.2)
    # By the supervisor's observations (its read of worker 0's beat starts each one): from the 3rd, the clock is
    # 5 hang timeouts on and every read slow; from the 6th, reads are quick again; at the 9th the gang succeeds.
    state = {"observation": 0, "skew": 0.0}
    read = RunStore.read_record

    def read_record(self, rel, model):
        if rel == RunLayout.heartbeat(0, 0):
            state["observation"] += 1
            if state["observation"] == 3:
                state["skew"] = 5 * cfg.supervision.hang_timeout_s
            if state["observation"] == 9:
                _succeed(js)(cluster)
        if "heartbeats" in rel and 3 <= state["observation"] < 6:
            time.sleep(0.25)
        return read(self, rel, model)

    monkeypatch.setattr(RunStore, "read_record", read_record)
    cluster.on_create = _running_gang(js)
    _beat(store, 0, 5, time.time())
    rec = _run_on_clock(cfg, tmp_path, cluster, lambda: time.time() + state["skew"])
    assert rec.outcome == "succeeded", rec.reason
    assert state["observation"] >= 9


def test_the_supervisor_reads_the_longest_start_up_of_the_runs_earlier_attempts(tmp_path):
    from jaxrec.model.records import WorkerSupervision

    store = RunStore(str(tmp_path), "r")

    def record(attempt: int, took: float) -> SupervisionRecord:
        w = WorkerSupervision(index=0, started_at=1000.0, first_step_at=1000.0 + took)
        return SupervisionRecord(
            attempt=attempt, jobset=f"r-a{attempt}", outcome="failed", reason="r", detected_at=5000.0, workers=[w]
        )

    assert ts.earlier_startup(store, 0) is None  # the first attempt has nothing before it
    store.write_record(RunLayout.supervision(0), record(0, 420.0))
    store.write_record(RunLayout.supervision(1), record(1, 95.0))
    store.write_bytes(RunLayout.supervision(2), b"{torn")  # unreadable: adds nothing, stops nothing
    assert ts.earlier_startup(store, 3) == 420.0
    assert ts.earlier_startup(store, 2) == 420.0
    # Only the latest attempts count: a start-up long ago (a cold cache, another config) is not read.
    assert ts.earlier_startup(store, 1 + STARTUP_ATTEMPTS_READ) == 95.0


def test_a_failure_one_watch_shows_before_the_other_is_read_once_more_by_listing():
    """The watches deliver independently: when the Job's or the JobSet's shows a failure the pods' does not yet, or
    the other way round, the view lists both again, so the verdict's snapshot holds the failed pod (its worker
    named) beside the Job's reason."""
    from jaxrec.adapters.kube import make_api_client
    from jaxrec.model.snapshot import job_from_api, pod_from_api
    from recovery_steps.kube_gang import KubeGang

    cluster = FakeCluster()
    t = time.time()
    failed = pod("js", 1, t, node="n1", phase="Failed", exit_code=137)
    target = {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded", "message": "limit"}
    job = {"metadata": {"name": "js-workers-0", "labels": {"jobset.sigs.k8s.io/jobset-name": "js"}}}
    cluster.put("pods", pod("js", 0, t, node="n0", phase="Running", running=True), failed)
    cluster.put("jobs", {**job, "status": {"conditions": [target]}})
    try:
        gang = KubeGang(make_api_client(cluster.url), "training", "js")
        running = [pod_from_api(pod("js", i, t, node=f"n{i}", phase="Running", running=True)) for i in range(2)]
        # The Job's verdict arrived first: the pods are listed again, the failed one with them.
        pods, jobs = gang._consistent(running, [job_from_api({**job, "status": {"conditions": [target]}})])
        assert [p.phase for p in pods] == ["Running", "Failed"] and jobs[0].failure() is not None
        # The failed pod arrived first: the Jobs are listed again, with the controller's verdict.
        pods, jobs = gang._consistent([pod_from_api(failed)], [job_from_api(job)])
        assert jobs[0].failure().reason == "BackoffLimitExceeded"
        # The JobSet's failure arrived first: the pods and Jobs are listed again.
        pods, jobs = gang._consistent(running, [job_from_api(job)], jobset_failed=True)
        assert [p.phase for p in pods] == ["Running", "Failed"] and jobs[0].failure() is not None
        # The JobSet's failure and the pod's, the Job's verdict not yet: listed again, the Job's reason with it.
        pods, jobs = gang._consistent([pod_from_api(failed)], [job_from_api(job)], jobset_failed=True)
        assert jobs[0].failure().reason == "BackoffLimitExceeded"
        # Both views agree: nothing is listed.
        before = len(cluster.requests)
        gang._consistent(running, [job_from_api(job)])
        assert len(cluster.requests) == before
    finally:
        cluster.close()


def test_a_node_gone_from_the_api_keeps_the_pool_it_was_seen_in():
    """A reclaimed slice's nodes leave the API: the snapshot still says which pool they were, for the placement."""
    from jaxrec.adapters.kube import make_api_client
    from jaxrec.model.snapshot import NodeEvidence
    from recovery_steps.kube_gang import KubeGang

    cluster = FakeCluster()
    cluster.put("pods", pod("js", 0, time.time(), node="n0", phase="Running", running=True))
    try:
        gang = KubeGang(make_api_client(cluster.url), "training", "js")
        gang.node_cache["n0"] = NodeEvidence(name="n0", ready=True, pool="pool-a")
        gang.start()
        (node,) = gang.observe().nodes
        assert (node.found, node.pool) == (False, "pool-a"), node
    finally:
        gang.close()
        cluster.close()


# -- the pool the last attempt left healthy ---------------------------------------------------------------------


def _left(store, *, cls="infrastructure", nodes=None, pools=("pool-a",) * HOSTS):
    """Attempt 0 closed with ``cls``, its supervisor's snapshot showing each worker on its node of ``pools``."""
    from jaxrec.model.records import AttemptRecord, Ledger
    from jaxrec.model.snapshot import ClusterSnapshot, NodeEvidence, PodEvidence

    nodes = nodes or [NodeEvidence(name=f"n{i}", ready=True, pool=p) for i, p in enumerate(pools)]
    pods = [PodEvidence(name=f"r-a0-workers-0-{i}", worker_index=i, node=f"n{i}") for i in range(HOSTS)]
    snap = ClusterSnapshot(taken_at=time.time(), pods=pods, nodes=nodes)
    sup = SupervisionRecord(
        attempt=0, jobset="r-a0", outcome="failed", reason="worker 3 failed", detected_at=time.time(), snapshot=snap
    )
    store.write_record(RunLayout.supervision(0), sup)
    ledger = Ledger(run_id=store.run_id, attempts=[AttemptRecord(attempt=0, outcome="failed", failure_class=cls)])
    store.write_record(RunLayout.LEDGER, ledger)


def _node(i, **kw):
    from jaxrec.model.snapshot import NodeEvidence

    return NodeEvidence(**{"name": f"n{i}", "ready": True, "pool": "pool-a", **kw})


@pytest.mark.parametrize(
    ("left", "want"),
    [
        ({}, (1, "pool-a", "")),  # an application error, a killed process, a hang: the hosts are fine
        ({"cls": "preemption"}, (2, "", "pool-a")),  # its nodes are being reclaimed
        ({"nodes": [*(_node(i) for i in range(3)), _node(3, ready=False)]}, (2, "", "pool-a")),  # one NotReady
        ({"nodes": [*(_node(i) for i in range(3)), _node(3, unschedulable=True)]}, (2, "", "pool-a")),  # cordoned
        ({"nodes": [*(_node(i) for i in range(3)), _node(3, found=False, pool=None)]}, (2, "", "pool-a")),  # gone
        (
            {
                "nodes": [
                    *(_node(i) for i in range(3)),
                    _node(3, taints=["cloud.google.com/impending-node-termination:NoSchedule"]),
                ]
            },
            (2, "", "pool-a"),
        ),
        ({"pools": ("pool-a", "pool-a", "pool-b", "pool-b")}, (1, "", "")),  # no one pool
        ({"nodes": [_node(i) for i in range(3)]}, (1, "", "")),  # a worker's node never read: not known healthy
        ({"pools": (None,) * HOSTS}, (1, "", "")),  # nodes of no known pool
    ],
)
def test_the_next_placement_from_the_last_attempts_class_and_hosts(tmp_path, left, want):
    """Level 1 prefers the pool the last attempt left healthy; level 2 prefers any other after a preemption or a
    host lost, cordoned or under notice; without one known pool, nothing is preferred."""
    store = RunStore(str(tmp_path / "store"), "r")
    _left(store, **left)
    where = ts.next_placement(store, 1)
    assert (where.level, where.prefer, where.avoid) == want, where
    assert ts.next_placement(store, 0).prefer == ts.next_placement(store, 0).avoid == ""  # the first: none
    assert ts.next_placement(RunStore(str(tmp_path / "other"), "r"), 1).prefer == ""  # no records: none


def _history(store, attempts):
    """Attempts 0.. closed as ``attempts`` say: (class, the pool of their healthy nodes, checkpoint before, after)."""
    from jaxrec.model.records import AttemptRecord, Ledger
    from jaxrec.model.snapshot import ClusterSnapshot, NodeEvidence, PodEvidence

    records = []
    for n, (cls, pool, before, after) in enumerate(attempts):
        nodes = [NodeEvidence(name=f"{pool}-{i}", ready=True, pool=pool) for i in range(HOSTS)]
        pods = [PodEvidence(name=f"r-a{n}-workers-0-{i}", worker_index=i, node=f"{pool}-{i}") for i in range(HOSTS)]
        snap = ClusterSnapshot(taken_at=time.time(), pods=pods, nodes=nodes)
        sup = SupervisionRecord(
            attempt=n, jobset=f"r-a{n}", outcome="failed", reason="r", detected_at=time.time(), snapshot=snap
        )
        store.write_record(RunLayout.supervision(n), sup)
        records.append(
            AttemptRecord(
                attempt=n,
                outcome="failed",
                failure_class=cls,
                checkpoint_step_before=before,
                checkpoint_step_after=after,
            )
        )
    store.write_record(RunLayout.LEDGER, Ledger(run_id=store.run_id, attempts=records))


@pytest.mark.parametrize(
    ("attempts", "want"),
    [
        # A host that fails without looking unhealthy: the second failure in a row on the pool, no progress, leaves it.
        ([("infrastructure", "pool-a", 100, 100), ("hang", "pool-a", 100, 100)], (2, "", "pool-a")),
        ([("unknown", "pool-a", None, None), ("infrastructure", "pool-a", None, None)], (2, "", "pool-a")),
        # Progress in between, another pool, or a class no host causes: the pool is still preferred.
        ([("infrastructure", "pool-a", 100, 100), ("infrastructure", "pool-a", 100, 200)], (1, "pool-a", "")),
        ([("infrastructure", "pool-b", 100, 100), ("infrastructure", "pool-a", 100, 100)], (1, "pool-a", "")),
        ([("infrastructure", "pool-a", 100, 100), ("application", "pool-a", 100, 100)], (1, "pool-a", "")),
        ([("application", "pool-a", 100, 100), ("infrastructure", "pool-a", 100, 100)], (1, "pool-a", "")),
    ],
)
def test_level_one_escalates_after_failing_twice_on_one_pool_without_progress(tmp_path, attempts, want):
    from jaxrec.model.jobset import SAME_POOL_TRIES

    assert SAME_POOL_TRIES == 2  # the table's histories are two attempts long
    store = RunStore(str(tmp_path / "store"), "r")
    _history(store, attempts)
    lines = []
    where = ts.next_placement(store, len(attempts), lines.append)
    assert (where.level, where.prefer, where.avoid) == want, where
    assert lines == [f"placement, level {where.level}: {where.why}"]
    if where.level == 2:
        assert "2 attempts in a row failed on node pool pool-a without the checkpoint advancing" in where.why


def test_an_older_attempts_unreadable_record_ends_the_count_not_the_placement(tmp_path):
    store = RunStore(str(tmp_path / "store"), "r")
    _history(store, [("infrastructure", "pool-a", 100, 100), ("infrastructure", "pool-a", 100, 100)])
    store.write_bytes(RunLayout.supervision(0), b"{torn")
    where = ts.next_placement(store, 2)
    assert (where.level, where.prefer, where.avoid) == (1, "pool-a", ""), where
    # The last attempt's own record unreadable: nothing is preferred, and the line says which records.
    store.write_bytes(RunLayout.supervision(1), b"{torn")
    lines = []
    where = ts.next_placement(store, 2, lines.append)
    assert (where.level, where.prefer, where.avoid) == (1, "", ""), where
    assert "attempt 1's supervision cannot be read" in lines[0], lines


def test_the_next_gang_is_created_preferring_the_pool_its_predecessor_left_healthy(tmp_path, cluster):
    cfg = _cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    _left(store)
    js = f"{cfg.run_id}-a1"
    cluster.on_create = _running_gang(js)
    cluster.script = [lambda c: None, _succeed(js)]
    rec, lines, _ = _run(cfg, tmp_path, cluster, attempt=1)
    assert rec.outcome == "succeeded", rec.reason
    assert "placement, level 1: the last attempt left node pool pool-a healthy: it is preferred" in lines
    # The supervision record and the step's outputs (the Argo UI's node panel) say it too.
    assert rec.placement == "level 1: the last attempt left node pool pool-a healthy: it is preferred"
    assert (tmp_path / "out" / "placement").read_text() == rec.placement
    pod = cluster.jobsets[js]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pref = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref[0]["preference"]["matchExpressions"][0]["values"] == ["pool-a"]


_RUNNING = {"running": True, "row": 0, "left": 5, "tries": 2}


@pytest.mark.parametrize(
    ("cls", "healthy", "in_place", "want"),
    [
        # Level 0: the trainers restart in their pods when only a trainer ended and every host is healthy.
        ("application", True, _RUNNING, (0, "", "")),
        ("hang", True, _RUNNING, (0, "", "")),
        ("infrastructure", True, _RUNNING, (0, "", "")),  # a killed process, a lost peer
        ("unknown", True, {**_RUNNING, "row": 1}, (0, "", "")),
        # Not level 0: a pod ended, a host lost or not seen, a class no restart answers, a budget or the tries spent.
        ("application", True, {**_RUNNING, "running": False}, (1, "pool-a", "")),
        ("infrastructure", False, _RUNNING, (2, "", "pool-a")),
        ("application", None, _RUNNING, (1, "", "")),
        ("preemption", True, _RUNNING, (2, "", "pool-a")),
        ("capacity", True, _RUNNING, (1, "pool-a", "")),
        ("configuration", True, _RUNNING, (1, "pool-a", "")),
        ("application", True, {**_RUNNING, "left": 0}, (1, "pool-a", "")),
        ("hang", True, {**_RUNNING, "row": 2}, (1, "pool-a", "")),  # level 0 failed twice: level 1
        # The gang gone (a new segment): levels 1 and 2 alone.
        ("application", True, None, (1, "pool-a", "")),
        ("infrastructure", False, None, (2, "", "pool-a")),
    ],
)
def test_the_ladder_chooses_the_level_by_class_evidence_and_budget(cls, healthy, in_place, want):
    from jaxrec.model.contract import FailureClass
    from jaxrec.model.jobset import InPlace, ladder

    where = ladder(FailureClass(cls), "pool-a", healthy, 0, InPlace(**in_place) if in_place else None)
    assert (where.level, where.prefer, where.avoid) == want, where
    if in_place is not None and where.level > 0:
        assert where.why.split("; ")[0] and "; " in where.why  # it says why level 0 was not taken, then the rung


def test_with_restarts_in_place_the_worker_runs_the_agent_with_the_trainers_flags(tmp_path):
    """``retry.in_place_budget`` > 0: the container runs ``trainer.agent``, whose child is the trainer with the
    same flags; 0 (the model's default): the trainer itself, as before."""
    from trainer.agent import parse, target_of

    cfg = _cfg(tmp_path)
    cfg = cfg.model_copy(update={"retry": cfg.retry.model_copy(update={"in_place_budget": 0})})
    params = JobSetParams("r-a3", "r", str(tmp_path / "store"), "3", "100", "0", "9400")
    plain = jobset_manifest(cfg, params)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert plain["containers"][0]["command"] == ["python", "-m", "trainer"]
    retry = cfg.retry.model_copy(update={"in_place_budget": 3, "in_place_hold_s": 45})
    agented = jobset_manifest(cfg.model_copy(update={"retry": retry}), params)
    c = agented["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "trainer.agent"]
    own, child = parse(c["args"])
    assert own.hold_s == 45 and child[1:3] == ["-m", "trainer"]
    assert child[3:] == plain["containers"][0]["args"]
    t = target_of(child)
    assert (t.run_id, t.attempt, t.restore_step) == ("r", 3, 100)


def _in_place_cfg(root: Path, budget: int = 2):
    """``_cfg`` with restarts in place allowed (``budget``), its pinned config rewritten."""
    cfg = _cfg(root)
    cfg = cfg.model_copy(update={"retry": cfg.retry.model_copy(update={"in_place_budget": budget})})
    RunStore(str(root), cfg.run_id).write_json(
        RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()}
    )
    return cfg


def _agents(tmp_path, cfg, plans, gang=0):
    """One real agent per worker of attempt ``gang``'s gang (threads), their trainers stand-ins following ``plans``;
    their exit codes."""
    from support.agents import make_agent, plan

    plan(tmp_path, **plans)
    agents = [make_agent(tmp_path, i, Path(cfg.storage.root), cfg.run_id, gang=gang) for i in range(HOSTS)]
    codes: dict[int, int] = {}
    threads = [threading.Thread(target=lambda a=a: codes.__setitem__(a.index, a.run()), daemon=True) for a in agents]
    return agents, threads, codes


def test_level_zero_restarts_every_trainer_in_its_pod_and_closes_the_attempt_in_the_ledger(tmp_path, cluster):
    """Worker 2's trainer fails (exit 42) in a gang of healthy hosts whose pods run on: the supervisor classifies
    it (application), closes attempt 0 in the ledger at level 0, has every agent stop its trainer (the others,
    blocked as in a collective, are SIGKILLed), chooses the step, and starts attempt 1 in the same pods; nothing is
    deleted, and attempt 1 finishes."""
    from support.agents import alive, starts

    from jaxrec.model.records import AttemptRecord, Ledger, RestoreRecord

    cfg = _in_place_cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    js, t0 = f"{cfg.run_id}-a0", time.time()
    plans = {f"w{i}_0": "block" for i in range(HOSTS)} | {"w2_0": "exit 42"}
    plans |= {f"w{i}_1": "exit 0" for i in range(HOSTS)}
    agents, threads, codes = _agents(tmp_path, cfg, plans)

    def created(c, obj):
        c.put("jobs", _job(js))
        _gang(c, js, t0, phase="Running", running=True)
        for t in threads:
            t.start()

    def finished(c):
        from support.agents import state

        done = [state(agents[0].store, i) for i in range(HOSTS)]
        if not all(s is not None and s.attempt == 1 and s.exit_code == 0 for s in done):
            c.script.insert(0, finished)
            time.sleep(0.05)
            return
        _gang(c, js, t0 + 9, phase="Succeeded", exit_code=0)
        c.put("jobs", _job(js, [{"type": "Complete", "status": "True", "lastTransitionTime": iso(t0 + 9)}]))
        c.put("jobsets", {**dict(c.objects["jobsets"][js]), "status": {"terminalState": "Completed"}})

    cluster.on_create = created
    cluster.script = [finished]
    rec, lines, _ = _run(cfg, tmp_path, cluster)
    for t in threads:
        t.join(10)

    assert (rec.attempt, rec.outcome) == (1, "succeeded"), rec
    assert rec.placement and rec.placement.startswith("level 0: every host is healthy")
    assert codes == dict.fromkeys(range(HOSTS), 0)
    assert not cluster.requests_of("DELETE", "/jobsets/")  # the gang was never recreated
    ledger = store.read_record(RunLayout.LEDGER, Ledger)
    (closed,) = ledger.attempts
    assert (closed.attempt, closed.failure_class, closed.level, closed.decision) == (0, "application", 0, "retry")
    assert closed.cause_worker == 2 and "uncaught exception" in closed.reason
    assert store.read_record(RunLayout.attempt_record(0), AttemptRecord) == closed
    failed = SupervisionRecord.model_validate(store.read_json(RunLayout.supervision(0)))
    assert failed.outcome == "failed" and failed.worker == 2 and failed.stopped_at is not None
    assert "worker 2's trainer exited (exit code 42)" in failed.reason
    assert store.read_record(RunLayout.restore_record(1), RestoreRecord).restore_step == -1
    first = [s for s in starts(tmp_path) if s["attempt"] == 0]
    again = [s for s in starts(tmp_path) if s["attempt"] == 1]
    assert sorted(s["index"] for s in again) == list(range(HOSTS))
    assert not any(alive(s["pid"]) for s in first)  # every old trainer ended before the new ones ran
    assert any("level 0" in line for line in lines)
    assert (tmp_path / "out" / "placement").read_text().startswith("level 0")
    restarted = (tmp_path / "out" / "restarted-in-place").read_text()
    assert restarted.startswith("attempt 0 (application: ") and restarted.endswith(" -> 1"), restarted


def test_with_the_restarts_in_place_spent_the_agents_exit_and_the_full_path_follows(tmp_path, cluster):
    """The run's restarts in place are spent (two in the ledger, budget 2): the supervisor orders the agents to exit
    with their trainers' codes, stops the attempt as without agents, and closes nothing itself."""
    from support.agents import state

    from jaxrec.model.records import AgentAction, AttemptRecord, Ledger, RestartOrder

    cfg = _in_place_cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    spent = [AttemptRecord(attempt=n, outcome="failed", failure_class="application", level=0) for n in range(2)]
    store.write_record(RunLayout.LEDGER, Ledger(run_id=cfg.run_id, attempts=spent))
    js, t0 = f"{cfg.run_id}-a2", time.time()
    plans = {f"w{i}_2": "sigterm 143" for i in range(HOSTS)} | {"w1_2": "exit 42"}
    agents, threads, codes = _agents(tmp_path, cfg, plans, gang=2)

    def created(c, obj):
        c.put("jobs", _job(js))
        for i in range(HOSTS):
            c.put("pods", pod(js, i, t0, node=f"gke-tpu-{i}", phase="Running", running=True, attempt="2"))
        for t in threads:
            t.start()

    cluster.on_create = created
    rec, lines, _ = _run(cfg, tmp_path, cluster, attempt=2)
    for t in threads:
        t.join(10)

    assert (rec.attempt, rec.outcome, rec.worker) == (2, "failed", 1), rec
    order = store.read_record(RunLayout.restart_order(2), RestartOrder)
    assert (order.action, order.attempt) == (AgentAction.EXIT, 2) and "in_place_budget" in order.reason
    assert codes == {0: 143, 1: 42, 2: 143, 3: 143}  # each left with its trainer's code
    assert state(agents[0].store, 1, gang=2).exit_code == 42
    assert cluster.requests_of("DELETE", f"/jobsets/{js}")  # stopped as without agents
    assert len(store.read_record(RunLayout.LEDGER, Ledger).attempts) == 2  # classify-failure closes attempt 2
    assert any("not restarted in place" in line for line in lines), lines


@pytest.mark.parametrize(
    ("history", "row", "used"),
    [
        ([], 0, 0),
        ([(0, 10, 10), (0, 10, 10)], 2, 2),  # two restarts in place, the checkpoint never advanced
        ([(0, 10, 10), (0, 10, 20)], 0, 2),  # the last one advanced it: the count starts again
        ([(0, 10, 10), (None, 10, 10), (0, 10, 10)], 1, 2),  # a recreated gang in between ends the row
    ],
)
def test_the_restarts_in_place_in_a_row_and_over_the_run_come_from_the_ledger(history, row, used):
    from jaxrec.model.records import AttemptRecord, Ledger
    from jaxrec.model.snapshot import ClusterSnapshot, PodEvidence, PodPhase
    from recovery_steps.in_place import in_place_facts

    attempts = [
        AttemptRecord(attempt=n, outcome="failed", level=lv, checkpoint_step_before=b, checkpoint_step_after=a)
        for n, (lv, b, a) in enumerate(history)
    ]
    pods = [PodEvidence(name=f"p{i}", worker_index=i, phase=PodPhase.RUNNING) for i in range(HOSTS)]
    facts = in_place_facts(Ledger(run_id="r", attempts=attempts), ClusterSnapshot(taken_at=0, pods=pods), HOSTS, 5, 2)
    assert (facts.running, facts.row, facts.left, facts.tries) == (True, row, 5 - used, 2)
    one_ended = ClusterSnapshot(taken_at=0, pods=pods[:-1])
    assert not in_place_facts(None, one_ended, HOSTS, 5, 2).running  # a pod gone: no restart in place


def test_the_segment_names_its_restarts_in_place_from_the_ledger():
    """The output the Argo UI shows: one line per restart in place of this gang (another gang's are not its)."""
    from jaxrec.model.records import AttemptRecord, Ledger
    from recovery_steps.in_place import restarts_line

    attempts = [
        AttemptRecord(attempt=0, outcome="failed", failure_class="application", reason="boom", level=0, jobset="r-a0"),
        AttemptRecord(attempt=1, outcome="failed", failure_class="hang", reason="stuck", jobset="r-a0"),
        AttemptRecord(
            attempt=2, outcome="failed", failure_class="infrastructure", reason="kill", level=0, jobset="r-a2"
        ),
    ]
    led = Ledger(run_id="r", attempts=attempts)
    assert restarts_line(led, "r-a0") == "attempt 0 (application: boom) -> 1"
    assert restarts_line(led, "r-a2") == "attempt 2 (infrastructure: kill) -> 3"
    assert restarts_line(None, "r-a0") == "" == restarts_line(led, "r-a1")


def test_a_retried_supervisor_follows_the_gang_to_the_attempt_it_was_restarted_as(tmp_path, cluster):
    """The supervisor's pod was lost after it restarted gang 0 in place as attempt 1: its retry re-attaches to
    the JobSet of attempt 0, reads the order, and supervises attempt 1 (its heartbeats, its record)."""
    from jaxrec.model.records import AgentAction, RestartOrder

    cfg = _in_place_cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    js, t0 = f"{cfg.run_id}-a0", time.time() - 100
    manifest = _manifest(cfg, 0)
    cluster.put("jobsets", {**manifest, "metadata": {**manifest["metadata"], "creationTimestamp": iso(t0)}})
    cluster.put("jobs", _job(js))
    _gang(cluster, js, t0, phase="Running", running=True)
    store.write_record(RunLayout.restart_order(0), RestartOrder(action=AgentAction.START, attempt=1, restore_step=5))
    _beat(store, 1, 12, time.time(), ckpt=10)

    def done(c):
        _gang(c, js, t0 + 90, phase="Succeeded", exit_code=0)
        c.put("jobs", _job(js, [{"type": "Complete", "status": "True", "lastTransitionTime": iso(t0 + 90)}]))
        c.put("jobsets", {**dict(c.objects["jobsets"][js]), "status": {"terminalState": "Completed"}})

    cluster.script = [lambda c: None, done]
    rec, lines, _ = _run(cfg, tmp_path, cluster)

    assert not cluster.requests_of("POST", "/jobsets"), "a second gang was created"
    assert (rec.attempt, rec.outcome, rec.reattached, rec.last_step) == (1, "succeeded", True, 12), rec
    assert SupervisionRecord.model_validate(store.read_json(RunLayout.supervision(1))) == rec
    assert not store.exists(RunLayout.supervision(0))  # attempt 0 was decided before; nothing rewrote it here
    assert any("supervising that one" in line for line in lines), lines


@pytest.mark.parametrize(
    ("order", "want"),
    [
        (None, 3),
        (("start", 5), 5),  # restarted in place twice: the trainers run attempt 5
        (("exit", 5), 5),  # attempt 5's trainers were told to exit: it is the one to close
        (("stop", 5), 4),  # the restart to 5 did not complete: the gang is still at 4, not closed yet
    ],
)
def test_the_attempt_a_gang_is_at_comes_from_its_last_order(tmp_path, order, want):
    from jaxrec.model.records import AgentAction, RestartOrder
    from recovery_steps.in_place import current_attempt

    store = RunStore(str(tmp_path), "r")
    if order is not None:
        store.write_record(RunLayout.restart_order(3), RestartOrder(action=AgentAction(order[0]), attempt=order[1]))
    assert current_attempt(store, 3) == want


def test_the_supervisor_reads_one_wake_object_between_its_decisions_and_acts_on_a_trainers_exit(tmp_path):
    """A trainer's exit changes no pod: its agent also writes the gang's wake object, which the supervisor reads
    every ``WAKE_POLL_S`` while it waits for its next decision, and decides at once when it changed."""
    from types import SimpleNamespace

    from jaxrec.model.records import AgentState, AgentStateKind
    from recovery_steps.in_place import LevelZero

    cfg = _in_place_cfg(tmp_path / "store")
    store = RunStore(cfg.storage.root, cfg.run_id)
    level0 = LevelZero(
        cfg, AttemptRef(cfg.storage.root, cfg.run_id, 0), f"{cfg.run_id}-a0", clock=time.time, wait=time.sleep,
        say=lambda _: None,
    )  # fmt: skip
    assert not level0.woken()  # no trainer has exited
    exited = AgentState(process_index=1, state=AgentStateKind.EXITED, attempt=0, exit_code=137, at=1.0)
    store.write_record(RunLayout.agent_wake(0), exited)
    assert level0.woken() and not level0.woken()  # seen once
    store.write_record(RunLayout.agent_wake(0), exited.model_copy(update={"process_index": 0, "at": 2.0}))
    assert level0.woken()
    store.write_bytes(RunLayout.agent_wake(0), b"{torn")
    assert not level0.woken()  # an unreadable wake is no exit

    # The pause ends on the wake's third reading, not after its 60 s.
    waits: list[float] = []
    readings = iter([False, False, True])
    gang = SimpleNamespace(wait=lambda s: bool(waits.append(s)))
    sup = SimpleNamespace(gang=gang, level0=SimpleNamespace(woken=lambda: next(readings)))
    ts.Supervisor.pause(sup, 60.0)  # type: ignore[arg-type]
    assert waits == [ts.WAKE_POLL_S] * 3
    # A change the watchers saw ends it too, before the wake is read.
    sup.gang = SimpleNamespace(wait=lambda s: True)
    sup.level0 = SimpleNamespace(woken=lambda: pytest.fail("read after a change"))
    ts.Supervisor.pause(sup, 60.0)  # type: ignore[arg-type]
