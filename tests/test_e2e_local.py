"""End to end: the compiled workflow of a shrunken config run locally with each failure injected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import argo_replay
from support.local_job import HOSTS, INTERVAL, reference_digest, shrunken_workflow, steps_lost_bound

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import ExitCode, FailureClass
from jaxrec.model.records import AgentAction, Ledger, RestartOrder, SupervisionRecord
from workflows import local
from workflows.local.executor import RECENTLY_STARTED_POD_S

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def e2e_workflow(tmp_path_factory):
    """A 4-host, tiny-model, 20-step config compiled with the project's build functions."""
    d = tmp_path_factory.mktemp("e2e")
    return shrunken_workflow(d, "e2e", store_root=str(d / "store")), str(d / "store")


@pytest.fixture(scope="session")
def reference(e2e_workflow):
    return reference_digest(*e2e_workflow)


@pytest.fixture(params=["lm", "image-classifier"])
def job(request):
    """The job of each task and its uninterrupted run's digest: the lm's (4 hosts) or the classifier's (2)."""
    if request.param == "lm":
        return request.getfixturevalue("e2e_workflow"), request.getfixturevalue("reference")
    return request.getfixturevalue("classifier_job")


def _run(e2e_workflow, reference, run_id, inject, node_pools=1):
    wf, root = e2e_workflow
    lines: list[str] = []
    res = local.run(
        wf,
        local.LocalRunOptions(
            inject=inject,
            run_id=run_id,
            store_root=root,
            reference_digest=reference,
            metrics_port=0,
            node_pools=node_pools,
        ),
        say=lines.append,
    )
    return res, RunStore(root, run_id), "\n".join(lines)


def _assert_as_the_real_controller(res, scenario: str, out: str, *, recreated: bool = False) -> None:
    """The local run ran the nodes Argo's real controller ran for the scenario (tests/data/argo-v4.0.5): each step
    and suspend node as often, each template retried as often, each DAG node to the same phase, the same tasks
    left out, and the Workflow to the same phase.

    ``recreated``: the recorded run lost its supervisor's pod after the node's first 10 s (Error, then a retry);
    this one lost it within them, when Argo creates the pod again for the same node: one try, no Error.
    """
    rec = json.loads((Path(__file__).parent / "data" / "argo-v4.0.5" / f"{scenario}.json").read_text())
    ran, left = argo_replay.real_tables(rec)
    if recreated:
        assert ran.pop(("train-segment", "0", 0, "Error")) == 1 and ran.pop(("train-segment", "0", 1, "Succeeded")) == 1
        ran[("train-segment", "0", 0, "Succeeded")] += 1
    found = argo_replay.table_differences((ran, left), argo_replay.standin_tables(res.nodes, res.inner))
    assert (res.status, found) == (rec["phase"], []), out


def _assert_restores_were_good(store: RunStore, damaged: list[str]):
    """Every restored step had completed its transaction and was not damaged.

    Completed: a save_committed event before the restore, or, for a worker killed between its commit and the
    poll that would have reported it, the step's manifest (written only after orbax committed the step):
    still there, or verified by that attempt's restore-latest before a later save let orbax delete the step
    (``checkpoint.keep``).
    """
    from jaxrec.model.records import EventKind, RestoreRecord
    from workflows.report import load_events

    events = load_events(store)
    restores = [
        e for e in events if e.event == EventKind.RESTORED and e.restore_step is not None and e.restore_step >= 0
    ]
    for r in restores:
        committed = [e for e in events if e.event == EventKind.SAVE_COMMITTED and e.t < r.t]
        seen = any(e.step == r.step for e in committed)
        decided = store.read_record(RunLayout.restore_record(r.attempt), RestoreRecord)
        verified = decided is not None and decided.exit_code == 0 and decided.restore_step == r.step
        assert seen or verified or store.exists(RunLayout.checkpoint_manifest(r.step or 0)), (r, decided)
        assert not any(d.startswith(f"checkpoints/{r.step}/") for d in damaged), (r, damaged)
    return restores


def _assert_recovered(res, out, *, max_lost=INTERVAL, store: RunStore | None = None):
    """Succeeded with the reference's parameters, every incident recovered, losing at most ``max_lost`` steps.

    With ``store``, a failure that came before the asynchronous save of an interval had committed may lose
    that interval too: the bound is then the steps since the newest step committed before the failure.
    """
    assert res.status == "Succeeded", out
    assert res.params_match is True, out
    assert res.incidents, out
    for inc in res.incidents:
        bound = max_lost if store is None else steps_lost_bound(store, inc, max_lost)
        assert inc.steps_lost is not None and inc.steps_lost <= bound, inc
        assert inc.recovered_at is not None and inc.stopped_at >= inc.detected_at


def _assert_job_failed_as_the_controller_decides(sup: SupervisionRecord, *, victim: int) -> None:
    """The Job of a gang whose worker ``victim`` was SIGKILLed failed as the Job controller decides it.

    137 matches no FailJob rule: a sync that sees the victim alone fails the Job by its backoff limit (0). A peer
    that exits 20 (peer lost) before that sync matches a FailJob rule, which the controller checks before the
    backoff limit (``syncJob``, pkg/controller/job/job_controller.go, v1.36.3); both orders happen on a loaded
    machine, and the peer's message then names a worker other than the victim.
    """
    failure = sup.snapshot.jobs[0].failure()
    assert failure is not None, sup.snapshot.jobs
    if failure.reason == "PodFailurePolicy":
        assert f"failed with exit code {int(ExitCode.PEER_LOST)} matching FailJob rule" in failure.message, failure
        assert f"-workers-0-{victim} " not in failure.message, failure
    else:
        assert failure.reason == "BackoffLimitExceeded", sup.snapshot.jobs


@pytest.mark.parametrize("scenario", ["kill-worker", "restart-worker", "freeze-worker"])
def test_worker_failures_recover_bit_identically(e2e_workflow, reference, scenario):
    res, store, out = _run(e2e_workflow, reference, scenario, [f"{scenario}@8"])
    _assert_recovered(res, out, store=store)
    assert res.incidents[0].scenario == scenario
    assert res.incidents[0].failure_class in (FailureClass.INFRASTRUCTURE, FailureClass.HANG)
    _assert_restores_were_good(store, [])
    if scenario == "kill-worker":
        _assert_as_the_real_controller(res, scenario, out)
    # classify-failure read the slice as the supervisor saw it before its stop: the failed worker named, its pod
    # with it (its peers' pods too, unless the Job controller deleted them on the Job's failure before the view).
    sup = SupervisionRecord.model_validate(store.read_json(RunLayout.supervision(0)))
    assert sup.snapshot is not None and sup.worker in {p.index for p in sup.snapshot.pods}, sup
    if scenario == "kill-worker":
        _assert_job_failed_as_the_controller_decides(sup, victim=HOSTS - 1)
    # The next attempt compiled its step beside the restore, and its first step used that executable.
    inc = res.incidents[0]
    assert inc.compile_seconds is not None and 0 < inc.compile_overlap_seconds <= inc.compile_seconds, inc
    reports = [store.read_json(RunLayout.worker_report(1, i)) for i in range(HOSTS)]
    assert all(r["compile_seconds"] is not None for r in reports), reports


def test_preempt_loses_no_step(job):
    res, store, out = _run(*job, "preempt", ["preempt@8"])
    _assert_recovered(res, out, max_lost=0)
    _assert_as_the_real_controller(res, "preempt", out)
    assert res.incidents[0].failure_class == FailureClass.PREEMPTION
    assert res.incidents[0].restored_step == res.incidents[0].pre_failure_step


def test_delete_worker_goes_through_the_api_and_is_a_graceful_preemption(e2e_workflow, reference):
    """The local run deletes the last worker's pod through its cluster's API with the drill's own call: the kubelet
    SIGTERMs the worker, the gang agrees on the stop and exits 143 after its save; the pod goes, the Job counts its
    end, classify-failure reads it from the Job's failure and the run recovers."""
    # Early: a SIGTERM is a graceful stop, and one that lands after the 20th step's dispatch is no stop at all.
    res, store, out = _run(e2e_workflow, reference, "delete-worker", ["delete-worker@4"])
    _assert_recovered(res, out, store=store)
    assert f"inject: deleted worker pod delete-worker-a0-workers-0-{HOSTS - 1} through the API at step" in out, out
    inc = res.incidents[0]
    assert (inc.scenario, inc.failure_class) == ("delete-worker", FailureClass.PREEMPTION), inc
    # The gang agrees on the stop: every worker saves and exits 143, whichever the Job controller saw first.
    failure = _supervision(store, 0).snapshot.jobs[0].failure()
    assert failure is not None and f"failed with exit code {int(ExitCode.PREEMPTED)}" in (failure.message or "")


def test_drain_node_evicts_through_the_api_and_the_next_gang_runs_on_the_spare_pool_at_level_two(
    e2e_workflow, reference
):
    """The drill's own drain on the local API: the victim's node cordoned, its pod evicted (DisruptionTarget, then a
    graceful delete: SIGTERM); the Job fails by its podFailurePolicy and the run recovers from a preemption. The
    cluster has a spare node pool: the next gang prefers any pool but the drained one's (level 2) and runs there."""
    res, store, out = _run(e2e_workflow, reference, "drain-node", ["drain-node@4"], node_pools=2)
    _assert_recovered(res, out, store=store)
    assert f"inject: drained node local-{HOSTS - 1} (cordoned; the run's pods on it evicted) through the API" in out
    inc = res.incidents[0]
    assert (inc.scenario, inc.failure_class) == ("drain-node", FailureClass.PREEMPTION), inc
    first, second = _supervision(store, 0), _supervision(store, 1)
    assert {(n.name, n.pool) for n in first.snapshot.nodes} == {(f"local-{i}", "local-a") for i in range(HOSTS)}
    assert (second.placement or "").startswith("level 2: ") and "node pool local-a" in second.placement, second
    assert {(p.node, n.pool) for p in second.snapshot.pods for n in second.snapshot.nodes if n.name == p.node} == {
        (f"local-b-{i}", "local-b") for i in range(HOSTS)
    }, second.snapshot


def test_corrupt_latest_falls_back_to_an_older_checkpoint(job):
    res, store, out = _run(*job, "corrupt", ["kill-worker@12", "corrupt-latest"])
    assert res.status == "Succeeded", out
    assert res.params_match is True
    damaged = res.corrupted
    assert damaged, out
    bad_step = int(damaged[0].split("/")[1])
    assert res.incidents[0].restored_step < bad_step
    assert store.children(RunLayout.QUARANTINE), "the damaged checkpoint is quarantined"
    _assert_restores_were_good(store, damaged)


def test_kill_during_save_never_restores_the_partial_step(e2e_workflow, reference):
    res, store, out = _run(e2e_workflow, reference, "kds", [f"kill-during-save@{2 * INTERVAL}"])
    _assert_recovered(res, out, store=store)
    assert res.incidents[0].restored_step < 2 * INTERVAL
    _assert_restores_were_good(store, [])


def test_app_bug_ends_failed_with_application_class_within_budget(e2e_workflow, reference):
    res, store, out = _run(e2e_workflow, reference, "appbug", ["app-bug@7"])
    assert res.status == "Failed", out
    assert res.exit_code == 1
    by_class = res.ledger.by_class()
    assert by_class["application"] == 2  # budget 1: one retry, then stop
    _assert_as_the_real_controller(res, "app-bug", out)
    assert all(i.failure_class == FailureClass.APPLICATION for i in res.incidents)
    assert "application" in (res.ledger.final_reason or "").lower() or "application" in out


def test_delete_workflow_leaves_the_gang_training_and_the_workflow_submitted_again_reattaches(e2e_workflow, reference):
    """As on a cluster (tests/k8s/test_drill_trainers.py): the Workflow's steps stop with no exit handler, the gang it
    does not own trains on to its last step, and the Workflow submitted again takes the lease and finds it: no
    failure, the undisturbed run's parameters."""
    res, store, out = _run(e2e_workflow, reference, "deleted", ["delete-workflow@9"])
    assert res.restarts == 1, out
    assert (res.status, res.params_match, any(res.ledger.by_class().values())) == ("Succeeded", True, False), out
    # The first gang was never stopped: every worker of attempt 0 trained to the end and exited 0.
    reports = [store.read_json(RunLayout.worker_report(0, i)) for i in range(HOSTS)]
    assert all((r["exit_code"], r["last_step"]) == (0, 20) for r in reports), reports
    # The second supervisor re-attached to it or, in a run this short, found it done: attempt 0 was never failed.
    assert all(a.outcome != "failed" for a in res.ledger.attempts), res.ledger


def _supervision(store: RunStore, attempt: int):
    from jaxrec.model.records import SupervisionRecord

    return SupervisionRecord.model_validate(store.read_json(RunLayout.supervision(attempt)))


def test_stuck_pending_is_a_capacity_stall_and_the_next_attempt_trains(e2e_workflow, reference):
    res, store, out = _run(e2e_workflow, reference, "pending", ["stuck-pending"])
    assert res.status == "Succeeded" and res.params_match is True, out
    rec = _supervision(store, 0)
    assert (rec.outcome, rec.stall_kind) == ("stalled", "capacity"), rec
    assert rec.workers[-1].scheduled_at is None and rec.workers[0].started_at is not None
    assert res.ledger.by_class()["capacity"] == 1
    inc = res.incidents[0]
    assert inc.failure_class == FailureClass.CAPACITY and inc.detected_at == rec.detected_at
    assert inc.stopped_at >= inc.detected_at


def test_image_pull_is_a_configuration_stall_and_the_run_stops(e2e_workflow, reference):
    res, store, out = _run(e2e_workflow, reference, "imagepull", ["image-pull"])
    assert res.status == "Failed", out
    rec = _supervision(store, 0)
    assert (rec.outcome, rec.stall_kind) == ("stalled", "configuration") and "ImagePullBackOff" in rec.reason
    assert res.ledger.by_class()["configuration"] == 1
    assert "configuration" in (res.ledger.final_reason or "").lower() or "configuration" in out


def test_node_lost_is_stopped_force_deleted_and_recovered(e2e_workflow, reference):
    res, store, out = _run(e2e_workflow, reference, "nodelost", ["node-lost@8"])
    _assert_recovered(res, out, store=store)
    rec = _supervision(store, 0)
    assert (rec.outcome, rec.stall_kind) == ("stalled", "node-lost"), rec
    assert len(rec.force_deleted) == 1 and rec.force_deleted[0].endswith(f"-workers-0-{HOSTS - 1}"), rec.force_deleted
    assert res.incidents[0].failure_class == FailureClass.INFRASTRUCTURE
    _assert_restores_were_good(store, [])


def test_silent_hang_is_found_by_the_supervisor_alone(e2e_workflow, reference):
    res, store, out = _run(e2e_workflow, reference, "silenthang", ["silent-hang@8"])
    _assert_recovered(res, out, store=store)
    rec = _supervision(store, 0)
    assert (rec.outcome, rec.stall_kind) == ("stalled", "hang") and "no progress past step" in rec.reason, rec
    assert res.incidents[0].failure_class == FailureClass.HANG
    reports = [store.read_json(RunLayout.worker_report(0, i)) for i in range(HOSTS)]
    assert not any(r and r["exit_code"] == 21 for r in reports), "the in-process watchdog was off"


def test_supervisor_lost_reattaches_and_loses_nothing(e2e_workflow, reference):
    from jaxrec.model.records import EventKind
    from workflows.report import load_events

    res, store, out = _run(e2e_workflow, reference, "suplost", ["supervisor-lost@8"])
    assert res.status == "Succeeded" and res.params_match is True, out
    assert not res.incidents and all(n == 0 for n in res.ledger.by_class().values()), out
    sup = _supervision(store, 0)
    # The retried supervisor re-attached to the running gang, and its record says so (as on GKE).
    assert sup.outcome == "succeeded" and sup.reattached, sup
    started = [e for e in load_events(store) if e.event == EventKind.STARTED and e.attempt == 0]
    assert len(started) == HOSTS, "one gang: the retried supervisor did not start a second one"
    # Argo's rule for a vanished pod (workflows.local.executor.RECENTLY_STARTED_POD_S): created again for the same
    # node in the node's first 10 s, else the node is Error "pod deleted" and retried. Which one ran depends on how
    # fast the gang reached the step and how soon the supervisor saw the loss (its next observation, later under
    # load); each must look as it does on the real controller.
    segments = [n for n, _ in res.nodes if n.template == "train-segment"]
    lost_after = res.fired[0].at - segments[0].started_at
    logs = "\n".join(p.read_text() for p in (res.work_dir / "logs").glob("*-train-segment.log"))
    recreated = "its pod is created again" in logs
    if recreated:  # seen within 10 s of the step's start (just after the node's), so lost before that too
        assert lost_after <= RECENTLY_STARTED_POD_S + 1 and len(segments) == 1, (lost_after, out)
    else:
        assert "train-segment (retry 1)" in out, (lost_after, out)
    _assert_as_the_real_controller(res, "supervisor-lost", out, recreated=recreated)


def test_a_workflow_past_its_attempts_hands_the_run_to_a_continuation(tmp_path, reference):
    """After retry.attempts_per_workflow attempts the next one runs in a continuation Workflow of the run id."""
    from jaxrec.model.contract import Decision
    from jaxrec.model.records import Ledger, RunLease

    root = str(tmp_path / "store")
    wf = shrunken_workflow(tmp_path, "e2e", store_root=root, retry_section={"attempts_per_workflow": 1})
    lines: list[str] = []
    res = local.run(
        wf,
        local.LocalRunOptions(
            inject=["kill-worker@12"],
            run_id="handover",
            store_root=root,
            reference_digest=reference,
            metrics_port=None,
            report=False,
        ),
        say=lines.append,
    )
    out = "\n".join(lines)
    assert res.status == "Succeeded" and res.params_match is True, out
    assert res.workflows == ["handover", "handover-c1"], out
    store = RunStore(root, "handover")
    led = store.read_record(RunLayout.LEDGER, Ledger)
    (h,) = led.hand_overs
    assert (h.from_workflow, h.to_workflow, h.next_attempt, h.backend) == ("handover", "handover-c1", 1, "local")
    first, second = led.attempts
    assert (first.attempt, first.workflow, first.decision) == (0, "handover", Decision.HAND_OVER)
    assert (second.attempt, second.outcome, second.workflow) == (1, "succeeded", "handover-c1")
    assert led.final_status == "Succeeded"
    # The continuation held the run from the hand-over on, and its exit handler released it.
    held = store.read_record(RunLayout.LEASE, RunLease)
    assert (held.holder, held.holder_name, held.released) == (h.to_uid, "handover-c1", True)
    assert "handed the run over: workflow handover-c1 continues from attempt 1" in out


def test_a_killed_trainer_on_a_healthy_gang_restarts_in_place_at_level_zero(tmp_path, reference):
    """With restarts in place allowed, kill-worker SIGKILLs one worker's trainer (its agent lives on): the supervisor
    closes attempt 0 at level 0 and restarts every trainer in its pod as attempt 1; the JobSet is never recreated,
    and the run ends with the uninterrupted run's parameters."""
    root = str(tmp_path / "store")
    wf = shrunken_workflow(tmp_path, "e2e", store_root=root, retry_section={"in_place_budget": 2})
    res, store, out = _run((wf, root), reference, "in-place", ["kill-worker@8"])
    _assert_recovered(res, out, store=store)
    ledger = store.read_record(RunLayout.LEDGER, Ledger)
    first = ledger.attempts[0]
    assert (first.failure_class, first.level, first.jobset) == (FailureClass.INFRASTRUCTURE, 0, "in-place-a0"), first
    sup = SupervisionRecord.model_validate(store.read_json(RunLayout.supervision(1)))
    assert sup.jobset == "in-place-a0" and (sup.placement or "").startswith("level 0: "), sup
    assert "train-segment" in out and "[attempt 1]" not in out, out  # one segment: no step pod of the full path ran
    assert res.incidents[0].scenario == "kill-worker" and res.incidents[0].restored_step is not None


def test_a_second_kill_with_the_restarts_in_place_spent_recreates_the_gang_at_level_one(tmp_path, reference):
    """One restart in place allowed: the first kill restarts the trainers in their pods (level 0), the second,
    in the restarted attempt, finds the budget spent and goes the full way round (a new JobSet, level 1)."""
    root = str(tmp_path / "store")
    wf = shrunken_workflow(tmp_path, "e2e", store_root=root, retry_section={"in_place_budget": 1})
    res, store, out = _run((wf, root), reference, "escalate", ["kill-worker@8", "kill-worker@14"])
    _assert_recovered(res, out, store=store)
    ledger = store.read_record(RunLayout.LEDGER, Ledger)
    assert [(a.attempt, a.level, a.jobset) for a in ledger.attempts[:2]] == [
        (0, 0, "escalate-a0"),
        (1, None, "escalate-a0"),
    ], ledger.attempts
    assert all(a.failure_class == FailureClass.INFRASTRUCTURE for a in ledger.attempts[:2])
    last = SupervisionRecord.model_validate(store.read_json(RunLayout.supervision(2)))
    assert last.jobset == "escalate-a2" and last.outcome == "succeeded", last
    order = store.read_record(RunLayout.restart_order(0), RestartOrder)
    assert (order.action, order.attempt) == (AgentAction.EXIT, 1) and "in_place_budget" in order.reason, order
    assert len(res.incidents) == 2, out
