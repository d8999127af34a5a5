"""The steps' Kubernetes client.

One factory, one mapping of API failures to exit codes and lines, and the calls the steps make (``Kube``), each
with a client-side timeout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from jaxrec.model.names import (
    ARGO_GROUP,
    ARGO_VERSION,
    JOBSET_GROUP,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    RUN_ID_LABEL,
    WORKFLOW_PLURAL,
)

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
    from jaxrec.model.contract import ExitCode

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


K8S_HOST_ENV = "JAXREC_K8S_HOST"
"""The API server's address when no ``host`` is given and the process is in no pod: ``http(s)://...``, or
``unix:///path`` for one served on a unix socket (the local runner serves its cluster's there: a machine may let no
process open a TCP socket, even on loopback)."""


def make_api_client(host: str | None = None) -> Any:
    """A ``kubernetes.client.ApiClient`` for ``host`` (``http(s)://`` or ``unix:///path``).

    When ``host`` is None: in a pod the in-cluster service-account config, else ``$JAXREC_K8S_HOST`` when set,
    else the local kubeconfig.
    """
    from kubernetes import client, config

    host = host or (None if in_pod() else os.environ.get(K8S_HOST_ENV)) or None
    if host:
        sock = host.removeprefix("unix://") if host.startswith("unix://") else None
        cfg = client.Configuration(host="http://localhost" if sock else host)
        cfg.retries = 0
        api = client.ApiClient(cfg)
        if sock:
            api.rest_client.pool_manager = _unix_pool_manager(sock)
        return api
    if in_pod():
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return client.ApiClient()


def _unix_pool_manager(path: str) -> Any:
    """A urllib3 pool manager whose every connection is to the unix socket ``path`` (HTTP over it)."""
    import socket

    import urllib3
    from urllib3.connection import HTTPConnection
    from urllib3.connectionpool import HTTPConnectionPool

    class UnixConnection(HTTPConnection):
        def _new_conn(self) -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if isinstance(self.timeout, int | float):
                sock.settimeout(self.timeout)
            sock.connect(path)
            return sock

    class UnixPool(HTTPConnectionPool):
        ConnectionCls = UnixConnection

    manager = urllib3.PoolManager(num_pools=2, maxsize=8)
    manager.pool_classes_by_scheme = {"http": UnixPool, "https": UnixPool}
    return manager


class Kube:
    """The calls the steps make to the Kubernetes API for one namespace, answered as the API's own JSON.

    Every call passes a client-side timeout (``API_TIMEOUT_S``) and asks for the raw body (``_preload_content=False``)
    so that what the steps read is exactly what the API returns, parsed once into ``model.snapshot`` records.
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

    @staticmethod
    def _send(call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return call(*args, _preload_content=False, _request_timeout=API_TIMEOUT_S, **kw)

    def _get(self, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return self._json(self._send(call, *args, **kw))

    def _unless(self, status: int, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """The call's raw response, or None when the API answers ``status`` (404: not there, 409: exists)."""
        from kubernetes.client import ApiException

        try:
            return self._send(call, *args, **kw)
        except ApiException as e:
            if e.status == status:
                return None
            raise

    def _maybe(self, call: Callable[..., Any], *args: Any, **kw: Any) -> dict[str, Any] | None:
        resp = self._unless(404, call, *args, **kw)
        return None if resp is None else self._json(resp)

    @property
    def _jobsets(self) -> tuple[str, str, str, str]:
        return (JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL)

    @property
    def _workflows(self) -> tuple[str, str, str, str]:
        return (ARGO_GROUP, ARGO_VERSION, self.ns, WORKFLOW_PLURAL)

    def get_jobset(self, name: str) -> dict[str, Any] | None:
        """The JobSet ``name``, or None when it does not exist."""
        return self._maybe(self.custom.get_namespaced_custom_object, *self._jobsets, name)

    def get_workflow(self, name: str) -> dict[str, Any] | None:
        """The Argo Workflow ``name``, or None when it does not exist."""
        return self._maybe(self.custom.get_namespaced_custom_object, *self._workflows, name)

    def create_workflow(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create an Argo Workflow; the object as created, or None when one of its name exists (409 Conflict)."""
        resp = self._unless(409, self.custom.create_namespaced_custom_object, *self._workflows, body)
        return None if resp is None else self._json(resp)

    def patch_workflow(self, name: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        """Merge-patch the Workflow ``name``; the Workflow as patched, or None when it does not exist."""
        return self._maybe(self.custom.patch_namespaced_custom_object, *self._workflows, name, patch)

    def stop_workflow(self, name: str) -> dict[str, Any] | None:
        """Set the Workflow's ``spec.shutdown`` to ``Stop``; the Workflow as patched, or None when it does not exist.

        The merge patch ``argo stop`` sends (argo-workflows v4.0.5 ``workflow/util/util.go``,
        ``patchShutdownStrategy``): Argo fails what still runs and runs the exit handler.
        """
        return self.patch_workflow(name, {"spec": {"shutdown": "Stop"}})

    def get_namespace(self, name: str) -> dict[str, Any] | None:
        """The namespace ``name`` (cluster-scoped), or None when it does not exist."""
        return self._maybe(self.core.read_namespace, name)

    def get_node(self, name: str) -> dict[str, Any] | None:
        """The node ``name``, or None when the Node object is gone."""
        return self._maybe(self.core.read_node, name)

    def get_service_account(self, name: str) -> dict[str, Any] | None:
        """The namespace's ServiceAccount ``name``, or None when it does not exist."""
        return self._maybe(self.core.read_namespaced_service_account, name, self.ns)

    def jobsets_served(self) -> bool:
        """Whether the API serves JobSets in the namespace (a LIST of at most one answers 404 without the CRD)."""
        return self._maybe(self.custom.list_namespaced_custom_object, *self._jobsets, limit=1) is not None

    def can(self, verb: str, resource: str, group: str = "", *, cluster_scoped: bool = False) -> bool:
        """Whether this client's identity may ``verb`` ``resource`` here.

        A SelfSubjectAccessReview, which every authenticated identity may create (authorization.k8s.io/v1).
        """
        from kubernetes import client

        attributes = {"group": group, "resource": resource, "verb": verb}
        if not cluster_scoped:
            attributes["namespace"] = self.ns
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        review = self._get(client.AuthorizationV1Api(self.core.api_client).create_self_subject_access_review, body)
        return bool((review.get("status") or {}).get("allowed"))

    def dry_run_pod(self, body: dict[str, Any]) -> None:
        """Create the pod ``body`` with ``dryRun=All``: admitted and validated, never stored; a refusal raises."""
        self._send(self.core.create_namespaced_pod, self.ns, body, dry_run="All")

    def list_jobs(self, jobset: str, **kw: Any) -> Any:
        """The JobSet's Jobs: the list's JSON, or with ``watch=True`` the client's watch response."""
        return self.batch.list_namespaced_job(self.ns, label_selector=f"{JOBSET_NAME_LABEL}={jobset}", **kw)

    def list_pods(self, jobset: str, **kw: Any) -> Any:
        """The JobSet's pods (as ``list_jobs``)."""
        return self.core.list_namespaced_pod(self.ns, label_selector=f"{JOBSET_NAME_LABEL}={jobset}", **kw)

    def list_jobsets(self, name: str, **kw: Any) -> Any:
        """The JobSet ``name`` as a list of at most one (a watch follows one object by its name)."""
        return self.custom.list_namespaced_custom_object(*self._jobsets, field_selector=f"metadata.name={name}", **kw)

    def items(self, list_call: Callable[..., Any], name: str) -> list[dict[str, Any]]:
        """The items of one LIST (``list_jobs``, ``list_pods``) of the JobSet ``name``."""
        return self._get(list_call, name).get("items") or []

    def list_pods_where(self, label_selector: str) -> list[dict[str, Any]]:
        """The namespace's pods that match ``label_selector``."""
        return self._get(self.core.list_namespaced_pod, self.ns, label_selector=label_selector).get("items") or []

    def list_nodes(self, label_selector: str) -> list[dict[str, Any]]:
        """The cluster's nodes that match ``label_selector``."""
        return self._get(self.core.list_node, label_selector=label_selector).get("items") or []

    def pod_warnings(self, pod: str) -> list[str]:
        """The pod's Warning events, as 'Reason: message'."""
        return self._warnings("Pod", pod)

    def job_warnings(self, job: str) -> list[str]:
        """The Job's Warning events, as 'Reason: message' (FailedCreate: the API refused the Job's pods)."""
        return self._warnings("Job", job)

    def _warnings(self, kind: str, name: str) -> list[str]:
        sel = f"involvedObject.name={name},involvedObject.kind={kind}"
        items = self._get(self.core.list_namespaced_event, self.ns, field_selector=sel).get("items") or []
        return [f"{e.get('reason')}: {e.get('message')}" for e in items if e.get("type", "Warning") == "Warning"]

    def create_jobset(self, manifest: dict[str, Any]) -> bool:
        """Create a JobSet; False when one of its name already exists (409 Conflict)."""
        return self._unless(409, self.custom.create_namespaced_custom_object, *self._jobsets, manifest) is not None

    def delete_jobset(self, name: str) -> None:
        """Delete a JobSet with foreground propagation (its Jobs and pods go first); one already gone is fine."""
        self._unless(
            404, self.custom.delete_namespaced_custom_object, *self._jobsets, name, propagation_policy="Foreground"
        )

    def force_delete_pod(self, name: str) -> None:
        """Delete a pod with grace period 0: the API removes it without its kubelet's confirmation."""
        self._unless(404, self.core.delete_namespaced_pod, name, self.ns, grace_period_seconds=0)
