"""The compiled Workflow's wiring: the DAG, retries, conditions, metrics and the JobSet of each config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from support.segment import segment_jobset

from jaxrec.model.config import load_config
from jaxrec.model.contract import trainer_exit_codes
from jaxrec.model.metrics import BY_NAME
from jaxrec.model.tpu import TPU_TYPES
from workflows.templates import build_workflow

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _wf(name: str) -> dict:
    return build_workflow(load_config(REPO / "configs" / name)).to_dict()


def _templates(wf: dict) -> dict[str, dict]:
    return {t["name"]: t for t in wf["spec"]["templates"]}


def _tasks(tpl: dict) -> dict[str, dict]:
    return {t["name"]: t for t in tpl["dag"]["tasks"]}


def _jobset(wf: dict) -> dict:
    """The JobSet train-segment renders from the pinned config, with the Argo placeholders its arguments carry."""
    return segment_jobset(wf)


SEGMENT_ARGS_MAX = 512
"""Bytes the train-segment template's arguments may take (JSON): its node in the Argo UI shows them (they were
about 3 KB while they carried the rendered JobSet)."""


@pytest.mark.parametrize("cfg_path", CONFIGS, ids=lambda p: p.stem)
def test_the_train_segment_node_carries_the_attempts_parameters_not_the_jobset(cfg_path):
    wf = build_workflow(load_config(cfg_path)).to_dict()
    args = _templates(wf)["train-segment"]["container"]["args"]
    assert "--jobset-manifest" not in args and not any("JobSet" in a or a.startswith('{"') for a in args)
    assert len(json.dumps(args, separators=(",", ":"))) <= SEGMENT_ARGS_MAX
    values = dict(zip(args[::2], args[1::2], strict=False))
    for name in ("jobset-name", "restore-step", "coordinator-port", "metrics-port"):
        assert values[f"--{name}"] == f"{{{{inputs.parameters.{name}}}}}"


@pytest.fixture(scope="module")
def local():
    return _wf("local-cpu.yaml")


@pytest.fixture(scope="module")
def v5e():
    return _wf("v5e-4x4.yaml")


def test_main_dag_validates_then_starts_the_first_free_attempt(local):
    spec = local["spec"]
    assert spec["entrypoint"] == "main" and spec["onExit"] == "exit-handler"
    tasks = _tasks(_templates(local)["main"])
    assert set(tasks) == {"validate-config", "attempt"}
    assert tasks["attempt"]["template"] == "attempt"
    assert tasks["attempt"]["depends"] == "validate-config"
    first = "{{tasks.validate-config.outputs.parameters.first-attempt}}"
    assert tasks["attempt"]["arguments"]["parameters"] == [{"name": "attempt", "value": first}]
    assert {p["name"] for p in spec["arguments"]["parameters"]} == {"store-root", "run-id", "accept-safe-changes"}
    assert local["metadata"]["labels"] == {"jaxrec/run-id": "local-cpu"}


def _routes(tasks, resupervise: bool):
    decision = "'{{tasks.classify-failure.outputs.parameters.decision}}'"
    assert tasks["backoff"]["when"] == f"{decision} == 'retry' || {decision} == 'hand-over'"
    assert tasks["next-attempt"]["when"] == f"{decision} == 'retry'"
    assert tasks["next-attempt"]["depends"] == "backoff"
    assert tasks["give-up"]["when"] == f"{decision} == 'stop'"
    # After retry.attempts_per_workflow attempts the retry runs in a continuation Workflow instead of nesting.
    assert tasks["hand-over"]["when"] == f"{decision} == 'hand-over'"
    assert tasks["hand-over"]["depends"] == "backoff"
    assert tasks["hand-over"]["template"] == "hand-over"
    assert tasks["hand-over"]["arguments"]["parameters"] == [
        {"name": "attempt", "value": "{{tasks.classify-failure.outputs.parameters.next-attempt}}"}
    ]
    # Recursion: the next attempt is the same template with the number classify-failure computed.
    assert tasks["next-attempt"]["template"] == "attempt"
    assert tasks["next-attempt"]["arguments"]["parameters"] == [
        {"name": "attempt", "value": "{{tasks.classify-failure.outputs.parameters.next-attempt}}"}
    ]
    assert tasks["backoff"]["arguments"]["parameters"][0]["value"].endswith(".backoff-wait}}")
    assert ("resupervise" in tasks) == resupervise
    if resupervise:
        # A gang that lost its supervisor gets another one for the same attempt, with the same inputs.
        assert tasks["resupervise"]["when"] == f"{decision} == 'resupervise'"
        assert tasks["resupervise"]["template"] == "segment"
        assert [p["value"] for p in tasks["resupervise"]["arguments"]["parameters"]] == [
            f"{{{{inputs.parameters.{n}}}}}"
            for n in ("attempt", "jobset-name", "restore-step", "coordinator-port", "metrics-port")
        ]


def test_attempt_dag_order_and_branches(local):
    templates = _templates(local)
    tasks = _tasks(templates["attempt"])
    # The old gang is torn down (provision-slice) before restore-latest chooses the step.
    assert tasks["restore-latest"]["depends"] == "provision-slice"
    assert "depends" not in tasks["provision-slice"]
    assert tasks["segment"]["depends"] == "restore-latest" and tasks["segment"]["template"] == "segment"
    # A step before training that spent its retries is classified and decided like a failed gang.
    assert tasks["classify-failure"]["depends"] == (
        "provision-slice.Failed || provision-slice.Errored || restore-latest.Failed || restore-latest.Errored"
    )
    _routes(tasks, resupervise=False)
    seg = _tasks(templates["segment"])
    assert "depends" not in seg["train-segment"]
    assert seg["classify-failure"]["depends"] == "train-segment.Failed || train-segment.Errored"
    assert seg["classify-failure"]["arguments"]["parameters"][1]["value"] == "{{inputs.parameters.jobset-name}}"
    _routes(seg, resupervise=True)
    args = templates["hand-over"]["container"]["args"]
    assert args[args.index("--workflow") + 1] == "{{workflow.name}}"
    assert args[args.index("--workflow-uid") + 1] == "{{workflow.uid}}"
    classify = templates["classify-failure"]["container"]["args"]
    assert classify[classify.index("--workflow") + 1] == "{{workflow.name}}"
    assert templates["backoff"]["suspend"]["duration"] == "{{inputs.parameters.duration}}"


@pytest.mark.parametrize("cfg_path", CONFIGS, ids=lambda p: p.stem)
def test_every_when_quotes_its_strings_and_every_retry_has_a_limit(cfg_path):
    wf = build_workflow(load_config(cfg_path)).to_dict()
    for tpl in wf["spec"]["templates"]:
        for task in tpl.get("dag", {}).get("tasks", []):
            if "when" in task:
                one = r"'\{\{[^}]+\}\}' == '[a-z-]+'"
                assert re.fullmatch(f"{one}( \\|\\| {one})*", task["when"]), task["when"]
        if "retryStrategy" in tpl:
            assert isinstance(tpl["retryStrategy"]["limit"], int), tpl["name"]


def test_provision_retries_capacity_only(local):
    cfg = load_config(REPO / "configs" / "local-cpu.yaml")
    rs = _templates(local)["provision-slice"]["retryStrategy"]
    assert rs["limit"] == cfg.retry.provision_retry_limit
    # Capacity (75) is retried; configuration (2) is not. Errored pods and transient exits are retried too.
    assert _retried(rs, "75") and not _retried(rs, "2")
    assert _retried(rs, "69") and _retried(rs, "-1", "Error")
    assert rs["backoff"]["duration"] == f"{cfg.retry.provision_backoff_s}s"


def _retried(rs, code: str, status: str = "Failed") -> bool:
    from workflows.local.expr import evaluate_bool

    env = {
        "lastRetry.exitCode": code,
        "lastRetry.status": status,
        "lastRetry.duration": "1",
        "lastRetry.message": "",
        "retries": "0",
    }
    return rs["retryPolicy"] == "Always" and evaluate_bool(rs["expression"], env)


@pytest.mark.parametrize("cfg_path", CONFIGS, ids=lambda p: p.stem)
def test_every_step_retries_errored_pods_and_transient_exits_only(cfg_path):
    cfg = load_config(cfg_path)
    t = _templates(build_workflow(cfg).to_dict())
    steps = [n for n, tpl in t.items() if "container" in tpl and n != "train-segment"]
    assert set(steps) >= {
        "validate-config",
        "restore-latest",
        "provision-slice",
        "classify-failure",
        "give-up",
        "exit-handler",
    }
    for name in steps:
        rs = t[name]["retryStrategy"]
        assert isinstance(rs["limit"], int) and rs["limit"] >= 1, name
        # A vanished pod (Error, -1), an evicted, drained or OOM-killed one (Failed, 143 or 137), a transient exit.
        assert _retried(rs, "-1", "Error") and _retried(rs, "69"), name
        assert _retried(rs, "137") and _retried(rs, "143"), name
        for code in ("1", "2", "3", "42"):
            assert not _retried(rs, code), (name, code)
        # Never maxDuration: Argo counts it from the first try and makes it the retry's deadline.
        assert "maxDuration" not in rs["backoff"] and rs["backoff"]["cap"], name
        if name != "provision-slice":
            assert rs["limit"] == cfg.retry.transient_retry_limit, name
            assert rs["backoff"]["duration"] == f"{cfg.retry.transient_backoff_s}s", name


@pytest.mark.parametrize("cfg_path", CONFIGS, ids=lambda p: p.stem)
def test_the_supervisor_is_retried_however_its_pod_dies_and_never_on_its_verdicts(cfg_path):
    rs = _templates(build_workflow(load_config(cfg_path)).to_dict())["train-segment"]["retryStrategy"]
    for code, status in (("-1", "Error"), ("-1", "Failed"), ("137", "Failed"), ("143", "Failed"), ("69", "Failed")):
        assert _retried(rs, code, status), (code, status)
    assert not _retried(rs, "1") and not _retried(rs, "2")
    assert "maxDuration" not in rs["backoff"] and rs["limit"] >= 10


def test_steps_run_their_module_with_contract_args(local):
    t = _templates(local)
    for name, module in [
        ("validate-config", "validate_config"),
        ("restore-latest", "restore_latest"),
        ("provision-slice", "provision_slice"),
        ("classify-failure", "classify_failure"),
        ("exit-handler", "finalize"),
    ]:
        c = t[name]["container"]
        assert c["command"] == ["python", "-m", f"recovery_steps.{module}"]
        assert c["args"][-2:] == ["--output-dir", "/tmp/outputs"]
        for out in t[name]["outputs"]["parameters"]:
            assert out["valueFrom"]["path"] == f"/tmp/outputs/{out['name']}"
    assert t["give-up"]["container"]["args"] == [
        "--failure-class",
        "{{inputs.parameters.failure-class}}",
        "--reason",
        "{{inputs.parameters.reason}}",
        "--store-root",
        "{{workflow.parameters.store-root}}",
        "--run-id",
        "{{workflow.parameters.run-id}}",
        "--holder",
        "{{workflow.uid}}",
        "--workflow",
        "{{workflow.name}}",
        "--namespace",
        local["metadata"]["namespace"],
    ]
    assert {o["name"] for o in t["classify-failure"]["outputs"]["parameters"]} >= {
        "failure-class",
        "decision",
        "reason",
        "backoff-seconds",
        "next-attempt",
    }
    exit_args = t["exit-handler"]["container"]["args"]
    assert exit_args[exit_args.index("--status") + 1] == "{{workflow.status}}"
    assert exit_args[exit_args.index("--failures") + 1] == "{{workflow.failures}}"
    assert t["validate-config"]["container"]["args"][:4] == [
        "--config",
        "/tmp/inputs/config.yaml",
        "--store-root",
        "{{workflow.parameters.store-root}}",
    ]
    (art,) = t["validate-config"]["inputs"]["artifacts"]
    assert art["path"] == "/tmp/inputs/config.yaml"
    assert yaml.safe_load(art["raw"]["data"])["run_id"] == "local-cpu"


def test_template_metrics_use_the_metric_table(local):
    t = _templates(local)
    names = {
        tpl_name: [m["name"] for m in t[tpl_name].get("metrics", {}).get("prometheus", [])]
        for tpl_name in ("attempt", "classify-failure", "exit-handler")
    }
    assert names == {
        "attempt": ["jaxrec_attempts_total"],
        "classify-failure": ["jaxrec_failures_total", "jaxrec_last_failure_info", "jaxrec_budget_exhausted"],
        "exit-handler": ["jaxrec_run_status", "jaxrec_steps_lost_total", "jaxrec_recovery_duration_seconds"],
    }
    for tpl_names in names.values():
        for n in tpl_names:
            assert n in BY_NAME
    failures = t["classify-failure"]["metrics"]["prometheus"][0]
    assert {"key": "class", "value": "{{outputs.parameters.failure-class}}"} in failures["labels"]
    exhausted = t["classify-failure"]["metrics"]["prometheus"][2]
    assert exhausted["when"] == "{{outputs.parameters.budget-exhausted}} == 1"
    assert ("budget-exhausted", "/tmp/outputs/budget-exhausted") in [
        (p["name"], p["valueFrom"]["path"]) for p in t["classify-failure"]["outputs"]["parameters"]
    ]
    lost, recovery = t["exit-handler"]["metrics"]["prometheus"][1:]
    assert lost["counter"]["value"] == "{{outputs.parameters.steps-lost}}"
    assert recovery["when"] == "{{outputs.parameters.recovery-seconds}} >= 0"
    outs = {p["name"] for p in t["exit-handler"]["outputs"]["parameters"]}
    assert {"steps-lost", "recovery-seconds"} <= outs


def test_jobset_gang_shape_on_tpu(v5e):
    js = _jobset(v5e)
    cfg = load_config(REPO / "configs" / "v5e-4x4.yaml")
    assert js["metadata"]["name"] == "{{inputs.parameters.jobset-name}}"
    assert js["metadata"]["labels"]["jaxrec/run-id"] == "{{workflow.parameters.run-id}}"
    assert js["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0}
    (rj,) = js["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4 == cfg.slice.num_hosts
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    codes = [c for r in job["podFailurePolicy"]["rules"] if "onExitCodes" in r for c in r["onExitCodes"]["values"]]
    assert sorted(codes) == sorted(trainer_exit_codes())
    assert any(
        r.get("onPodConditions") == [{"type": "DisruptionTarget", "status": "True"}]
        for r in job["podFailurePolicy"]["rules"]
    )
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["shareProcessNamespace"] is True  # the trainer is not PID 1: an exec can SIGKILL it (kill-worker)
    # Spot: the pod's grace is the 30 s notice; the trainer budgets its save on the 15 s the node gives.
    assert pod["terminationGracePeriodSeconds"] == cfg.slice.termination_grace_s == 30
    assert cfg.slice.preemption_window_s == 15
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "4x4",
        "cloud.google.com/gke-spot": "true",
    }
    (c,) = pod["containers"]
    assert c["resources"]["limits"] == {"google.com/tpu": TPU_TYPES["v5e"].chips_per_vm}
    # The example restarts in place (retry.in_place_budget 5): the agent runs the trainer with the flags after "--".
    assert cfg.retry.in_place_budget == 5
    assert c["command"] == ["python", "-m", "trainer.agent"]
    assert c["args"] == [
        "--hold-s",
        f"{cfg.retry.in_place_hold_s:g}",
        "--",
        "--store-root",
        "{{workflow.parameters.store-root}}",
        "--run-id",
        "{{workflow.parameters.run-id}}",
        "--attempt",
        "{{inputs.parameters.attempt}}",
        "--restore-step",
        "{{inputs.parameters.restore-step}}",
        "--metrics-port",
        "{{inputs.parameters.metrics-port}}",
    ]
    env = {e["name"]: e for e in c["env"]}
    assert "TRAINER_COORDINATOR_ADDRESS" not in env
    # The supervisor, not a resource condition, ends the attempt (its retry: the test above).
    train = _templates(v5e)["train-segment"]
    assert "resource" not in train
    assert train["container"]["command"] == ["python", "-m", "recovery_steps.train_segment"]
    assert train["retryStrategy"]["retryPolicy"] == "Always"
    outs = {p["name"]: p["valueFrom"]["path"] for p in train["outputs"]["parameters"]}
    names = ("outcome", "stall-kind", "reason", "last-step", "checkpoint-step", "placement", "restarted-in-place")
    assert outs == {n: f"/tmp/outputs/{n}" for n in names}


def test_reservation_selector_on_v5p():
    pod = _jobset(_wf("v5p-64.yaml"))["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/reservation-name"] == "my-v5p-reservation"
    assert "cloud.google.com/gke-spot" not in pod["nodeSelector"]
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 4}


def test_local_jobset_has_no_tpu_and_carries_the_local_env(local):
    js = _jobset(local)
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 4
    pod = job["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    grace = load_config(REPO / "configs" / "local-cpu.yaml").slice.termination_grace_s
    assert pod["terminationGracePeriodSeconds"] == grace
    (c,) = pod["containers"]
    assert "resources" not in c
    env = {e["name"]: e for e in c["env"]}
    assert env["TRAINER_COORDINATOR_ADDRESS"]["value"] == "127.0.0.1:{{inputs.parameters.coordinator-port}}"
    assert env["TRAINER_NUM_PROCESSES"]["value"] == "4"
    assert env["JAX_PLATFORMS"]["value"] == "cpu"
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert "annotations" not in js["metadata"]


@pytest.mark.parametrize("cfg_path", CONFIGS, ids=lambda p: p.stem)
def test_workflow_keeps_failed_pods_and_the_finished_run_for_inspection(cfg_path):
    cfg = load_config(cfg_path)
    wf = build_workflow(cfg).to_dict()
    assert wf["spec"]["podGC"] == {"strategy": "OnPodSuccess"}
    ttl = wf["spec"]["ttlStrategy"]
    assert ttl["secondsAfterFailure"] >= ttl["secondsAfterSuccess"] >= 7 * 24 * 3600
    # The namespace comes from the config, in the Workflow and in the JobSet it creates.
    assert wf["metadata"]["namespace"] == cfg.namespace == _jobset(wf)["metadata"]["namespace"]


def test_local_jobset_stand_in_stops_workers_after_the_manifests_grace(tmp_path):
    from jaxrec.model.jobset import JobSetParams, jobset_manifest
    from workflows.local.executor import LocalExecutor

    cfg = load_config(REPO / "configs" / "local-cpu.yaml")
    js = jobset_manifest(
        cfg,
        JobSetParams(
            name="r-a0",
            run_id="r",
            store_root=str(tmp_path),
            attempt="0",
            restore_step="-1",
            coordinator_port="1234",
            metrics_port="0",
        ),
    )
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    sl = LocalExecutor(repo_root=REPO, work_dir=tmp_path).cluster.build_slice(js)
    assert sl.grace_seconds == pod["terminationGracePeriodSeconds"] == cfg.slice.termination_grace_s
    pod["terminationGracePeriodSeconds"] = 17
    assert LocalExecutor(repo_root=REPO, work_dir=tmp_path).cluster.build_slice(js).grace_seconds == 17
    del pod["terminationGracePeriodSeconds"]  # the Kubernetes default
    assert LocalExecutor(repo_root=REPO, work_dir=tmp_path).cluster.build_slice(js).grace_seconds == 30
    # A benchmark may still pin the grace for every slice.
    pinned = LocalExecutor(repo_root=REPO, work_dir=tmp_path, grace_seconds=2).cluster
    assert pinned.build_slice(js).grace_seconds == 2


@pytest.mark.parametrize("config", [p.name for p in CONFIGS])
def test_every_output_reference_names_an_output_its_step_declares(config):
    # Read back from the compiled manifest: each {{tasks.T.outputs.parameters.P}} in a DAG names a task T of that
    # DAG whose step declares P, and each {{outputs.parameters.P}} in a template names one of its own outputs.
    from jaxrec.model.outputs import STEP_OUTPUTS

    declared = {d.TEMPLATE: set(d.names()) for d in STEP_OUTPUTS}
    wf = _wf(config)
    seen = 0
    for tpl in wf["spec"]["templates"]:
        text = yaml.safe_dump(tpl)
        tasks = _tasks(tpl) if "dag" in tpl else {}
        for task, param in re.findall(r"\{\{tasks\.([\w-]+)\.outputs\.parameters\.([\w-]+)\}\}", text):
            assert task in tasks, f"{tpl['name']}: no task {task}"
            assert param in declared.get(tasks[task]["template"], set()), f"{tpl['name']}: {task} has no {param}"
            seen += 1
        for param in re.findall(r"(?<!\.)\{\{outputs\.parameters\.([\w-]+)\}\}", text):
            assert param in declared[tpl["name"]], f"{tpl['name']}: no output {param}"
            seen += 1
    assert seen >= 20, seen  # the wiring is there to check
