"""The names and labels of a run's Kubernetes objects, the GKE node labels, and the verbs each step uses.

No client here: the workflow generator (``workflows/``) builds manifests from these, and the steps' client
(``adapters.kube``) finds objects by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Labels every object of a run carries (Workflow, JobSet, pods) so that steps can find them.
RUN_ID_LABEL = "jaxrec/run-id"
ATTEMPT_LABEL = "jaxrec/attempt"
# A continuation Workflow names the Workflow it continues (``argo list -l jaxrec/continues=NAME``).
CONTINUES_LABEL = "jaxrec/continues"
# Set on a Workflow by its give-up step, with its one line in the description (DESCRIPTION_ANNOTATION).
FAILURE_CLASS_LABEL = "jaxrec/failure-class"
# Shown in the Argo UI's workflow list, Markdown allowed (argo docs "Title and Description").
TITLE_ANNOTATION = "workflows.argoproj.io/title"
DESCRIPTION_ANNOTATION = "workflows.argoproj.io/description"
ARGO_GROUP, ARGO_VERSION, WORKFLOW_PLURAL = "argoproj.io", "v1alpha1", "workflows"

# GKE node labels and the taints GKE puts on TPU nodes.
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SPOT_LABEL = "cloud.google.com/gke-spot"
RESERVATION_LABEL = "cloud.google.com/reservation-name"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_RESOURCE = "google.com/tpu"
# GKE host maintenance (GKE docs "Handle disruption for GPU and TPU nodes"): the first is set while maintenance
# runs, the second announces a scheduled one with its time.
ACTIVE_MAINTENANCE_LABEL = "cloud.google.com/active-node-maintenance"
SCHEDULED_MAINTENANCE_LABEL = "cloud.google.com/scheduled-maintenance-time"
# Node labels and taints that say a node is (about to be) taken away for maintenance or reclaimed.
MAINTENANCE_LABELS = (ACTIVE_MAINTENANCE_LABEL, SCHEDULED_MAINTENANCE_LABEL, "cloud.google.com/gke-tpu-maintenance")
# The taint the node lifecycle controller puts on a node whose kubelet stopped reporting.
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
RECLAIM_TAINTS = (
    "cloud.google.com/impending-node-termination",
    "cloud.google.com/active-node-maintenance",
    "node.kubernetes.io/out-of-service",
)

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
# The PriorityClass of the step pod that owns a gang (train-segment), shipped in argo/rbac.yaml: under node
# memory pressure the kubelet evicts lower priorities first (Kubernetes docs "Node-pressure Eviction").
STEP_PRIORITY_CLASS = "jaxrec-supervisor"

JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_PLURAL = "jobsets"


@dataclass(frozen=True)
class VerbUse:
    """One Kubernetes verb one part of the workflow uses: the RBAC rules are built from these, nothing more."""

    step: str
    group: str
    resource: str
    verb: str
    why: str
    cluster_scoped: bool = False


# Every verb the workflow's ServiceAccount needs, with the step that uses it (workflows.rbac builds the Role and
# ClusterRole from this table; preflight asks the API server about each by SelfSubjectAccessReview).
STEP_VERBS: tuple[VerbUse, ...] = (
    # Argo's executor reports outputs through WorkflowTaskResults (v3.4+; argo docs "Workflow RBAC"); it does
    # not need pods watch/patch.
    VerbUse("argo-executor", "argoproj.io", "workflowtaskresults", "create", "report a step's outputs"),
    VerbUse("argo-executor", "argoproj.io", "workflowtaskresults", "patch", "update a step's outputs"),
    VerbUse("train-segment", JOBSET_GROUP, JOBSET_PLURAL, "create", "create the attempt's JobSet"),
    VerbUse("train-segment", JOBSET_GROUP, JOBSET_PLURAL, "get", "read the JobSet's status for the conditions"),
    VerbUse("train-segment", JOBSET_GROUP, JOBSET_PLURAL, "watch", "wait on the JobSet's status"),
    VerbUse("train-segment", JOBSET_GROUP, JOBSET_PLURAL, "delete", "end an attempt the supervisor stopped"),
    VerbUse("train-segment", "", "pods", "list", "the gang's pods (supervisor)"),
    VerbUse("train-segment", "", "pods", "watch", "follow the gang's pods (supervisor)"),
    VerbUse("train-segment", "", "pods", "delete", "force-delete a pod stuck Terminating on a lost node"),
    VerbUse("train-segment", "batch", "jobs", "list", "the JobSet's Jobs (supervisor)"),
    VerbUse("train-segment", "batch", "jobs", "watch", "a Job's FailureTarget ends the attempt before JobSet"),
    VerbUse("train-segment", "", "events", "list", "a Job's FailedCreate: the API refused the gang's pods"),
    VerbUse("train-segment", "", "nodes", "get", "a worker node's Ready condition", cluster_scoped=True),
    VerbUse("provision-slice", JOBSET_GROUP, JOBSET_PLURAL, "list", "find the JobSets earlier attempts left"),
    VerbUse("provision-slice", JOBSET_GROUP, JOBSET_PLURAL, "delete", "tear down earlier attempts' gangs"),
    VerbUse("provision-slice", "", "pods", "list", "wait until earlier workers are gone; pods on the slice"),
    VerbUse("provision-slice", "", "nodes", "list", "check the slice's nodes", cluster_scoped=True),
    VerbUse("classify-failure", JOBSET_GROUP, JOBSET_PLURAL, "get", "read the attempt's JobSet and its conditions"),
    VerbUse("classify-failure", "", "pods", "list", "read the workers' pod statuses"),
    VerbUse("classify-failure", "batch", "jobs", "list", "read the JobSet's Jobs and their conditions"),
    VerbUse("classify-failure", "", "events", "list", "read the warning events of the workers' pods and Jobs"),
    VerbUse("classify-failure", "", "nodes", "get", "read the condition of a worker's node", cluster_scoped=True),
    VerbUse("validate-config", "argoproj.io", "workflows", "get", "is the run lease's holder workflow still there"),
    VerbUse("validate-config", JOBSET_GROUP, JOBSET_PLURAL, "get", "continue at an attempt whose gang still runs"),
    VerbUse("hand-over", "argoproj.io", "workflows", "get", "read this Workflow's spec to continue it"),
    VerbUse("hand-over", "argoproj.io", "workflows", "create", "start the run's continuation Workflow"),
    VerbUse("give-up", "argoproj.io", "workflows", "get", "read its Workflow's description before it adds its own"),
    VerbUse("give-up", "argoproj.io", "workflows", "patch", "label its Workflow; stop it when argo retry replays it"),
    VerbUse("validate-config", "argoproj.io", "workflows", "patch", "take a resubmitted give-up's label off its own"),
    VerbUse("preflight", "", "namespaces", "get", "check the run's namespace exists", cluster_scoped=True),
    VerbUse("preflight", "", "serviceaccounts", "get", "check the steps' and workers' ServiceAccounts exist"),
    # Only ever with dryRun=All; no power the steps lack: a JobSet they create makes pods of any spec in the namespace.
    VerbUse("preflight", "", "pods", "create", "a dry run of one worker pod through admission (never stored)"),
    # The run lease (recovery_steps.lease): the cluster id is kube-system's uid; a holder's Workflow is read by name.
    VerbUse("validate-config", "", "namespaces", "get", "the lease's cluster id: kube-system uid", cluster_scoped=True),
    VerbUse("provision-slice", "", "namespaces", "get", "the lease's cluster id: kube-system uid", cluster_scoped=True),
    VerbUse("provision-slice", "argoproj.io", "workflows", "get", "is the run lease's holder workflow still there"),
    VerbUse("exit-handler", JOBSET_GROUP, JOBSET_PLURAL, "list", "find the gang of a run that ends not Succeeded"),
    VerbUse("exit-handler", JOBSET_GROUP, JOBSET_PLURAL, "delete", "stop the gang of a stopped or failed run"),
)


def continuation_name(run_id: str, attempt: int) -> str:
    """The deterministic name of the Workflow that continues run ``run_id`` from ``attempt``.

    Deterministic so that a retried hand-over finds the Workflow it created instead of making a second one
    (at most 40 + 8 characters: within the 63 that Argo's pod labels allow for a Workflow name).
    """
    return f"{run_id}-c{attempt}"


def jobset_name(run_id: str, attempt: int | str) -> str:
    """The deterministic JobSet name of an attempt, the one place it is spelled.

    classify-failure finds the JobSet by this name even when the step that created it saved no outputs.

    ``attempt`` may be an Argo expression (``{{inputs.parameters.attempt}}``) where the template names it.
    """
    return f"{run_id}-a{attempt}"


POD_NAME_MAX = 63
"""Longest worker pod name JobSet admits, the Job controller's random suffix included (a DNS-1035 label)."""


def longest_pod_name(run_id: str, attempt: int | str, hosts: int, replicated_job: str = "workers") -> str:
    """The longest worker pod name of an attempt, as JobSet's admission webhook checks it.

    kubernetes-sigs/jobset v0.12.0 ``pkg/webhooks/jobset_webhook.go`` (``ValidateCreate``, lines 243-254) refuses a
    JobSet (422) unless ``placement.GenPodName(jobset, replicatedJob, maxJobIndex, maxPodIndex) + "-abcde"`` (the
    Job controller's 5-character random pod suffix) is a DNS-1035 label of at most 63 characters; ``GenPodName``
    is ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>`` (``pkg/util/placement/placement.go``). The run's
    JobSet has one Job (index 0) of ``hosts`` pods (indices 0 to hosts-1) in the replicated job ``workers``
    (``jaxrec/model/jobset.py`` ``REPLICATED_JOB``).
    """
    return f"{jobset_name(run_id, attempt)}-{replicated_job}-0-{hosts - 1}-abcde"


def gke_node_selector(slice_cfg: Any) -> dict[str, str]:
    """Node labels (name -> value, in a stable order) a ``SliceConfig``'s TPU pods select; empty for the CPU slice.

    The JobSet's ``nodeSelector`` and the node check of ``provision-slice`` both use this, so the
    slice that is checked is the slice the pods land on.
    """
    if slice_cfg.is_cpu:
        return {}
    from jaxrec.model.tpu import TPU_TYPES

    sel = {
        TPU_ACCELERATOR_LABEL: TPU_TYPES[slice_cfg.accelerator].gke_accelerator,
        TPU_TOPOLOGY_LABEL: slice_cfg.topology,
    }
    if slice_cfg.spot:
        sel[SPOT_LABEL] = "true"
    if slice_cfg.reservation:
        sel[RESERVATION_LABEL] = slice_cfg.reservation
    return sel


TERMINATION_LOG = Path("/dev/termination-log")
"""The file the kubelet mounts in every container (``terminationMessagePath``'s default): what a container writes
there becomes its terminated state's ``message`` (the kubelet keeps its last 4096 bytes), which Argo appends to the
failed node's message in its UI (workflow/controller/operator.go ``inferFailedReason``, v4.0.5)."""

STANDBY_ENV = "TRAINER_STANDBY"
"""Set by a worker's agent (``trainer.agent``) on a trainer it starts ahead of a restart in place: the process
imports what every trainer imports, then waits for one JSON line on its stdin, the flags its attempt runs with
(``{"--attempt": "4", "--restore-step": "100"}``); an empty stdin ends it. It opens no device before that line."""
STANDBY_COMM = "trainer-standby"
"""A standby's process name (``/proc/<pid>/comm``) until its flags come: what finds "the trainer" of a pod by its
command line (``python -m trainer``, the same for both) passes it over."""

TERMINATION_LOG_ENV = "TRAINER_TERMINATION_LOG"
"""A container's terminationMessagePath when not the kubelet's /dev/termination-log (the local slice gives each worker
its own file, as the kubelet gives each container its own, and so does the tier's process kubelet to every pod);
``trainer.__main__`` writes a fatal signal's stacks there, a failed step its one-line reason (``step.say_why``), and
what runs the container reads it back as the container's termination message."""


def termination_log() -> Path | None:
    """The container's termination-message file, None for a process outside a pod.

    The file ``TRAINER_TERMINATION_LOG`` names, else the kubelet's where it exists.
    """
    import os

    named = os.environ.get(TERMINATION_LOG_ENV)
    if named:
        return Path(named)
    return TERMINATION_LOG if TERMINATION_LOG.exists() else None
