"""The shipped Workflow (argo/v5e-4x4.yaml, unchanged but for ``argo submit -p store-root=...`` and a 2 s retry
backoff in the config it carries, ``argoctl.TIER_BACKOFF``) on the real Argo workflow-controller (v4.0.5), against
the real API server, Job and JobSet controllers, scheduler and webhooks.

Each scenario's run also checks the local stand-in against the real controller (``standin.agrees``): one run for
both. Every step pod runs its real step program as a local process (``podexec``, a simulated kubelet: it also writes the
WorkflowTaskResult Argo's wait container would write). The JobSet's worker pods stay on KWOK (simulated): a test
makes a worker exit with a code (``exit_pod``) and writes the heartbeats the trainer would write. What follows is
decided by the real controllers: retryStrategy expressions, ``depends`` and ``when``, parameter passing, the nested
attempt DAG, the exit handler and the run mutex, and by the project's steps under the project's RBAC.
"""

from __future__ import annotations

import time

import argoctl
import pytest
import standin
import yaml
from argoctl import ARGO_FILE
from argorun import lose_supervisor
from realcluster import netns_listeners
from tier import REPO

from jaxrec.adapters.store import RunLayout
from jaxrec.model.names import CONTINUES_LABEL, RUN_ID_LABEL, continuation_name
from jaxrec.model.records import RunLease, SupervisionRecord
from jaxrec.model.snapshot import parse_time

pytestmark = pytest.mark.k8s


def test_the_controller_listens_only_inside_its_own_network_namespace(real_cluster, argo):
    """Argo v4.0.5 binds its health server to ``:6060`` (all interfaces, hard-coded): it is inside a network
    namespace whose only interface is loopback, so nothing outside this machine's test process can reach it."""
    pid = argo.proc.pid
    assert argoctl.netns_of(pid) != argoctl.netns_of("self")
    with open(f"/proc/{pid}/net/dev") as f:
        interfaces = [line.split(":")[0].strip() for line in f.read().splitlines()[2:]]
    assert interfaces == ["lo"], interfaces
    inside = netns_listeners(pid)
    assert any(port == 6060 for _, port in inside), inside  # the listener this design exists for is there
    assert (("127.0.0.1", argo.forwarder.port)) in inside
    real_cluster.check_alive()


# README scenario -> what the worker pods report (KWOK: the exit code of the trainer's container), the class
# classify-failure gives it.
RECOVERABLE = {
    # SIGKILL of one worker: 137 has no podFailurePolicy rule, so backoffLimit 0 fails the Job.
    "kill-worker": ("one", 137, "infrastructure"),
    # SIGTERM to every worker, state saved in the shutdown window: exit 143 (FailJob rule).
    "preempt": ("all", 143, "preemption"),
}


@pytest.mark.parametrize("scenario", sorted(RECOVERABLE))
def test_a_recoverable_failure_is_a_new_attempt_and_the_run_succeeds(argo_run, scenario):
    """README scenarios ``kill-worker`` and ``preempt``: the supervisor ends attempt 0 (exit 1, not retried by
    Argo), classify-failure decides ``retry``, the nested attempt DAG runs provision-slice, restore-latest and
    train-segment for attempt 1, whose gang completes: the Workflow Succeeds and the exit handler says so."""
    who, code, cls = RECOVERABLE[scenario]
    t0 = time.monotonic()
    argo_run.submit()
    pods = argo_run.workers(0)
    argo_run.beat(0, 5)
    for p in pods if who == "all" else pods[2:3]:
        argo_run.rc.exit_pod(argo_run.ns, p["metadata"]["name"], code)
    argo_run.workers(1)
    argo_run.beat(1, 12)
    argo_run.exit_all(1, 0)
    wf = argo_run.wait_done(200)
    report = argoctl.summary(wf)
    assert wf["status"]["phase"] == "Succeeded", report
    verdicts = [argoctl.outputs(n) for n in argoctl.pods_of(wf, "classify-failure")]
    assert [(v["failure-class"], v["decision"], v["next-attempt"]) for v in verdicts] == [(cls, "retry", "1")], report
    # The wait before the next attempt is the config's: classify-failure's backoff, the Suspend node's duration.
    assert [float(v["backoff-seconds"]) for v in verdicts] == [argoctl.TIER_BACKOFF["base_s"]], report
    (wait,) = [n for n in argoctl.nodes(wf) if n.get("type") == "Suspend"]
    took = parse_time(wait["finishedAt"]) - parse_time(wait["startedAt"])
    assert took <= argoctl.TIER_BACKOFF["base_s"] + 2, report  # whole seconds; the 30 s shipped would be seen
    segments = argoctl.pods_of(wf, "train-segment")
    assert [(n["outputs"]["exitCode"], argoctl.outputs(n)["outcome"]) for n in segments] == [
        ("1", "failed"),
        ("0", "succeeded"),
    ], report
    assert [argoctl.outputs(n)["restore-step"] for n in argoctl.pods_of(wf, "restore-latest")] == ["-1", "-1"], report
    (final,) = argoctl.pods_of(wf, "exit-handler")
    assert argoctl.outputs(final)["final-status"] == "Succeeded", report
    ledger = argo_run.ledger()
    assert [(a.attempt, a.outcome, a.failure_class) for a in ledger.attempts] == [
        (0, "failed", cls),
        (1, "succeeded", None),
    ]
    assert ledger.final_status == "Succeeded"
    standin.agrees(argo_run, wf, scenario)
    print(f"{scenario} on the real controller: {time.monotonic() - t0:.0f} s\n{report}")


def test_supervisor_lost_an_evicted_supervisor_is_retried_and_reattaches_to_the_running_gang(argo_run):
    """README scenario ``supervisor-lost``, the way a node drain does it: the train-segment pod is evicted
    (Eviction API: SIGTERM, exit 143) once the controller has had it Running longer than RAN_LONGER_S. Argo
    retries the step (Error "pod deleted", or Failed 143: neither is the supervisor's verdict), the new supervisor
    re-attaches to the same JobSet, the gang keeps training (same worker pods) and no attempt is closed; the run
    Succeeds on attempt 0."""
    wf = yaml.safe_load((REPO / "argo" / ARGO_FILE).read_text())
    segment = next(t for t in wf["spec"]["templates"] if t["name"] == "train-segment")
    assert "maxDuration" not in segment["retryStrategy"]  # a retry is never refused for the segment's age
    argo_run.submit()
    workers = argo_run.workers(0)
    argo_run.beat(0, 5)
    lose_supervisor(argo_run)
    argo_run.beat(0, 15)
    assert [p["metadata"]["uid"] for p in argo_run.workers(0)] == [p["metadata"]["uid"] for p in workers]
    argo_run.exit_all(0, 0)
    wf = argo_run.wait_done(200)
    report = argoctl.summary(wf)
    assert wf["status"]["phase"] == "Succeeded", report
    *lost, last = argoctl.pods_of(wf, "train-segment")
    # The kubelet reports the SIGTERMed supervisor Failed (exit 143), then the pod is removed: the controller
    # retries a node it saw Failed 143, or Error "pod deleted" when the removal came first.
    assert [(n["phase"], (n.get("outputs") or {}).get("exitCode")) for n in lost] in (
        [("Failed", "143")],
        [("Error", None)],
    ), report
    assert (last["phase"], last["outputs"]["exitCode"]) == ("Succeeded", "0"), report
    assert not argoctl.pods_of(wf, "classify-failure"), report
    rec = SupervisionRecord.model_validate(argo_run.store.read_json(RunLayout.supervision(0)))
    assert rec.outcome == "succeeded" and rec.reattached, rec
    ledger = argo_run.ledger()
    assert [(a.attempt, a.outcome) for a in ledger.attempts] == [(0, "succeeded")], ledger
    standin.agrees(argo_run, wf, "supervisor-lost")
    print(f"supervisor-lost on the real controller: retried after {lost[0]['phase']} ({lost[0].get('message')})")


def test_a_workflow_past_its_attempts_hands_the_run_to_a_continuation_on_the_real_controller(argo_run):
    """``retry.attempts_per_workflow: 1``: attempt 0 fails (a worker killed), classify-failure decides ``hand-over``,
    and the step creates the continuation Workflow through the API under the project's RBAC (``<run-id>-c1``,
    labelled with the run and the Workflow it continues), passes it the run lease and records the hand-over. The
    first Workflow ends leaving the ledger to the continuation (its exit handler says handed over), which waits on
    the run's mutex, continues at attempt 1 and Succeeds."""
    rc, ns, run_id = argo_run.rc, argo_run.ns, argo_run.cfg.run_id
    first = argo_run.submit(lambda cfg: cfg.setdefault("retry", {}).update(attempts_per_workflow=1))
    argo_run.workers(0)
    argo_run.beat(0, 5)
    rc.exit_pod(ns, argo_run.workers(0)[2]["metadata"]["name"], 137)
    ended = argo_run.wait_done(200)
    report = argoctl.summary(ended)
    verdicts = [argoctl.outputs(n) for n in argoctl.pods_of(ended, "classify-failure")]
    assert [(v["failure-class"], v["decision"]) for v in verdicts] == [("infrastructure", "hand-over")], report
    (handed,) = argoctl.pods_of(ended, "hand-over")
    continuation = argoctl.outputs(handed)["continuation"]
    assert continuation == continuation_name(run_id, 1), report
    (final,) = argoctl.pods_of(ended, "exit-handler")
    assert argoctl.outputs(final)["final-status"] == "HandedOver", report
    cont = argoctl.workflow(rc, ns, continuation)
    labels = cont["metadata"]["labels"]
    assert (labels[RUN_ID_LABEL], labels[CONTINUES_LABEL]) == (run_id, first), labels
    argo_run.name = continuation
    argo_run.workers(1)
    argo_run.beat(1, 12)
    argo_run.exit_all(1, 0)
    done = argo_run.wait_done(200)
    report = f"{report}\n{argoctl.summary(done)}"
    assert done["status"]["phase"] == "Succeeded", report
    ledger = argo_run.ledger()
    (h,) = ledger.hand_overs
    assert (h.from_workflow, h.to_workflow, h.next_attempt) == (first, continuation, 1), ledger
    assert h.to_uid == cont["metadata"]["uid"], (h, cont["metadata"]["uid"])
    assert [(a.attempt, a.outcome, a.decision) for a in ledger.attempts] == [
        (0, "failed", "hand-over"),
        (1, "succeeded", None),
    ], ledger
    assert [a.workflow for a in ledger.attempts] == [first, continuation], ledger
    assert ledger.final_status == "Succeeded", ledger
    held = argo_run.store.read_record(RunLayout.LEASE, RunLease)
    assert (held.holder, held.holder_name, held.released) == (h.to_uid, continuation, True), held
    print(f"hand-over on the real controller:\n{report}")
