"""Kubernetes client factory and the GKE label names shared by the JobSet and ``provision-slice``."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Labels every object of a run carries (Workflow, JobSet, pods) so that steps can find them.
RUN_ID_LABEL = "jaxrec/run-id"
ATTEMPT_LABEL = "jaxrec/attempt"
# A continuation Workflow names the Workflow it continues (``argo list -l jaxrec/continues=NAME``).
CONTINUES_LABEL = "jaxrec/continues"
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
MAINTENANCE_LABELS = (
    ACTIVE_MAINTENANCE_LABEL,
    SCHEDULED_MAINTENANCE_LABEL,
    "cloud.google.com/gke-tpu-maintenance",
)
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
    VerbUse("preflight", "", "namespaces", "get", "check the run's namespace exists", cluster_scoped=True),
    VerbUse("preflight", "", "serviceaccounts", "get", "check the steps' and workers' ServiceAccounts exist"),
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
    (``workflows/jobset.py`` ``REPLICATED_JOB``).
    """
    return f"{jobset_name(run_id, attempt)}-{replicated_job}-0-{hosts - 1}-abcde"


def gke_node_selector(slice_cfg: Any) -> dict[str, str]:
    """Node labels a TPU slice's pods select (empty for the local backend).

    The JobSet's ``nodeSelector`` and the node check of ``provision-slice`` both use this, so the
    slice that is checked is the slice the pods land on.

    Args:
        slice_cfg: A ``SliceConfig``.

    Returns:
        Label name -> value, in a stable order.
    """
    if slice_cfg.is_local:
        return {}
    from recovery_steps.kernel.tpu import TPU_TYPES

    sel = {
        TPU_ACCELERATOR_LABEL: TPU_TYPES[slice_cfg.accelerator].gke_accelerator,
        TPU_TOPOLOGY_LABEL: slice_cfg.topology,
    }
    if slice_cfg.spot:
        sel[SPOT_LABEL] = "true"
    if slice_cfg.reservation:
        sel[RESERVATION_LABEL] = slice_cfg.reservation
    return sel


# Client-side timeouts: the API server's watch timeoutSeconds does not protect a half-open connection (after a
# control-plane upgrade a watch can hang forever: kubernetes-client/python#1148, #2462 and its
# examples/watch/timeout-settings.md). Every call passes one of these as ``_request_timeout``.
API_TIMEOUT_S = 30
CONNECT_TIMEOUT_S = 10


def api_exit_code(e: BaseException) -> int:
    """The one mapping of a Kubernetes API failure to a step's exit code.

    429 (API priority and fairness), 5xx (a webhook that fails closed while its controller restarts answers 500
    "failed calling webhook"; jobset v0.12.0 ``config/components/webhook/manifests.yaml`` has ``failurePolicy:
    Fail``), no answer at all and every transport error are transient (69, retried in place); any other refusal
    (401, 403, 404, 422, ...) is configuration (2).
    """
    from recovery_steps.kernel.contract import ExitCode

    status = getattr(e, "status", None)
    if type(e).__name__ == "ApiException" and status not in (None, 0):
        return int(ExitCode.TRANSIENT if status == 429 or status >= 500 else ExitCode.CONFIGURATION)
    return int(ExitCode.TRANSIENT)


def api_error_line(e: BaseException) -> str:
    """One line saying what the API answered (status, reason and the Status message), or how it failed."""
    status = getattr(e, "status", None)
    if type(e).__name__ == "ApiException" and status not in (None, 0):
        import json

        message = ""
        try:
            message = json.loads(getattr(e, "body", "") or "{}").get("message") or ""
        except (ValueError, AttributeError):
            pass
        detail = f": {message[:300]}" if message else ""
        return f"Kubernetes API answered {status} {getattr(e, 'reason', '')}{detail}"
    return f"Kubernetes API unreachable: {type(e).__name__}: {' '.join(str(e).split())[:200]}"


def delete_run_jobsets(
    api_client: Any, namespace: str, run_id: str, keep: Callable[[dict[str, Any]], bool] = lambda _: False
) -> tuple[list[str], list[str], list[str]]:
    """Delete the run's JobSets (label ``jaxrec/run-id``) in ``namespace`` with foreground propagation.

    Foreground: the JobSet object stays (with a deletionTimestamp) until its Jobs and their pods are gone, so
    ``kubectl get jobsets`` shows the gang until its TPUs are free (Kubernetes "Garbage Collection"). A JobSet
    already being deleted is left alone; one that ``keep`` (given the JobSet's JSON) says to keep is not touched.

    Returns:
        The JobSets deleted now, those already being deleted, and those kept, each sorted by name.
    """
    from kubernetes import client

    custom = client.CustomObjectsApi(api_client)
    where = (JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSET_PLURAL)
    found = custom.list_namespaced_custom_object(
        *where, label_selector=f"{RUN_ID_LABEL}={run_id}", _request_timeout=API_TIMEOUT_S
    )
    deleted: list[str] = []
    going: list[str] = []
    kept: list[str] = []
    for item in sorted(found.get("items", []), key=lambda i: i["metadata"]["name"]):
        name = item["metadata"]["name"]
        if item["metadata"].get("deletionTimestamp"):
            going.append(name)
            continue
        if keep(item):
            kept.append(name)
            continue
        foreground = client.V1DeleteOptions(propagation_policy="Foreground")
        try:
            custom.delete_namespaced_custom_object(*where, name, body=foreground, _request_timeout=API_TIMEOUT_S)
        except client.ApiException as e:
            if e.status != 404:  # 404: gone in between
                raise
            continue
        deleted.append(name)
    return deleted, going, kept


IN_POD_ENV = "KUBERNETES_SERVICE_HOST"
"""Set by the kubelet in every container of every pod (Kubernetes docs "Accessing the Kubernetes API from a Pod");
the local runner takes it out of its steps' environment."""


def in_pod() -> bool:
    """Whether this process runs in a pod of a cluster (and not as a step of the local runner)."""
    return bool(os.environ.get(IN_POD_ENV))


def uses_cluster(cfg: Any) -> bool:
    """Whether the run's steps act through the Kubernetes API.

    Always for a TPU slice; for the CPU slice (``slice.accelerator: local``) when the step runs in a pod, as when
    ``argo/local-cpu.yaml`` is submitted to a cluster, where the gang is a JobSet like any other. Only the local
    runner's steps act on local processes.
    """
    return not cfg.slice.is_local or in_pod()


def make_api_client(host: str | None = None) -> Any:
    """A kubernetes ``ApiClient``.

    Args:
        host: API server URL (tests point this at a local HTTP server). When None, the in-cluster
            service-account config is used inside a pod, otherwise the local kubeconfig.

    Returns:
        A ``kubernetes.client.ApiClient``.
    """
    from kubernetes import client, config

    if host:
        cfg = client.Configuration(host=host)
        cfg.retries = 0
        return client.ApiClient(cfg)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    """The calls the steps make to the Kubernetes API for one namespace, answered as the API's own JSON.

    Every call passes a client-side timeout (``API_TIMEOUT_S``) and asks for the raw body (``_preload_content=False``)
    so that what the steps read is exactly what the API returns, parsed once into ``kernel.snapshot`` records.
    A 404 on a read by name is None; every other refusal is the client's ``ApiException``, which
    ``api_exit_code`` maps to the step's exit code.
    """

    def __init__(self, api_client: Any, namespace: str):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.ns = namespace

    @staticmethod
    def _json(resp: Any) -> Any:
        import json

        return json.loads(resp.data)

    def _maybe(self, call: Callable[..., Any], *args: Any, **kw: Any) -> dict[str, Any] | None:
        from kubernetes.client import ApiException

        try:
            return self._json(call(*args, _preload_content=False, _request_timeout=API_TIMEOUT_S, **kw))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def get_jobset(self, name: str) -> dict[str, Any] | None:
        """The JobSet ``name``, or None when it does not exist."""
        where = (JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL)
        return self._maybe(self.custom.get_namespaced_custom_object, *where, name)

    def get_workflow(self, name: str) -> dict[str, Any] | None:
        """The Argo Workflow ``name``, or None when it does not exist."""
        return self._maybe(
            self.custom.get_namespaced_custom_object, ARGO_GROUP, ARGO_VERSION, self.ns, WORKFLOW_PLURAL, name
        )

    def create_workflow(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create an Argo Workflow; the object as created, or None when one of its name exists (409 Conflict)."""
        from kubernetes.client import ApiException

        try:
            resp = self.custom.create_namespaced_custom_object(
                ARGO_GROUP,
                ARGO_VERSION,
                self.ns,
                WORKFLOW_PLURAL,
                body,
                _preload_content=False,
                _request_timeout=API_TIMEOUT_S,
            )
        except ApiException as e:
            if e.status == 409:
                return None
            raise
        return self._json(resp)

    def get_namespace(self, name: str) -> dict[str, Any] | None:
        """The namespace ``name`` (cluster-scoped), or None when it does not exist."""
        return self._maybe(self.core.read_namespace, name)

    def get_node(self, name: str) -> dict[str, Any] | None:
        """The node ``name``, or None when the Node object is gone."""
        return self._maybe(self.core.read_node, name)

    def list_jobs(self, jobset: str, **kw: Any) -> Any:
        """The JobSet's Jobs: the list's JSON, or with ``watch=True`` the client's watch response."""
        return self.batch.list_namespaced_job(self.ns, label_selector=f"{JOBSET_NAME_LABEL}={jobset}", **kw)

    def list_pods(self, jobset: str, **kw: Any) -> Any:
        """The JobSet's pods (as ``list_jobs``)."""
        return self.core.list_namespaced_pod(self.ns, label_selector=f"{JOBSET_NAME_LABEL}={jobset}", **kw)

    def list_jobsets(self, name: str, **kw: Any) -> Any:
        """The JobSet ``name`` as a list of at most one (a watch follows one object by its name)."""
        where = (JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL)
        return self.custom.list_namespaced_custom_object(*where, field_selector=f"metadata.name={name}", **kw)

    def items(self, list_call: Callable[..., Any], name: str) -> list[dict[str, Any]]:
        """The items of one LIST (``list_jobs``, ``list_pods``) of the JobSet ``name``."""
        return self._json(list_call(name, _preload_content=False, _request_timeout=API_TIMEOUT_S)).get("items") or []

    def list_pods_where(self, label_selector: str) -> list[dict[str, Any]]:
        """The namespace's pods that match ``label_selector``."""
        resp = self.core.list_namespaced_pod(
            self.ns, label_selector=label_selector, _preload_content=False, _request_timeout=API_TIMEOUT_S
        )
        return self._json(resp).get("items") or []

    def list_nodes(self, label_selector: str) -> list[dict[str, Any]]:
        """The cluster's nodes that match ``label_selector``."""
        resp = self.core.list_node(
            label_selector=label_selector, _preload_content=False, _request_timeout=API_TIMEOUT_S
        )
        return self._json(resp).get("items") or []

    def pod_warnings(self, pod: str) -> list[str]:
        """The pod's Warning events, as 'Reason: message'."""
        return self._warnings("Pod", pod)

    def job_warnings(self, job: str) -> list[str]:
        """The Job's Warning events, as 'Reason: message' (FailedCreate: the API refused the Job's pods)."""
        return self._warnings("Job", job)

    def _warnings(self, kind: str, name: str) -> list[str]:
        sel = f"involvedObject.name={name},involvedObject.kind={kind}"
        resp = self.core.list_namespaced_event(
            self.ns, field_selector=sel, _preload_content=False, _request_timeout=API_TIMEOUT_S
        )
        items = self._json(resp).get("items") or []
        return [f"{e.get('reason')}: {e.get('message')}" for e in items if e.get("type", "Warning") == "Warning"]

    def create_jobset(self, manifest: dict[str, Any]) -> bool:
        """Create a JobSet; False when one of its name already exists (409 Conflict)."""
        from kubernetes.client import ApiException

        where = (JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL)
        try:
            self.custom.create_namespaced_custom_object(
                *where, manifest, _preload_content=False, _request_timeout=API_TIMEOUT_S
            )
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    def delete_jobset(self, name: str) -> None:
        """Delete a JobSet with foreground propagation (its Jobs and pods go first); one already gone is fine."""
        from kubernetes.client import ApiException

        where = (JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL)
        try:
            self.custom.delete_namespaced_custom_object(
                *where, name, propagation_policy="Foreground", _preload_content=False, _request_timeout=API_TIMEOUT_S
            )
        except ApiException as e:
            if e.status != 404:
                raise

    def force_delete_pod(self, name: str) -> None:
        """Delete a pod with grace period 0: the API removes it without its kubelet's confirmation."""
        from kubernetes.client import ApiException

        try:
            self.core.delete_namespaced_pod(
                name, self.ns, grace_period_seconds=0, _preload_content=False, _request_timeout=API_TIMEOUT_S
            )
        except ApiException as e:
            if e.status != 404:
                raise
