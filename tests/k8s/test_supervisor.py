"""train-segment (the supervisor), provision-slice and classify-failure against the real API server, Job controller,
JobSet controller and webhooks, scheduler and node-lifecycle controllers.

Each step runs as its own process (``python -m recovery_steps.<step>``) with a kubeconfig holding a bound token of
the steps' ServiceAccount, under the Role ``workflows.rbac`` generates (as in ``argo/rbac.yaml``): a verb the Role
lacks fails the test. Worker pods run on KWOK nodes; a test makes a worker's container exit with a code
(simulated kubelet report, tests/k8s/kwok-stages.yaml); every reaction to it is the real controllers'.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from realcluster import NEVER_PULLS_IMAGE, wait_for
from tier import HOSTS

from jaxrec.model.names import jobset_name
from jaxrec.model.snapshot import parse_time

pytestmark = pytest.mark.k8s


def test_success_the_real_job_and_jobset_complete_and_the_supervisor_says_succeeded(run):
    sup = run.supervise(0)
    pods = run.workers(0)
    # Exclusive placement (JobSet's pod webhooks): the whole gang on one node pool, one pod per node.
    assert len({p["spec"]["nodeName"] for p in pods}) == HOSTS
    run.beat(0, 5, checkpoint=5)
    for p in pods:
        run.rc.exit_pod(run.ns, p["metadata"]["name"], 0)
    code, log = run.finish(sup)
    assert code == 0, log
    rec = run.record(0)
    assert rec.outcome == "succeeded" and not rec.reattached and rec.last_step == 5
    assert (sup.out_dir / "outcome").read_text() == "succeeded"
    assert "created JobSet" in log
    # The real JobSet controller completes the JobSet (successPolicy All); a succeeded attempt is left as it is.
    name = jobset_name(run.cfg.run_id, 0)
    wait_for(
        "JobSet Completed",
        lambda: (run.rc.jobset(run.ns, name).get("status") or {}).get("terminalState") == "Completed",
        30,
    )


# The class the README's failure table gives each trainer exit code (exit-code table, podFailurePolicy).
EXIT_CLASSES = {
    2: "configuration",
    3: "configuration",
    20: "infrastructure",
    21: "hang",
    22: "infrastructure",
    42: "application",
    143: "preemption",
}


@pytest.mark.parametrize("code", [*sorted(EXIT_CLASSES), 1])
def test_the_real_job_controller_matches_each_exit_code_to_its_pod_failure_policy_rule(run, code):
    """Without a supervisor: the JobSet as train-segment creates it, one worker exits with ``code``."""
    from jaxrec.model.jobset import pod_failure_policy

    run.rc.apply(run.manifest(0), api=run.rc.api(run.token))  # as the steps' ServiceAccount
    pods = run.workers(0)
    run.rc.exit_pod(run.ns, pods[1]["metadata"]["name"], code)

    def job_failed():
        (job,) = run.rc.jobs(run.ns)
        conds = {c["type"]: c for c in job["status"].get("conditions") or [] if c["status"] == "True"}
        return conds if "Failed" in conds else None

    conds = wait_for("the Job Failed", job_failed, 60)
    rules = pod_failure_policy()["rules"]
    index = next((i for i, r in enumerate(rules) if code in (r.get("onExitCodes") or {}).get("values", [])), None)
    if index is None:  # no rule: backoffLimit 0 fails the Job on the first failed pod
        assert conds["Failed"]["reason"] == "BackoffLimitExceeded", conds
    else:
        # FailureTarget first, then Failed once every pod is terminal (pkg/controller/job, Kubernetes >= 1.31).
        assert conds["FailureTarget"]["reason"] == conds["Failed"]["reason"] == "PodFailurePolicy", conds
        assert f"exit code {code} matching FailJob rule at index {index}" in conds["Failed"]["message"], conds
    # JobSet reacts to the failed Job: maxRestarts 0 fails the whole JobSet (jobset_controller.go).
    name = jobset_name(run.cfg.run_id, 0)
    wait_for(
        "JobSet Failed", lambda: (run.rc.jobset(run.ns, name).get("status") or {}).get("terminalState") == "Failed", 30
    )


# Exits outside the podFailurePolicy (the Job fails on backoffLimit 0): the class comes from the pod's own state,
# which only the supervisor's record keeps once its stop deleted the gang.
UNLISTED_EXITS = [(137, "OOMKilled", "application"), (127, "Error", "configuration"), (126, "Error", "configuration")]


@pytest.mark.parametrize(("code", "reason", "cls"), UNLISTED_EXITS, ids=[f"{c}-{r}" for c, r, _ in UNLISTED_EXITS])
def test_an_oom_kill_or_a_missing_entrypoint_is_classified_from_the_record_of_the_stopped_gang(run, code, reason, cls):
    sup = run.supervise(0)
    pods = run.workers(0)
    run.beat(0, 7)
    run.rc.exit_pod(run.ns, pods[3]["metadata"]["name"], code, reason)
    rc, log = run.finish(sup)
    assert rc == 1, log
    wait_for("the stopped attempt's JobSet and pods gone", lambda: run.gone(0), 60)
    result = run.classify(0)
    assert result.verdict.failure_class == cls, (result.verdict, result.evidence)


@pytest.mark.parametrize("code", sorted(EXIT_CLASSES))
def test_a_worker_exit_code_is_matched_by_the_real_pod_failure_policy_and_classified(run, code):
    sup = run.supervise(0)
    pods = run.workers(0)
    run.beat(0, 7)
    victim = pods[2]["metadata"]["name"]
    run.rc.exit_pod(run.ns, victim, code)
    rc, log = run.finish(sup)
    assert rc == 1, log
    rec = run.record(0)
    assert rec.outcome == "failed" and f"exit code {code}" in rec.reason, rec.reason
    assert any(p.name == victim and p.trainer().exit_code == code for p in rec.snapshot.pods), rec.snapshot
    assert "stopping the attempt" in log
    wait_for("the stopped attempt's JobSet and pods gone", lambda: run.gone(0), 60)
    result = run.classify(0)
    assert result.verdict.failure_class == EXIT_CLASSES[code], (result.verdict, result.evidence)


@pytest.mark.parametrize("spot", [pytest.param(False, marks=pytest.mark.on_demand), True], ids=["on-demand", "spot"])
@pytest.mark.supervision(node_lost_grace_s=10)
def test_a_lost_node_is_seen_by_the_real_node_lifecycle_and_its_stuck_pod_force_deleted(run, spot):
    sup = run.supervise(0)
    pods = run.workers(0)
    run.beat(0, 3)
    lost = pods[3]["spec"]["nodeName"]
    run.rc.lose_node(lost)
    code, log = run.finish(sup, timeout=180)
    assert code == 1, log
    rec = run.record(0)
    assert rec.outcome == "stalled" and rec.stall_kind == "node-lost", rec
    assert rec.force_deleted == [pods[3]["metadata"]["name"]], (rec, log)
    # The real node-lifecycle controller marked the node: Ready Unknown and the unreachable NoExecute taint.
    node = run.rc.node(lost)
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "Unknown"
    assert any(t["key"] == "node.kubernetes.io/unreachable" for t in node["spec"].get("taints") or [])
    wait_for("the stopped attempt's JobSet and pods gone", lambda: run.gone(0), 60)
    result = run.classify(0)
    # A Spot VM that vanished was reclaimed (GKE docs "Spot VMs"); an on-demand one failed.
    assert result.verdict.failure_class == ("preemption" if spot else "infrastructure"), result.verdict


@pytest.mark.supervision(node_lost_grace_s=20)
def test_a_node_lost_while_the_api_server_restarts_is_judged_only_once_the_view_is_current_again(run):
    """A worker's node is lost; 15 s into its 20 s grace the API server restarts. The supervisor's cached view says
    the node is lost, but the view cannot be refreshed: no stall is judged on it, and every stall clock counts from
    when the view is current again. The verdict comes a full grace after the API server is back, never during; or,
    where the real node lifecycle evicts the worker's pod meanwhile (its eviction retried once the API server is
    back), the force-delete grace after both the view and the eviction are current."""
    sup = run.supervise(0)
    pods = run.workers(0)
    run.beat(0, 3)
    lost = pods[3]["spec"]["nodeName"]
    run.rc.lose_node(lost)

    def lost_since() -> float | None:
        ready = next(c for c in run.rc.node(lost)["status"]["conditions"] if c["type"] == "Ready")
        return parse_time(ready["lastTransitionTime"]) if ready["status"] == "Unknown" else None

    since = wait_for(f"node {lost} NotReady", lost_since, 90, 0.5)
    time.sleep(max(0.0, since + 15 - time.time()))
    run.rc.restart("kube-apiserver")
    wait_for("kube-apiserver /readyz", lambda: run.rc._https("/readyz") == "ok", 90, 0.3)
    back = time.time()
    code, log = run.finish(sup, timeout=180)
    assert code == 1, log
    rec = run.record(0)
    assert rec.outcome == "stalled" and rec.stall_kind == "node-lost", rec
    assert "the cluster view is not current" in log and "the cluster view is current again" in log, log
    # The supervisor's view may be current a poll of /readyz before ``back``.
    slack = 0.5
    pod = next(p for p in rec.snapshot.pods if p.node == lost)
    if pod.deleted_at is not None and "Terminating" in rec.reason:
        force_grace = run.cfg.supervision.force_delete_grace_s
        assert rec.detected_at >= max(back, pod.deleted_at) + force_grace - slack, (rec.detected_at - back, rec.reason)
    else:
        assert rec.detected_at >= back + 10, (rec.detected_at - back, rec.reason)


def _stalls_and_is_classified(run, kind: str, cls: str):
    """Supervise attempt 0 until the supervisor ends it as a ``kind`` stall; classify-failure says ``cls``."""
    sup = run.supervise(0)
    code, log = run.finish(sup, timeout=120)
    assert code == 1, log
    rec = run.record(0)
    assert rec.outcome == "stalled" and rec.stall_kind == kind, rec
    wait_for("the stopped attempt's JobSet and pods gone", lambda: run.gone(0), 60)
    result = run.classify(0)
    assert result.verdict.failure_class == cls, (result.verdict, result.evidence)
    return rec


@pytest.mark.nodes(2)
@pytest.mark.supervision(startup_deadline_s=8)
def test_too_few_tpu_nodes_is_the_real_schedulers_unschedulable_and_ends_as_capacity(run):
    rec = _stalls_and_is_classified(run, "capacity", "capacity")
    evidence = " ".join(rec.evidence)
    assert "unschedulable" in evidence and "nodes are available" in evidence, evidence


@pytest.mark.image(NEVER_PULLS_IMAGE)
@pytest.mark.supervision(image_pull_deadline_s=4)
def test_an_image_that_never_pulls_ends_as_configuration(run):
    """Simulated: KWOK reports ImagePullBackOff ("not found") for this image (no kubelet pulls anything here)."""
    _stalls_and_is_classified(run, "configuration", "configuration")


@pytest.mark.supervision(startup_deadline_s=180)
def test_a_pod_security_refusal_ends_the_attempt_as_soon_as_the_real_job_controller_reports_it(run):
    """The namespace enforces the restricted Pod Security level, which the worker pods do not meet: the real API
    server refuses them, the real Job controller says so in its FailedCreate event, and the supervisor ends the
    attempt as configuration then, not at the 180 s start-up deadline; classify-failure says configuration."""
    run.rc.core().patch_namespace(
        run.ns, {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}}
    )
    rec = _stalls_and_is_classified(run, "configuration", "configuration")
    assert "could not create its worker pods: the namespace's Pod Security admission" in rec.reason, rec.reason
    assert rec.detected_at - rec.created_at < 60, rec


def test_a_supervisor_killed_and_started_again_reattaches_to_the_live_jobset(run):
    first = run.supervise(0)
    pods = run.workers(0)
    run.beat(0, 4)
    wait_for(
        "the first supervisor reports the gang running", lambda: "workers running 4/4" in first.log_path.read_text(), 30
    )
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(10)
    # The gang lives on without its supervisor, and classify-failure does not close the attempt: it has the
    # same attempt supervised again (the next attempt's provision-slice would delete a healthy gang).
    assert [p["metadata"]["uid"] for p in run.workers(0)] == [p["metadata"]["uid"] for p in pods]
    result = run.classify(0)
    assert result.decision.decision == "resupervise", result.verdict
    assert run.rc.jobset(run.ns, jobset_name(run.cfg.run_id, 0)) is not None
    second = run.supervise(0)
    wait_for("the second supervisor re-attached", lambda: "re-attached" in second.log_path.read_text(), 30)
    run.rc.exit_pod(run.ns, pods[1]["metadata"]["name"], 42)
    code, log = run.finish(second)
    assert code == 1, log
    rec = run.record(0)
    assert rec.reattached and rec.outcome == "failed"
    assert len(run.rc.jobs(run.ns)) <= 1  # never a second gang
    result = run.classify(0)
    assert result.verdict.failure_class == "application", (result.verdict, result.evidence)


def test_the_jobset_webhook_down_is_transient_and_the_retry_creates_the_gang(run):
    """JobSet's webhooks fail closed (failurePolicy: Fail) while its one controller pod restarts: the create is
    answered 500. That is exit 69 (Argo retries in place), never configuration (budget 0)."""
    run.rc.components["jobset"].stop()
    try:
        sup = run.supervise(0)
        code, log = run.finish(sup, timeout=120)
        assert code == 69, log
        assert "answered 500" in log and "failed calling webhook" in log, log
        assert run.rc.jobset(run.ns, jobset_name(run.cfg.run_id, 0)) is None
        assert run.record(0).outcome == "error" and run.record(0).exit_code == 69
    finally:
        run.rc.restart("jobset")
    retry = run.supervise(0)
    run.workers(0)
    assert "created JobSet" in retry.log_path.read_text()


def test_a_sigtermed_supervisor_says_what_it_leaves_and_leaves_the_gang(run):
    sup = run.supervise(0)
    run.workers(0)
    wait_for("the supervisor follows the gang", lambda: "workers running 4/4" in sup.log_path.read_text(), 30)
    sup.send_signal(signal.SIGTERM)  # argo stop / terminate, a drain, an eviction
    code, log = run.finish(sup, timeout=30)
    assert code == 143, log
    assert "left running without a verdict" in log.strip().splitlines()[-1], log
    assert len(run.workers(0)) == HOSTS and run.rc.jobset(run.ns, jobset_name(run.cfg.run_id, 0)) is not None


def _provision(run, attempt: int):
    out = run.tmp / f"prov-out-{attempt}"
    p = run.step(
        "recovery_steps.provision_slice",
        "--store-root",
        run.cfg.storage.root,
        "--run-id",
        run.cfg.run_id,
        "--attempt",
        str(attempt),
        "--output-dir",
        str(out),
    )
    return p, out


def test_provision_slice_deletes_the_earlier_attempts_finished_jobset_and_waits_for_its_pods(run):
    sup = run.supervise(0)
    pods = run.workers(0)
    os.killpg(sup.pid, signal.SIGKILL)  # the supervisor is gone; then the gang fails by itself
    sup.wait(10)
    run.rc.exit_pod(run.ns, pods[0]["metadata"]["name"], 42)
    name = jobset_name(run.cfg.run_id, 0)
    wait_for(
        "JobSet Failed", lambda: (run.rc.jobset(run.ns, name).get("status") or {}).get("terminalState") == "Failed", 60
    )
    # JobSet deletes only the active Jobs of a failed JobSet: the failed Job's pods are still there.
    assert run.rc.pods(run.ns, f"jobset.sigs.k8s.io/jobset-name={name}")
    p, out = _provision(run, 1)
    assert p.returncode == 0, p.stdout + p.stderr
    assert run.gone(0), "provision-slice returned before the earlier attempt's JobSet and pods were gone"
    assert (out / "jobset-name").read_text() == jobset_name(run.cfg.run_id, 1)


def test_provision_slice_never_deletes_a_live_gang_nothing_decided(run):
    sup = run.supervise(0)
    run.workers(0)
    os.killpg(sup.pid, signal.SIGKILL)
    sup.wait(10)
    p, _ = _provision(run, 1)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no supervisor decided it" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert len(run.workers(0)) == HOSTS  # the gang is untouched
    # The attempt's own live gang is kept for train-segment to re-attach (a resubmitted run continues there).
    p, _ = _provision(run, 0)
    assert p.returncode == 0, p.stdout + p.stderr
    assert len(run.workers(0)) == HOSTS


def test_preflight_dry_runs_a_worker_pod_through_the_real_admission_and_says_a_limit_range_refusal(run):
    """As the steps' account, under the generated Role: one worker pod as rendered passes the real API server's
    admission as a dry run (nothing stored); a LimitRange, which no namespace label shows, refuses it, and preflight
    says so in one line before any slice."""
    from recovery_steps import preflight

    api = run.rc.api(run.token)
    assert preflight.check_cluster(run.cfg, api) == []
    assert run.rc.pods(run.ns) == []
    limits = {
        "apiVersion": "v1",
        "kind": "LimitRange",
        "metadata": {"name": "tiny", "namespace": run.ns},
        "spec": {"limits": [{"type": "Container", "min": {"memory": "2000Gi"}}]},
    }
    run.rc.apply(limits)
    try:
        (p,) = preflight.check_cluster(run.cfg, api)
    finally:
        run.rc.core().delete_namespaced_limit_range("tiny", run.ns)
    assert "the namespace's LimitRange forbids them" in p.missing and "minimum memory usage" in p.missing, p.line()
    assert run.rc.pods(run.ns) == []


def _left_healthy(run, attempt: int, nodes: list[str], *, lost: bool = False) -> None:
    """Attempt ``attempt`` failed (an application error) on ``nodes``, all healthy, as its supervisor saw it
    (``lost``: the last of them NotReady)."""
    from jaxrec.adapters.store import RunLayout
    from jaxrec.model.records import SupervisionRecord
    from jaxrec.model.snapshot import ClusterSnapshot, NodeEvidence, PodEvidence

    pods = [PodEvidence(name=f"w-{i}", worker_index=i, node=n) for i, n in enumerate(nodes)]
    pools = {n: run.rc.node(n)["metadata"]["labels"]["cloud.google.com/gke-nodepool"] for n in nodes}
    snap = ClusterSnapshot(
        taken_at=time.time(),
        pods=pods,
        nodes=[NodeEvidence(name=n, ready=not (lost and n == nodes[-1]), pool=pools[n]) for n in nodes],
    )
    rec = SupervisionRecord(
        attempt=attempt,
        jobset=jobset_name(run.cfg.run_id, attempt),
        outcome="failed",
        reason="worker 0 failed (exit code 42)",
        detected_at=time.time(),
        snapshot=snap,
    )
    run.store.write_record(RunLayout.supervision(attempt), rec)


def test_the_next_gang_lands_on_the_pool_its_predecessor_left_healthy_and_off_the_one_that_lost_a_host(run, tpu_nodes):
    """Two pools of the slice's type. The real JobSet webhook keeps the preferred node affinity beside its exclusive
    placement and the real scheduler honours it: each attempt goes to the pool the attempt before it left healthy,
    one way and then the other (level 1), and away from the pool where the attempt before it lost a host (level 2),
    though that pool's nodes are Ready again."""
    first = [f"gke-{run.ns}-p0-{i}" for i in range(HOSTS)]  # the pool the ``run`` fixture made
    second = tpu_nodes(HOSTS, run.cfg)
    assert all(run.rc.node(n) is not None for n in first) and len(second) == HOSTS
    for attempt, left_on, lost, lands_on in (
        (1, second, False, second),
        (2, first, False, first),
        (3, first, True, second),
    ):
        _left_healthy(run, attempt - 1, left_on, lost=lost)
        sup = run.supervise(attempt)
        pods = run.workers(attempt)
        assert {p["spec"]["nodeName"] for p in pods} == set(lands_on), (attempt, [p["spec"]["nodeName"] for p in pods])
        for p in pods:
            run.rc.exit_pod(run.ns, p["metadata"]["name"], 0)
        code, log = run.finish(sup)
        assert code == 0 and f"placement, level {2 if lost else 1}: " in log, log
