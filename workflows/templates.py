"""Hera definitions of the recovery workflow: step templates, the attempt DAG and the main DAG.

Declarative only: every decision is made by the step programs (``python -m recovery_steps.<step>``);
this module wires their outputs to the next step's inputs and to ``when`` conditions.
"""

from __future__ import annotations

import json
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

from recovery_steps.kernel.config import JobConfig
from recovery_steps.kernel.contract import Decision, ExitCode
from recovery_steps.kernel.k8s import ATTEMPT_LABEL, RUN_ID_LABEL, STEP_PRIORITY_CLASS, jobset_name
from recovery_steps.kernel.metrics import spec as metric_spec
from recovery_steps.kernel.outputs import (
    ClassifyOutputs,
    FinalizeOutputs,
    HandOverOutputs,
    ProvisionOutputs,
    RestoreOutputs,
    SegmentOutputs,
    StepOutputs,
    ValidateOutputs,
)
from workflows.jobset import jobset_manifest

OUTPUT_DIR = "/tmp/outputs"
CONFIG_PATH = "/tmp/inputs/config.yaml"
STORE_ROOT = "{{workflow.parameters.store-root}}"
RUN_ID = "{{workflow.parameters.run-id}}"
ATTEMPT_IN = "{{inputs.parameters.attempt}}"
# train-segment is retried however its own pod dies, for the whole segment, and never on its own verdicts
# (1: the attempt failed or stalled; 2: configuration). Argo ends a pod that was evicted, drained, shut down
# with its node or OOM-killed as Failed with the container's code (137, 143) or -1, and only a pod that
# vanished unseen as Error (argo-workflows v4.1.2 workflow/controller/operator.go inferFailedReason), so the
# expression keys on the exit code, not on the status. No maxDuration: Argo measures it from the first try's
# start and makes it the retry's deadline (operator.go processNodeRetries, ARGO_DEADLINE), which would kill
# a supervisor of a long segment; ``cap`` bounds the backoff instead. The retry re-attaches to the gang.
SUPERVISOR_RETRIES = 20
SUPERVISOR_RESOURCES = Resources(cpu_request="500m", cpu_limit="500m", memory_request="1Gi", memory_limit="1Gi")
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


def _step(
    cfg: JobConfig,
    name: str,
    module: str,
    args: list[str],
    *,
    inputs: list[str] = (),
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
        **kw,
    )


def _metric_help(name: str) -> str:
    return metric_spec(name).help


def canonical_config_yaml(cfg: JobConfig) -> str:
    """The config as validate-config receives it: every field, keys sorted."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=True, default_flow_style=False)


def _route(classify: Task, backoff: Suspend, hand_over: Container, give_up: Container,
           resupervise: dict[str, str] | None = None) -> None:  # fmt: skip
    """Wire what follows classify-failure, by its decision.

    The next attempt or a continuation Workflow after the backoff, a stop, or (``resupervise``: the segment's
    inputs) another supervisor of the same attempt.
    """
    out = "{{tasks." + classify.name + ".outputs.parameters.%s}}"
    decision = out % "decision"

    def is_(d: Decision) -> str:
        return f"'{decision}' == '{d.value}'"

    Task(name="backoff", template=backoff, arguments={"duration": out % "backoff-wait"},
         depends=classify.name, when=f"{is_(Decision.RETRY)} || {is_(Decision.HAND_OVER)}")  # fmt: skip
    # Each attempt nests one call deeper (Argo refuses more than 100): after retry.attempts_per_workflow
    # attempts the run continues in a new Workflow of the same run id instead.
    Task(name="hand-over", template=hand_over, arguments={"attempt": out % "next-attempt"}, depends="backoff",
         when=is_(Decision.HAND_OVER))  # fmt: skip
    Task(name="next-attempt", template="attempt", arguments={"attempt": out % "next-attempt"}, depends="backoff",
         when=is_(Decision.RETRY))  # fmt: skip
    Task(name="give-up", template=give_up, depends=classify.name, when=is_(Decision.STOP),
         arguments={"failure-class": out % "failure-class", "reason": out % "reason"})  # fmt: skip
    if resupervise is not None:
        Task(name="resupervise", template="segment", arguments=resupervise, depends=classify.name,
             when=is_(Decision.RESUPERVISE))  # fmt: skip


def build_workflow(cfg: JobConfig) -> Workflow:
    """The Workflow of one job config.

    Args:
        cfg: A validated job config.

    Returns:
        The Hera ``Workflow`` (``to_dict()`` gives the manifest ``argo submit`` takes).
    """
    manifest = jobset_manifest(
        cfg,
        name="{{inputs.parameters.jobset-name}}",
        run_id=RUN_ID,
        store_root=STORE_ROOT,
        attempt=ATTEMPT_IN,
        restore_step="{{inputs.parameters.restore-step}}",
        coordinator_port="{{inputs.parameters.coordinator-port}}",
        metrics_port="{{inputs.parameters.metrics-port}}",
    )
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
        validate = _step(
            cfg,
            "validate-config",
            "validate_config",
            [
                "--config",
                CONFIG_PATH,
                "--store-root",
                STORE_ROOT,
                "--accept-safe-changes",
                "{{workflow.parameters.accept-safe-changes}}",
                # Permissions and cluster objects are checked before any slice is provisioned.
                "--preflight",
                "true",
                *HOLDER,
            ],  # fmt: skip
            outputs=ValidateOutputs,
            input_artifacts=[RawArtifact(name="config", path=CONFIG_PATH, data=canonical_config_yaml(cfg))],
        )
        restore = _step(
            cfg,
            "restore-latest",
            "restore_latest",
            ["--store-root", STORE_ROOT, "--run-id", RUN_ID, "--attempt", ATTEMPT_IN],
            inputs=["attempt"],
            outputs=RestoreOutputs,
        )
        provision = _step(
            cfg,
            "provision-slice",
            "provision_slice",
            ["--store-root", STORE_ROOT, "--run-id", RUN_ID, "--attempt", ATTEMPT_IN, *HOLDER],
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
        # The supervisor creates (or re-attaches to) this JobSet, decides when the attempt is over and
        # stops it: a Resource template would wait without bound on a gang that can never end.
        train = _step(
            cfg,
            "train-segment",
            "train_segment",
            [
                "--store-root", STORE_ROOT, "--run-id", RUN_ID, "--attempt", ATTEMPT_IN,
                "--jobset-manifest", json.dumps(manifest, separators=(",", ":")), "--holder", "{{workflow.uid}}",
            ],
            inputs=["attempt", "jobset-name", "restore-step", "coordinator-port", "metrics-port"],
            outputs=SegmentOutputs,
            # Guaranteed QoS (requests equal limits) and a PriorityClass: the kubelet evicts it after BestEffort
            # and Burstable pods and lower priorities under node pressure (Kubernetes docs "Node-pressure
            # Eviction"). A drain or a node shutdown still ends it: the retry and classify's resupervise cover that.
            resources=None if cfg.slice.is_local else SUPERVISOR_RESOURCES,
            priority_class_name=None if cfg.slice.is_local else STEP_PRIORITY_CLASS,
            retry_strategy=RetryStrategy(
                limit=SUPERVISOR_RETRIES,
                retry_policy="Always",
                backoff=Backoff(duration="5s", factor=2, cap="2m"),
                expression=SUPERVISOR_RETRY,
            ),
        )  # fmt: skip
        classify = _step(
            cfg,
            "classify-failure",
            "classify_failure",
            [
                "--store-root", STORE_ROOT, "--run-id", RUN_ID, "--attempt", ATTEMPT_IN,
                "--jobset", "{{inputs.parameters.jobset-name}}", "--workflow", "{{workflow.name}}",
            ],
            inputs=["attempt", "jobset-name"],
            outputs=ClassifyOutputs,
            metrics=[
                Counter(
                    name="jaxrec_failures_total",
                    help=_metric_help("jaxrec_failures_total"),
                    labels=[Label(key="run_id", value=RUN_ID),
                            Label(key="class", value="{{outputs.parameters.failure-class}}")],
                    # A lost supervisor is not a failed attempt.
                    when=f"'{{{{outputs.parameters.decision}}}}' != '{Decision.RESUPERVISE.value}'",
                    value="1",
                ),
                Gauge(
                    name="jaxrec_last_failure_info",
                    help=_metric_help("jaxrec_last_failure_info"),
                    labels=[Label(key="run_id", value=RUN_ID),
                            Label(key="class", value="{{outputs.parameters.failure-class}}"),
                            Label(key="reason", value="{{outputs.parameters.reason}}")],
                    realtime=False,
                    value="1",
                ),
                # Only a stop because the class spent its budget (not the no-progress guard or the cap).
                Gauge(
                    name="jaxrec_budget_exhausted",
                    help=_metric_help("jaxrec_budget_exhausted"),
                    labels=[Label(key="run_id", value=RUN_ID),
                            Label(key="class", value="{{outputs.parameters.failure-class}}")],
                    when="{{outputs.parameters.budget-exhausted}} == 1",
                    realtime=False,
                    value="1",
                ),
            ],
        )  # fmt: skip
        backoff = Suspend(
            name="backoff",
            inputs=[Parameter(name="duration")],
            duration="{{inputs.parameters.duration}}",
        )
        hand_over = _step(
            cfg,
            "hand-over",
            "hand_over",
            [
                "--store-root", STORE_ROOT, "--run-id", RUN_ID, "--attempt", ATTEMPT_IN,
                "--workflow", "{{workflow.name}}", "--workflow-uid", "{{workflow.uid}}",
            ],
            inputs=["attempt"],
            outputs=HandOverOutputs,
        )  # fmt: skip
        give_up = _step(
            cfg,
            "give-up",
            "give_up",
            ["--failure-class", "{{inputs.parameters.failure-class}}", "--reason", "{{inputs.parameters.reason}}"],
            inputs=["failure-class", "reason"],
        )
        finalize = _step(
            cfg,
            "exit-handler",
            "finalize",
            [
                "--store-root", STORE_ROOT, "--run-id", RUN_ID,
                "--status", "{{workflow.status}}", "--failures", "{{workflow.failures}}",
                "--holder", "{{workflow.uid}}",
            ],
            outputs=FinalizeOutputs,
            metrics=[
                Gauge(
                    name="jaxrec_run_status",
                    help=_metric_help("jaxrec_run_status"),
                    labels=[Label(key="run_id", value=RUN_ID), Label(key="status", value="{{workflow.status}}")],
                    realtime=False,
                    value="1",
                ),
                # Totals over the run's incidents, computed by finalize from the ledger and worker reports.
                Counter(
                    name="jaxrec_steps_lost_total",
                    help=_metric_help("jaxrec_steps_lost_total"),
                    labels=[Label(key="run_id", value=RUN_ID)],
                    value="{{outputs.parameters.steps-lost}}",
                ),
                Gauge(
                    name="jaxrec_recovery_duration_seconds",
                    help=_metric_help("jaxrec_recovery_duration_seconds"),
                    labels=[Label(key="run_id", value=RUN_ID)],
                    when="{{outputs.parameters.recovery-seconds}} >= 0",
                    realtime=False,
                    value="{{outputs.parameters.recovery-seconds}}",
                ),
            ],
        )  # fmt: skip

        segment_inputs = ["attempt", "jobset-name", "restore-step", "coordinator-port", "metrics-port"]
        # One segment: train-segment supervises the attempt's gang; classify-failure decides what follows. A
        # supervisor that left no verdict while the gang still runs (its pod lost for good) is followed by
        # another supervisor of the same attempt, never by a new attempt that would delete the live gang.
        with DAG(name="segment", inputs=[Parameter(name=n) for n in segment_inputs]) as segment:
            Task(
                name="train-segment",
                template=train,
                arguments={n: f"{{{{inputs.parameters.{n}}}}}" for n in segment_inputs},
            )
            _route(
                Task(
                    name="classify-failure",
                    template=classify,
                    arguments={"attempt": ATTEMPT_IN, "jobset-name": "{{inputs.parameters.jobset-name}}"},
                    depends="train-segment.Failed || train-segment.Errored",
                ),
                backoff,
                hand_over,
                give_up,
                resupervise={n: f"{{{{inputs.parameters.{n}}}}}" for n in segment_inputs},
            )

        with DAG(
            name="attempt",
            inputs=[Parameter(name="attempt")],
            metrics=[
                Counter(
                    name="jaxrec_attempts_total",
                    help=_metric_help("jaxrec_attempts_total"),
                    labels=[Label(key="run_id", value=RUN_ID)],
                    value="1",
                )
            ],
        ) as attempt:
            t_restore = Task(name="restore-latest", template=restore, arguments={"attempt": ATTEMPT_IN})
            t_provision = Task(name="provision-slice", template=provision, arguments={"attempt": ATTEMPT_IN})
            prov_out = "{{tasks.provision-slice.outputs.parameters.%s}}"
            t_segment = Task(
                name="segment",
                template=segment,
                arguments={
                    "attempt": ATTEMPT_IN,
                    "jobset-name": prov_out % "jobset-name",
                    "restore-step": "{{tasks.restore-latest.outputs.parameters.restore-step}}",
                    "coordinator-port": prov_out % "coordinator-port",
                    "metrics-port": prov_out % "metrics-port",
                },
            )
            # A step before training that spent its retries (capacity after provision-slice's, a store outage
            # through restore-latest's) ends the attempt like a failed gang: classified and decided.
            _route(
                Task(
                    name="classify-failure",
                    template=classify,
                    # provision-slice may have failed: name the JobSet the way it does instead of reading outputs.
                    arguments={"attempt": ATTEMPT_IN, "jobset-name": jobset_name(RUN_ID, ATTEMPT_IN)},
                    depends=(
                        "provision-slice.Failed || provision-slice.Errored || "
                        "restore-latest.Failed || restore-latest.Errored"
                    ),
                ),
                backoff,
                hand_over,
                give_up,
            )
            # provision-slice tears the previous gang down first, so restore-latest sees the checkpoint
            # a SIGTERMed worker saved on its way out.
            t_provision >> t_restore >> t_segment

        with DAG(name="main"):
            t_validate = Task(name="validate-config", template=validate)
            # A resubmitted run continues its attempt numbering (validate-config reads the ledger).
            t_first = Task(
                name="attempt",
                template=attempt,
                arguments={"attempt": "{{tasks.validate-config.outputs.parameters.first-attempt}}"},
            )
            t_validate >> t_first

    # Templates referenced only by name must still be listed once.
    del finalize
    return w
