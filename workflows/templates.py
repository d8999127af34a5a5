"""Hera definitions of the recovery workflow: step templates, the attempt DAG and the main DAG.

Declarative only: every decision is made by the step programs (``python -m recovery_steps.<step>``);
this module wires their outputs to the next step's inputs and to ``when`` conditions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from hera.workflows import (
    DAG,
    Container,
    Counter,
    Gauge,
    Label,
    Parameter,
    RawArtifact,
    Resources,
    RetryStrategy,
    Suspend,
    Task,
    Workflow,
)
from hera.workflows.models import Backoff, Mutex, PodGC, Synchronization, TTLStrategy, ValueFrom

from jaxrec.model.config import JobConfig
from jaxrec.model.contract import Decision, ExitCode
from jaxrec.model.metrics import spec as metric_spec
from jaxrec.model.names import ATTEMPT_LABEL, RUN_ID_LABEL, STEP_PRIORITY_CLASS, jobset_name
from jaxrec.model.outputs import (
    ClassifyOutputs,
    FinalizeOutputs,
    HandOverOutputs,
    ProvisionOutputs,
    RestoreOutputs,
    SegmentOutputs,
    StepOutputs,
    UndeclaredOutput,
    ValidateOutputs,
)

OUTPUT_DIR = "/tmp/outputs"
CONFIG_PATH = "/tmp/inputs/config.yaml"
STORE_ROOT = "{{workflow.parameters.store-root}}"
RUN_ID = "{{workflow.parameters.run-id}}"
ATTEMPT_IN = "{{inputs.parameters.attempt}}"
RUN_ARGS = ["--store-root", STORE_ROOT, "--run-id", RUN_ID]
ATTEMPT_ARGS = [*RUN_ARGS, "--attempt", ATTEMPT_IN]
SEGMENT_INPUTS = ("attempt", "jobset-name", "restore-step", "coordinator-port", "metrics-port")
# train-segment is retried however its own pod dies, for the whole segment, and never on its own verdicts
# (1: the attempt failed or stalled; 2: configuration). Argo ends a pod that was evicted, drained, shut down
# with its node or OOM-killed as Failed with the container's code (137, 143) or -1, and only a pod that
# vanished unseen as Error (argo-workflows v4.1.2 workflow/controller/operator.go inferFailedReason), so the
# expression keys on the exit code, not on the status. No maxDuration: Argo measures it from the first try's
# start and makes it the retry's deadline (operator.go processNodeRetries, ARGO_DEADLINE), which would kill
# a supervisor of a long segment; ``cap`` bounds the backoff instead. The retry re-attaches to the gang.
SUPERVISOR_RETRIES = 20
# Argo waits out a retry's backoff before it evaluates the retry's expression (argo-workflows v4.0.5
# workflow/controller/operator.go processNodeRetries: "Backoff for ..." is returned ahead of the retry policy and
# the expression), so the first backoff delays every supervisor's verdict (exit 1) by that much before
# classify-failure runs: a short one, doubling to the cap, which the 20 retries still reach (a window of about
# half an hour for a supervisor that keeps losing its pod or its API).
SUPERVISOR_BACKOFF_S = 1
SUPERVISOR_RESOURCES = Resources(cpu_request="500m", cpu_limit="500m", memory_request="1Gi", memory_limit="1Gi")
# A pod is Guaranteed only when every container's requests equal its limits, Argo's own included; Argo gives its
# init and wait containers the controller's ``executor.resources`` (none unless an operator sets them: argo-workflows
# v4.0.5 config/config.go GetExecutor, workflow/controller/workflowpod.go newExecContainer), which leaves the
# supervisor's pod Burstable. The template's podSpecPatch, applied after Argo adds them (createWorkflowPod), sets
# theirs; the patch merges containers by name ("init", "wait").
EXECUTOR_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "100m", "memory": "128Mi"}}
SUPERVISOR_POD_PATCH = json.dumps(
    {
        "initContainers": [{"name": "init", "resources": EXECUTOR_RESOURCES}],
        "containers": [{"name": "wait", "resources": EXECUTOR_RESOURCES}],
    },
    sort_keys=True,
)
SUPERVISOR_RETRY = (
    f"asInt(lastRetry.exitCode) != {int(ExitCode.ATTEMPT_FAILED)} && "
    f"asInt(lastRetry.exitCode) != {int(ExitCode.CONFIGURATION)}"
)
HOLDER = ["--holder", "{{workflow.uid}}", "--holder-name", "{{workflow.name}}"]
# Pods of steps that succeeded are deleted as they finish (a weeks-long run makes hundreds); failed and errored
# ones stay for their logs until the Workflow goes (argo docs "Pod GC": OnPodSuccess). The finished Workflow is
# kept a week after success and a month after failure so every attempt can be inspected (argo docs "TTL").
POD_GC = PodGC(strategy="OnPodSuccess")
TTL = TTLStrategy(seconds_after_success=7 * 24 * 3600, seconds_after_failure=30 * 24 * 3600)


# A step whose pod vanished (Argo: Error, exit code -1), was killed with its container (an eviction, a drain or
# a node shutdown SIGTERMs it: 143; the OOM killer or the end of the grace period SIGKILLs it: 137; Argo reports
# both as Failed, operator.go inferFailedReason) or exited transient (69) is retried in place; the steps never
# exit 137 or 143 by a verdict of their own.
TRANSIENT_RETRY = (
    f"lastRetry.status == 'Error' || asInt(lastRetry.exitCode) == {int(ExitCode.TRANSIENT)} || "
    "asInt(lastRetry.exitCode) == 137 || asInt(lastRetry.exitCode) == 143"
)
# Backoffs are capped, never bounded by maxDuration (measured from the first try and made the retry's deadline).
BACKOFF_CAP = "5m"


def transient_retry(cfg: JobConfig, *, also: str | None = None, limit: int | None = None) -> RetryStrategy:
    """The bounded retry of a step whose pod Errored or that exited transient (``also``: a further condition)."""
    return RetryStrategy(
        limit=cfg.retry.transient_retry_limit if limit is None else limit,
        retry_policy="Always",
        backoff=Backoff(duration=f"{cfg.retry.transient_backoff_s}s", factor=2, cap=BACKOFF_CAP),
        expression=f"{also} || {TRANSIENT_RETRY}" if also else TRANSIENT_RETRY,
    )


def _outputs(declared: type[StepOutputs] | None) -> list[Parameter]:
    """The template's output parameters, from the step's one declaration."""
    if declared is None:
        return []
    return [
        Parameter(name=n, description=d, value_from=ValueFrom(path=f"{OUTPUT_DIR}/{n}"))
        for n, d in declared.descriptions().items()
    ]


def output_of(task: Task, declared: type[StepOutputs], field: str) -> str:
    """``{{tasks.<task>.outputs.parameters.<name>}}``: the declared output ``field`` of the step ``task`` runs.

    Raises:
        UndeclaredOutput: ``declared`` has no such field, or ``task`` does not run ``declared``'s template.
    """
    name = declared.name_of(field)
    template = getattr(task.template, "name", task.template)
    if template != declared.TEMPLATE:
        raise UndeclaredOutput(
            f"task {task.name!r} runs template {template!r}, not {declared.TEMPLATE!r} whose outputs "
            f"{declared.__name__} declares; reference the outputs of the template the task runs"
        )
    try:
        # Hera looks the name up in the template's own output parameters (built from the same declaration).
        return str(task.get_parameter(name).value)
    except (KeyError, ValueError) as e:
        raise UndeclaredOutput(f"task {task.name!r}: {e}") from None


def own_output(declared: type[StepOutputs], field: str) -> str:
    """``{{outputs.parameters.<name>}}``: a declared output of the template itself (its metrics read these)."""
    return "{{outputs.parameters." + declared.name_of(field) + "}}"


def _inputs_of(names: Sequence[str]) -> dict[str, str]:
    """Arguments that pass a template's own inputs of the same names on."""
    return {n: "{{inputs.parameters." + n + "}}" for n in names}


def _step(
    cfg: JobConfig,
    name: str,
    module: str,
    args: list[str],
    *,
    inputs: Sequence[str] = (),
    outputs: type[StepOutputs] | None = None,
    **kw: Any,
) -> Container:
    """A container template that runs ``python -m recovery_steps.<module>``."""
    full_args = list(args) + (["--output-dir", OUTPUT_DIR] if outputs is not None else [])
    kw.setdefault("retry_strategy", transient_retry(cfg))
    labels = {RUN_ID_LABEL: RUN_ID}
    if "attempt" in inputs:
        labels[ATTEMPT_LABEL] = ATTEMPT_IN
    return Container(
        name=name,
        image=cfg.image,
        command=["python", "-m", f"recovery_steps.{module}"],
        args=full_args,
        inputs=[Parameter(name=n) for n in inputs] + kw.pop("input_artifacts", []),
        outputs=_outputs(outputs),
        labels=labels,
        # The step's one line (step.say_why) or, after a crash before it, its log's tail: the node's message.
        termination_message_policy="FallbackToLogsOnError",
        **kw,
    )


def _metric(name: str, *labels: Label, value: str = "1", when: str | None = None) -> Counter | Gauge:
    """Argo's metric ``name`` as the metric table declares it (its kind and help), labelled with the run id first.

    A gauge is emitted once the template ends (``realtime: false``), from the step's outputs.
    """
    spec = metric_spec(name)
    common = {"name": name, "help": spec.help, "labels": [_run_label(), *labels], "when": when, "value": value}
    return Counter(**common) if spec.kind == "counter" else Gauge(**common, realtime=False)


def _run_label() -> Label:
    return Label(key="run_id", value=RUN_ID)


def canonical_config_yaml(cfg: JobConfig) -> str:
    """The config as validate-config receives it: every field, keys sorted."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=True, default_flow_style=False)


@dataclass(frozen=True)
class StepTemplates:
    """The templates the DAGs call, each built once per Workflow."""

    validate: Container
    restore: Container
    provision: Container
    train: Container
    classify: Container
    backoff: Suspend
    hand_over: Container
    give_up: Container
    finalize: Container


def validate_template(cfg: JobConfig) -> Container:
    """``validate-config``: validates and pins the config, checks permissions and cluster objects first."""
    args = ["--config", CONFIG_PATH, *RUN_ARGS]
    args += ["--accept-safe-changes", "{{workflow.parameters.accept-safe-changes}}"]
    args += ["--preflight", "true", *HOLDER]
    return _step(
        cfg,
        "validate-config",
        "validate_config",
        args,
        outputs=ValidateOutputs,
        input_artifacts=[RawArtifact(name="config", path=CONFIG_PATH, data=canonical_config_yaml(cfg))],
    )


def restore_template(cfg: JobConfig) -> Container:
    """``restore-latest``: the newest verified checkpoint the attempt restores."""
    return _step(cfg, "restore-latest", "restore_latest", ATTEMPT_ARGS, inputs=["attempt"], outputs=RestoreOutputs)


def provision_template(cfg: JobConfig) -> Container:
    """``provision-slice``: tears the previous gang down and waits for capacity."""
    return _step(
        cfg,
        "provision-slice",
        "provision_slice",
        [*ATTEMPT_ARGS, *HOLDER],
        inputs=["attempt"],
        outputs=ProvisionOutputs,
        # Exit 75 (capacity not there yet) is retried with backoff, like an Errored pod or a transient exit;
        # exit 2 (configuration) is not.
        retry_strategy=RetryStrategy(
            limit=cfg.retry.provision_retry_limit,
            retry_policy="Always",
            backoff=Backoff(duration=f"{cfg.retry.provision_backoff_s}s", factor=2, cap=BACKOFF_CAP),
            expression=f"asInt(lastRetry.exitCode) == {int(ExitCode.CAPACITY)} || {TRANSIENT_RETRY}",
        ),
    )


def train_template(cfg: JobConfig) -> Container:
    """``train-segment``: the supervisor of the attempt's gang.

    It creates (or re-attaches to) the JobSet, decides when the attempt is over and stops it: a Resource
    template would wait without bound on a gang that can never end.
    """
    # The step renders the JobSet from the run's pinned config and these parameters (model.jobset): the
    # Workflow carries the attempt's parameters, not the manifest.
    args = [*ATTEMPT_ARGS]
    for name in SEGMENT_INPUTS[1:]:  # --jobset-name, --restore-step, --coordinator-port, --metrics-port
        args += [f"--{name}", f"{{{{inputs.parameters.{name}}}}}"]
    return _step(
        cfg,
        "train-segment",
        "train_segment",
        [*args, "--holder", "{{workflow.uid}}"],
        inputs=SEGMENT_INPUTS,
        outputs=SegmentOutputs,
        # Guaranteed QoS (requests equal limits in every container, Argo's too) and a PriorityClass: the kubelet
        # evicts it after BestEffort and Burstable pods and lower priorities under node pressure (Kubernetes docs
        # "Node-pressure Eviction"). A drain or a node shutdown still ends it: the retry and classify's
        # resupervise cover that.
        resources=None if cfg.slice.is_cpu else SUPERVISOR_RESOURCES,
        pod_spec_patch=None if cfg.slice.is_cpu else SUPERVISOR_POD_PATCH,
        priority_class_name=None if cfg.slice.is_cpu else STEP_PRIORITY_CLASS,
        retry_strategy=RetryStrategy(
            limit=SUPERVISOR_RETRIES,
            retry_policy="Always",
            backoff=Backoff(duration=f"{SUPERVISOR_BACKOFF_S}s", factor=2, cap="2m"),
            expression=SUPERVISOR_RETRY,
        ),
    )


def classify_template(cfg: JobConfig) -> Container:
    """``classify-failure``: the failure class and what follows, with the failure metrics."""
    failure_class = Label(key="class", value=own_output(ClassifyOutputs, "failure_class"))
    # A lost supervisor is not a failed attempt.
    resupervised = f"'{own_output(ClassifyOutputs, 'decision')}' != '{Decision.RESUPERVISE.value}'"
    failures = _metric("jaxrec_failures_total", failure_class, when=resupervised)
    reason = Label(key="reason", value=own_output(ClassifyOutputs, "reason"))
    last = _metric("jaxrec_last_failure_info", failure_class, reason)
    # Only a stop because the class spent its budget (not the no-progress guard or the cap).
    exhausted = _metric(
        "jaxrec_budget_exhausted", failure_class, when=f"{own_output(ClassifyOutputs, 'budget_exhausted')} == 1"
    )
    args = [*ATTEMPT_ARGS, "--jobset", "{{inputs.parameters.jobset-name}}", "--workflow", "{{workflow.name}}"]
    args += HOLDER[:2]  # a Workflow that has ended once (argo retry) is stopped before it classifies anything
    return _step(
        cfg,
        "classify-failure",
        "classify_failure",
        args,
        inputs=["attempt", "jobset-name"],
        outputs=ClassifyOutputs,
        metrics=[failures, last, exhausted],
    )


def backoff_template() -> Suspend:
    """``backoff``: waits what is left of the retry policy's backoff."""
    return Suspend(name="backoff", inputs=[Parameter(name="duration")], duration="{{inputs.parameters.duration}}")


def hand_over_template(cfg: JobConfig) -> Container:
    """``hand-over``: passes the run to a continuation Workflow of the same run id."""
    args = [*ATTEMPT_ARGS, "--workflow", "{{workflow.name}}", "--workflow-uid", "{{workflow.uid}}"]
    return _step(cfg, "hand-over", "hand_over", args, inputs=["attempt"], outputs=HandOverOutputs)


def give_up_template(cfg: JobConfig) -> Container:
    """``give-up``: ends the Workflow failed, naming the class and the reason."""
    args = ["--failure-class", "{{inputs.parameters.failure-class}}", "--reason", "{{inputs.parameters.reason}}"]
    # With the lease's holder: a give-up that Argo replays (argo retry) stops its Workflow and says what to run.
    args += [*RUN_ARGS, *HOLDER[:2], "--workflow", "{{workflow.name}}", "--namespace", cfg.namespace]
    return _step(cfg, "give-up", "give_up", args, inputs=["failure-class", "reason"])


def finalize_template(cfg: JobConfig) -> Container:
    """``exit-handler`` (finalize): closes the ledger and reports the run's totals."""
    status = _metric("jaxrec_run_status", Label(key="status", value="{{workflow.status}}"))
    # Totals over the run's incidents, computed by finalize from the ledger and worker reports.
    lost = _metric("jaxrec_steps_lost_total", value=own_output(FinalizeOutputs, "steps_lost"))
    recovery = own_output(FinalizeOutputs, "recovery_seconds")
    seconds = _metric("jaxrec_recovery_duration_seconds", value=recovery, when=f"{recovery} >= 0")
    args = [*RUN_ARGS, "--status", "{{workflow.status}}", "--failures", "{{workflow.failures}}"]
    return _step(
        cfg,
        "exit-handler",
        "finalize",
        [*args, "--holder", "{{workflow.uid}}", "--workflow", "{{workflow.name}}"],
        outputs=FinalizeOutputs,
        metrics=[status, lost, seconds],
    )


def _route(classify: Task, t: StepTemplates, resupervise: dict[str, str] | None = None) -> None:
    """Wire what follows classify-failure, by its decision.

    The next attempt or a continuation Workflow after the backoff, a stop, or (``resupervise``: the segment's
    inputs) another supervisor of the same attempt.
    """
    decision = output_of(classify, ClassifyOutputs, "decision")
    next_attempt = {"attempt": output_of(classify, ClassifyOutputs, "next_attempt")}

    def is_(d: Decision) -> str:
        return f"'{decision}' == '{d.value}'"

    wait = {"duration": output_of(classify, ClassifyOutputs, "backoff_wait")}
    retry_or_hand_over = f"{is_(Decision.RETRY)} || {is_(Decision.HAND_OVER)}"
    Task(name="backoff", template=t.backoff, arguments=wait, depends=classify.name, when=retry_or_hand_over)
    # Each attempt nests two calls deeper (Argo refuses the call whose depth reaches 100: config.segment_pod_depth):
    # after retry.attempts_per_workflow attempts, or sooner by depth, the run continues in a new Workflow instead.
    Task(
        name="hand-over",
        template=t.hand_over,
        arguments=next_attempt,
        depends="backoff",
        when=is_(Decision.HAND_OVER),
    )
    Task(name="next-attempt", template="attempt", arguments=next_attempt, depends="backoff", when=is_(Decision.RETRY))
    verdict = {
        "failure-class": output_of(classify, ClassifyOutputs, "failure_class"),
        "reason": output_of(classify, ClassifyOutputs, "reason"),
    }
    Task(name="give-up", template=t.give_up, depends=classify.name, when=is_(Decision.STOP), arguments=verdict)
    if resupervise is not None:
        Task(
            name="resupervise",
            template="segment",
            arguments=resupervise,
            depends=classify.name,
            when=is_(Decision.RESUPERVISE),
        )


def segment_dag(t: StepTemplates) -> DAG:
    """``segment``: train-segment supervises the attempt's gang; classify-failure decides what follows.

    A supervisor that left no verdict while the gang still runs (its pod lost for good) is followed by another
    supervisor of the same attempt, never by a new attempt that would delete the live gang.
    """
    with DAG(name="segment", inputs=[Parameter(name=n) for n in SEGMENT_INPUTS]) as segment:
        Task(name="train-segment", template=t.train, arguments=_inputs_of(SEGMENT_INPUTS))
        classify = Task(
            name="classify-failure",
            template=t.classify,
            arguments={"attempt": ATTEMPT_IN, "jobset-name": "{{inputs.parameters.jobset-name}}"},
            depends="train-segment.Failed || train-segment.Errored",
        )
        _route(classify, t, resupervise=_inputs_of(SEGMENT_INPUTS))
    return segment


def attempt_dag(t: StepTemplates, segment: DAG) -> DAG:
    """``attempt``: provision the slice, restore, run the segment."""
    attempts = _metric("jaxrec_attempts_total")
    with DAG(name="attempt", inputs=[Parameter(name="attempt")], metrics=[attempts]) as attempt:
        t_restore = Task(name="restore-latest", template=t.restore, arguments={"attempt": ATTEMPT_IN})
        t_provision = Task(name="provision-slice", template=t.provision, arguments={"attempt": ATTEMPT_IN})
        slice_ready = {
            "jobset-name": output_of(t_provision, ProvisionOutputs, "jobset_name"),
            "restore-step": output_of(t_restore, RestoreOutputs, "restore_step"),
            "coordinator-port": output_of(t_provision, ProvisionOutputs, "coordinator_port"),
            "metrics-port": output_of(t_provision, ProvisionOutputs, "metrics_port"),
        }
        t_segment = Task(name="segment", template=segment, arguments={"attempt": ATTEMPT_IN, **slice_ready})
        # A step before training that spent its retries (capacity after provision-slice's, a store outage
        # through restore-latest's) ends the attempt like a failed gang: classified and decided.
        classify = Task(
            name="classify-failure",
            template=t.classify,
            # provision-slice may have failed: name the JobSet the way it does instead of reading outputs.
            arguments={"attempt": ATTEMPT_IN, "jobset-name": jobset_name(RUN_ID, ATTEMPT_IN)},
            depends=(
                "provision-slice.Failed || provision-slice.Errored || restore-latest.Failed || restore-latest.Errored"
            ),
        )
        _route(classify, t)
        # provision-slice tears the previous gang down first, so restore-latest sees the checkpoint
        # a SIGTERMed worker saved on its way out.
        t_provision >> t_restore >> t_segment
    return attempt


def main_dag(t: StepTemplates, attempt: DAG) -> DAG:
    """``main``: validate the config, then the first attempt (a resubmitted run continues its numbering)."""
    with DAG(name="main") as main:
        t_validate = Task(name="validate-config", template=t.validate)
        # A resubmitted run continues its attempt numbering (validate-config reads the ledger).
        first = {"attempt": output_of(t_validate, ValidateOutputs, "first_attempt")}
        t_validate >> Task(name="attempt", template=attempt, arguments=first)
    return main


def step_templates(cfg: JobConfig) -> StepTemplates:
    """Every step template of the Workflow, in the order the manifest lists them."""
    return StepTemplates(
        validate=validate_template(cfg),
        restore=restore_template(cfg),
        provision=provision_template(cfg),
        train=train_template(cfg),
        classify=classify_template(cfg),
        backoff=backoff_template(),
        hand_over=hand_over_template(cfg),
        give_up=give_up_template(cfg),
        finalize=finalize_template(cfg),
    )


def build_workflow(cfg: JobConfig) -> Workflow:
    """The Workflow of one job config.

    Args:
        cfg: A validated job config.

    Returns:
        The Hera ``Workflow`` (``to_dict()`` gives the manifest ``argo submit`` takes).

    Raises:
        UndeclaredOutput: the wiring references an output a step does not declare.
    """
    with Workflow(
        generate_name=f"{cfg.run_id}-",
        namespace=cfg.namespace,
        labels={RUN_ID_LABEL: cfg.run_id},
        entrypoint="main",
        on_exit="exit-handler",
        service_account_name=cfg.service_account,
        pod_gc=POD_GC,
        # One live workflow per run id in this controller: a second submission waits (argo docs "Synchronization").
        synchronization=Synchronization(mutexes=[Mutex(name="jaxrec-run-{{workflow.parameters.run-id}}")]),
        ttl_strategy=TTL,
        arguments=[
            Parameter(name="store-root", value=cfg.storage.root),
            Parameter(name="run-id", value=cfg.run_id),
            # `argo submit ... -p accept-safe-changes=true` resumes a run whose config changed safely.
            Parameter(name="accept-safe-changes", value="false"),
        ],
    ) as w:
        # Templates referenced only by name (the exit handler, the next attempt) are listed all the same.
        t = step_templates(cfg)
        main_dag(t, attempt_dag(t, segment_dag(t)))
    return w
