"""The hand-over to a continuation Workflow: decided by the budgets, done through Argo's API, rehearsed locally."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.fake_k8s import FakeCluster, status
from support.provision_api import store_config as _store_config

from jaxrec.adapters.kube import make_api_client
from jaxrec.adapters.store import AttemptRef, RunLayout, RunStore
from jaxrec.model.config import RetryConfig
from jaxrec.model.contract import Decision, ExitCode, FailureClass
from jaxrec.model.names import continuation_name
from jaxrec.model.outputs import FinalizeOutputs, HandOverOutputs
from jaxrec.model.records import AttemptRecord, Ledger, RunLease
from recovery_steps import finalize, hand_over, lease
from recovery_steps.retry import decide
from recovery_steps.step import StepError
from workflows.local.engine import ERROR, MAX_STACK_DEPTH, WorkflowRun

P = FailureClass.PREEMPTION
# Argo nests the main DAG, then one level per attempt, then the attempt's step pods.
NESTING_AROUND_ATTEMPTS = 2


def _simulate(progress: list[bool], cfg: RetryConfig, run_id: str = "long-run"):
    """Drive failed attempts through the retry decision and the hand-over, as the workflows would run them.

    Returns the decisions, the attempts each Workflow ran, and the Workflow names in order.
    """
    ledger: list[AttemptRecord] = []
    workflow, ran = run_id + "-x7k2q", {}
    decisions, order, step = [], [workflow], 0
    for n, advanced in enumerate(progress):
        before, step = step, step + (10 if advanced else 0)
        cur = AttemptRecord(
            attempt=n,
            outcome="failed",
            failure_class=P,
            checkpoint_step_before=before,
            checkpoint_step_after=step,
            workflow=workflow,
        )
        d = decide(ledger, cur, cfg)
        ledger.append(cur)
        ran[workflow] = ran.get(workflow, 0) + 1
        decisions.append(d)
        if d.decision is Decision.STOP:
            break
        if d.decision is Decision.HAND_OVER:
            workflow = continuation_name(run_id, n + 1)
            order.append(workflow)
    return decisions, ran, order


def test_300_preemptions_with_progress_hand_over_and_keep_going():
    cfg = RetryConfig()
    decisions, ran, order = _simulate([True] * 300, cfg)
    assert len(decisions) == 300 and all(d.decision is not Decision.STOP for d in decisions)
    # Every Workflow stays far inside Argo's nesting limit; the run needs ten of them.
    assert max(ran.values()) == cfg.attempts_per_workflow == 30
    assert max(ran.values()) + NESTING_AROUND_ATTEMPTS < MAX_STACK_DEPTH
    assert len(order) == 11 and order[1] == "long-run-c30" and order[-1] == "long-run-c300"
    hand_overs = [i for i, d in enumerate(decisions) if d.decision is Decision.HAND_OVER]
    assert hand_overs == list(range(29, 300, 30))
    assert "in a continuation Workflow (30 attempts ran in long-run-x7k2q" in decisions[29].reason
    # Budgets run across Workflows: the preemption count is the run's, and the backoff keeps its place.
    assert decisions[-1].attempts_by_class["preemption"] == 300


def test_300_preemptions_without_progress_stop_at_the_preemption_budget_in_the_first_workflow():
    # Preemptions are exempt from the no-progress guard (a Spot storm is not a loop); the budget, counted since
    # the last progress, stops them.
    cfg = RetryConfig()
    decisions, ran, order = _simulate([False] * 300, cfg)
    assert decisions[-1].decision is Decision.STOP and "no progress" not in decisions[-1].reason
    assert len(decisions) == cfg.budget(P) + 1 and order == ["long-run-x7k2q"]


def test_an_attempt_with_no_workflow_name_never_hands_over():
    cfg = RetryConfig(attempts_per_workflow=1)
    cur = AttemptRecord(
        attempt=0, outcome="failed", failure_class=P, checkpoint_step_before=-1, checkpoint_step_after=10
    )
    assert decide([], cur, cfg).decision is Decision.RETRY
    assert decide([], cur.model_copy(update={"workflow": "w"}), cfg).decision is Decision.HAND_OVER


def test_attempts_per_workflow_is_bounded_below_the_nesting_limit():
    from jaxrec.model.config import ConfigError, parse_config

    for too_many in (49, 200):  # the 49th attempt's pods would be Argo's 100th nested call
        with pytest.raises(ConfigError) as e:
            parse_config({"run_id": "r", "retry": {"attempts_per_workflow": too_many}}, "cfg.yaml")
        assert any("retry.attempts_per_workflow" in p and "48" in p for p in e.value.problems)
    with pytest.raises(ConfigError) as e:  # 48 is accepted: what is refused is the missing sections only
        parse_config({"run_id": "r", "retry": {"attempts_per_workflow": 48}}, "cfg.yaml")
    assert not any("retry" in p for p in e.value.problems), e.value.problems


# --- the GKE path, against the Argo API faked at its HTTP boundary ------------------------------------------


def _running_workflow(name: str, uid: str, run_id: str) -> dict:
    """A Workflow object as the API server returns it while it runs."""
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "generateName": f"{run_id}-",
            "namespace": "training",
            "uid": uid,
            "resourceVersion": "81234",
            "generation": 41,
            "creationTimestamp": "2026-11-02T08:00:00Z",
            "labels": {
                "jaxrec/run-id": run_id,
                "workflows.argoproj.io/phase": "Running",
                "workflows.argoproj.io/resubmitted-from-workflow": "old",
            },
            "annotations": {"workflows.argoproj.io/pod-name-format": "v2", "team": "ml-infra"},
            "managedFields": [{"manager": "workflow-controller", "operation": "Update"}],
        },
        "spec": {
            "entrypoint": "main",
            "onExit": "exit-handler",
            "serviceAccountName": "jax-recovery",
            "arguments": {
                "parameters": [
                    {"name": "run-id", "value": run_id},
                    {"name": "store-root", "value": "gs://bucket/jaxrec"},
                ]
            },
            "synchronization": {"mutexes": [{"name": f"jaxrec-run-{run_id}"}]},
            "templates": [{"name": "main", "dag": {"tasks": []}}],
            "shutdown": "Stop",
        },
        "status": {"phase": "Running", "startedAt": "2026-11-02T08:00:01Z", "nodes": {"x": {"phase": "Running"}}},
    }


@pytest.fixture
def gke_run(tmp_path):
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    store = RunStore(root, run_id)
    lease.acquire(store, lease.Claimant("uid-a", "wf-a", lease.Site("training", "kube-system-uid")), 3600)
    argo = FakeCluster()
    argo.put("workflows", _running_workflow("wf-a", "uid-a", run_id))
    yield root, run_id, store, argo
    argo.close()


def _hand_over(root, run_id, argo, out, attempt=30):
    return hand_over.run(
        AttemptRef(root, run_id, attempt),
        lease.Claimant("uid-a", "wf-a"),
        out,
        api_client=make_api_client(argo.url),
    )


def test_gke_hand_over_creates_the_continuation_passes_the_lease_and_records_it(gke_run, tmp_path):
    root, run_id, store, argo = gke_run
    to = _hand_over(root, run_id, argo, tmp_path / "out")
    name = continuation_name(run_id, 30)
    assert to.name == name and to.uid == argo.workflows[name]["metadata"]["uid"]
    (posted,) = [b for m, _, b in argo.requests if m == "POST"]
    meta, spec = posted["metadata"], posted["spec"]
    # The run's own spec (arguments, mutex, exit handler), never the stop that a live Workflow may carry.
    own = _running_workflow("wf-a", "uid-a", run_id)["spec"]
    assert spec == {k: v for k, v in own.items() if k != "shutdown"}
    assert meta["labels"] == {"jaxrec/run-id": run_id, "jaxrec/continues": "wf-a"}
    notes = meta["annotations"]
    assert notes["team"] == "ml-infra" and "workflows.argoproj.io/pod-name-format" not in notes
    assert meta["annotations"]["workflows.argoproj.io/title"] == f"{run_id} from attempt 30"
    assert "[wf-a](/workflows/training/wf-a)" in meta["annotations"]["workflows.argoproj.io/description"]
    assert set(meta) == {"name", "namespace", "labels", "annotations"}
    # The lease is the continuation's: this Workflow's exit handler leaves the ledger alone. The continuation runs
    # where this Workflow runs, so a later submission can still ask whether it is alive.
    held = store.read_record(RunLayout.LEASE, RunLease)
    assert (held.holder, held.holder_name, held.released) == (to.uid, name, False)
    assert (held.namespace, held.cluster) == ("training", "kube-system-uid")
    (h,) = store.read_record(RunLayout.LEDGER, Ledger).hand_overs
    assert (h.from_workflow, h.to_workflow, h.to_uid, h.next_attempt, h.backend) == ("wf-a", name, to.uid, 30, "gke")
    assert HandOverOutputs.read(tmp_path / "out") == HandOverOutputs(continuation=name, continuation_uid=to.uid)


def test_a_retried_hand_over_finds_its_continuation_and_records_it_once(gke_run, tmp_path):
    root, run_id, store, argo = gke_run
    first = _hand_over(root, run_id, argo, None)
    again = _hand_over(root, run_id, argo, None)
    assert again == first
    assert [m for m, _, _ in argo.requests].count("POST") == 2 and len(argo.workflows) == 2
    assert len(store.read_record(RunLayout.LEDGER, Ledger).hand_overs) == 1


def test_a_name_taken_by_another_workflow_is_a_configuration_error(gke_run, capsys):
    root, run_id, store, argo = gke_run
    name = continuation_name(run_id, 30)
    argo.put("workflows", {"metadata": {"name": name, "uid": "u-x", "labels": {"jaxrec/continues": "someone"}}})
    with pytest.raises(StepError) as e:
        _hand_over(root, run_id, argo, None)
    assert e.value.code == ExitCode.CONFIGURATION and f"argo delete {name}" in str(e.value)
    assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-a"  # nothing passed on


@pytest.mark.parametrize(
    "method, code, reason, exit_code, words",
    [
        ("POST", 403, "Forbidden", ExitCode.CONFIGURATION, "workflows get and create"),
        ("GET", 500, "InternalError", ExitCode.TRANSIENT, "500"),
        ("POST", 429, "TooManyRequests", ExitCode.TRANSIENT, "429"),
    ],
)
def test_api_refusals_name_the_fix_and_outages_are_transient(
    gke_run, tmp_path, capsys, method, code, reason, exit_code, words
):
    root, run_id, store, argo = gke_run
    argo.inject("", code, status(code, reason, f"forced {reason}"), method=method)
    with pytest.raises(StepError) as e:
        _hand_over(root, run_id, argo, None)
    assert e.value.code == exit_code and words in str(e.value) and "\n" not in str(e.value)
    assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-a"


def test_the_old_exit_handler_says_handed_over_and_the_continuation_takes_the_run(gke_run, tmp_path, capsys):
    root, run_id, store, argo = gke_run
    to = _hand_over(root, run_id, argo, None)
    out = tmp_path / "fin"
    assert (
        finalize.main(
            [
                "--store-root",
                root,
                "--run-id",
                run_id,
                "--status",
                "Succeeded",
                "--holder",
                "uid-a",
                "--output-dir",
                str(out),
            ]
        )
        == 0
    )
    assert f"continues in workflow {to.name} from attempt 30" in capsys.readouterr().out
    assert FinalizeOutputs.read(out).final_status == "HandedOver"
    led = store.read_record(RunLayout.LEDGER, Ledger)
    assert led.final_status is None  # the run has not ended
    # The continuation's validate-config renews the lease it was given (no waiting for a TTL).
    assert lease.acquire(store, lease.Claimant(to.uid, to.name), 3600).holder == to.uid
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(store, lease.Claimant("uid-a", "wf-a"), 3600)


def test_a_hand_over_by_a_workflow_that_lost_the_run_passes_nothing(gke_run):
    root, run_id, store, argo = gke_run
    lease.release(store, "uid-a")
    with pytest.raises(StepError) as e:
        _hand_over(root, run_id, argo, None)
    assert "no longer holds run" in str(e.value)
    assert store.read_record(RunLayout.LEDGER, Ledger) is None


# --- the local interpreter enforces Argo's nesting limit ---------------------------------------------------


def test_local_engine_errors_a_recursion_past_argos_limit_as_the_controller_does():
    forever = {
        "metadata": {"name": "deep"},
        "spec": {
            "entrypoint": "main",
            "templates": [
                {"name": "main", "dag": {"tasks": [{"name": "go", "template": "level"}]}},
                {"name": "level", "dag": {"tasks": [{"name": "again", "template": "level"}]}},
            ],
        },
    }
    run = WorkflowRun(forever, executor=None)
    assert run.run() == ERROR
    (failure,) = run.failures
    assert failure["phase"] == ERROR and "Maximum recursion depth exceeded" in failure["message"]
    # main (call 1), go (2) and 97 levels of "again" run: call MAX_STACK_DEPTH itself is the one refused (Argo's `>=`).
    assert failure["displayName"].count(".") == MAX_STACK_DEPTH - 1


# --- the deepest Workflow the config accepts, against Argo's rule ------------------------------------------


class _Scripted:
    """An executor over the compiled Workflow: every train-segment fails; classify-failure answers ``decisions``
    in turn (then retry); every other step succeeds. Each container's declared outputs get plausible values."""

    def __init__(self, decisions: list[str]):
        self.decisions = list(decisions)
        self.segments: list[str] = []  # the attempt of each train-segment pod run

    def run_container(self, node, template):
        from workflows.local.engine import FAILED, SUCCEEDED, NodeResult

        names = [p["name"] for p in (template.get("outputs") or {}).get("parameters", [])]
        out = dict.fromkeys(names, "0")
        if node.template == "train-segment":
            self.segments.append(node.attempt)
            return NodeResult(FAILED, out, 1, "failed")
        if node.template == "classify-failure":
            decision = self.decisions.pop(0) if self.decisions else "retry"
            out |= {"decision": decision, "next-attempt": str(int(node.attempt) + 1), "backoff-wait": "0"}
            out |= {"failure-class": "infrastructure", "reason": "scripted", "attempts-by-class": "{}"}
        if node.template == "validate-config":
            out |= {"run-id": "deep", "first-attempt": "0", "hosts": "4", "store-root": "/tmp/x", "config-hash": "h"}
        if node.template == "provision-slice":
            out |= {"jobset-name": f"deep-a{node.attempt}"}
        return NodeResult(SUCCEEDED, out, 0, "")

    def stop_all(self):
        """Nothing runs."""


@pytest.mark.parametrize("resupervised", [0, 5])
def test_the_deepest_workflow_the_config_accepts_runs_every_attempt_argo_would_and_no_more(resupervised):
    """Every classify-failure retries (none hands over): the compiled Workflow, on the local engine that nests and
    refuses as Argo's controller does, runs exactly as many attempts as ``segment_pod_depth`` says fit: 48, the
    config's most, with no supervisor re-attached; fewer with some, which the hand-over counts."""
    from jaxrec.model.config import ARGO_MAX_DEPTH, MAX_ATTEMPTS_PER_WORKFLOW, segment_pod_depth

    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "argo" / "local-cpu.yaml").read_text())
    ex = _Scripted(["resupervise"] * resupervised)
    run = WorkflowRun(doc, executor=ex, sleep=lambda _: None)
    assert run.run() in (ERROR, "Failed")
    refused = [f for f in run.failures if "Maximum recursion depth exceeded" in f.get("message", "")]
    assert refused, run.failures
    attempts = len(set(ex.segments))
    assert segment_pod_depth(attempts, resupervised) < ARGO_MAX_DEPTH <= segment_pod_depth(attempts + 1, resupervised)
    if resupervised == 0:
        assert attempts == MAX_ATTEMPTS_PER_WORKFLOW == 48
    # The hand-over comes before Argo's refusal: after the last attempt that fits, decide() hands over.
    cfg = RetryConfig(attempts_per_workflow=MAX_ATTEMPTS_PER_WORKFLOW)
    ledger = [_attempt(n, "wf-1") for n in range(attempts - 1)]
    d = decide(ledger, _attempt(attempts - 1, "wf-1"), cfg, resupervised=resupervised)
    assert d.decision is Decision.HAND_OVER, d.reason
    if attempts > 1:
        d = decide(ledger[:-1], _attempt(attempts - 2, "wf-1"), cfg, resupervised=resupervised)
        assert d.decision is Decision.RETRY, d.reason


def _attempt(n: int, workflow: str) -> AttemptRecord:
    return AttemptRecord(
        attempt=n,
        outcome="failed",
        failure_class=P,
        reason="preempted",
        checkpoint_step_before=n * 10,
        checkpoint_step_after=(n + 1) * 10,
        workflow=workflow,
    )
