"""The fast tier's Kubernetes API: the local cluster's own API model (``workflows.local.apiserver``) with a test's
knobs, and builders of the objects the API returns.

What a test adds to the model:

- any status a test injects (5xx, 429, 403: :func:`forbidden`) with :meth:`FakeCluster.inject`, and an answer every
  create gets instead (``fail_create``: an admission webhook failing closed, a 429, RBAC);
- the requests made, to assert on (:meth:`FakeCluster.requests_of`, :meth:`FakeCluster.queries`);
- ``script``: each pods watch request first applies the next step of it, so the cluster moves on as the supervisor
  watches it, without sleeping; watches never wait for an event (a test's cluster moves only when told).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlparse

from workflows.local.apiserver import JOBSET_NAME_LABEL, ApiServer, iso, status

__all__ = ["JOBSET_NAME_LABEL", "FakeCluster", "forbidden", "iso", "node", "pod", "status"]

INDEX = "batch.kubernetes.io/job-completion-index"


def forbidden(
    verb: str,
    resource: str,
    *,
    group: str = "",
    namespace: str | None = None,
    name: str | None = None,
    user: str = "system:serviceaccount:training:jax-recovery",
) -> dict[str, Any]:
    """The 403 ``Status`` RBAC's authorizer answers a request it denies, worded as kube-apiserver v1.36 words it;
    for :meth:`FakeCluster.inject`."""
    what = f"{resource}.{group}" if group else resource
    if name:
        what += f' "{name}"'
    where = f' in the namespace "{namespace}"' if namespace else ""
    msg = f'{what} is forbidden: User "{user}" cannot {verb} resource "{resource}" in API group "{group}"{where}'
    details = {**({"name": name} if name else {}), **({"group": group} if group else {}), "kind": resource}
    return status(403, "Forbidden", msg, **details)


def pod(
    jobset: str,
    i: int,
    t: float,
    *,
    node: str | None = None,
    phase: str = "Pending",
    running: bool = False,
    unschedulable: bool = False,
    waiting: tuple[str, str] | None = None,
    exit_code: int | None = None,
    attempt: str = "0",
) -> dict[str, Any]:
    """A worker pod of a JobSet as the API returns it."""
    conds = []
    if unschedulable:
        # The scheduler's text as kube-scheduler v1.36 writes it (real-controller tier, too few TPU nodes).
        msg = (
            "0/4 nodes are available: 4 Insufficient google.com/tpu. no new claims to deallocate, preemption: "
            "0/4 nodes are available: 4 No preemption victims found for incoming pod."
        )
        conds.append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "lastTransitionTime": iso(t),
                "message": msg,
            }
        )
    elif node:
        conds.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": iso(t)})
    cs: dict[str, Any] = {"name": "trainer", "image": "worker:1", "imageID": "", "ready": running, "restartCount": 0}
    if running:
        cs["state"] = {"running": {"startedAt": iso(t)}}
        conds.append({"type": "Ready", "status": "True", "lastTransitionTime": iso(t)})
    elif exit_code is not None:
        cs["state"] = {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "startedAt": iso(t),
                "finishedAt": iso(t),
            }
        }
    elif waiting:
        cs["state"] = {"waiting": {"reason": waiting[0], "message": waiting[1]}}
    else:
        cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
    st: dict[str, Any] = {"phase": phase, "conditions": conds, "qosClass": "BestEffort"}
    if node:
        st["containerStatuses"] = [cs]
        st["hostIP"], st["startTime"] = f"10.0.0.{i + 2}", iso(t)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{jobset}-workers-0-{i}-x{i}z",
            "namespace": "training",
            "uid": f"uid-{jobset}-{i}",
            "creationTimestamp": iso(t),
            "labels": {JOBSET_NAME_LABEL: jobset, INDEX: str(i), "jaxrec/attempt": attempt},
            "annotations": {INDEX: str(i)},
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": f"{jobset}-workers-0",
                    "uid": "job-uid",
                    "controller": True,
                }
            ],
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "trainer", "image": "worker:1"}],
            "terminationGracePeriodSeconds": 30,
            "restartPolicy": "Never",
        },
        "status": st,
    }


def node(name: str, *, ready: bool | None = True, unreachable: bool = False) -> dict[str, Any]:
    """A node as the API returns it (Ready Unknown and the unreachable taint when its kubelet is gone)."""
    s = "True" if ready else ("False" if ready is False else "Unknown")
    # As the node-lifecycle controller of kube-controller-manager v1.36 leaves a node whose kubelet went silent
    # (real-controller tier): Ready Unknown with this message, and both unreachable taints.
    taints = (
        [
            {"key": "node.kubernetes.io/unreachable", "effect": e, "timeAdded": iso(0)}
            for e in ("NoSchedule", "NoExecute")
        ]
        if unreachable
        else []
    )
    cond = {
        "type": "Ready",
        "status": s,
        "reason": "NodeStatusUnknown" if not ready else "KubeletReady",
        "lastTransitionTime": iso(0),
    }
    if ready is None:
        cond["message"] = "Kubelet stopped posting node status."
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {}},
        "spec": {"taints": taints},
        "status": {"conditions": [cond]},
    }


class FakeCluster(ApiServer):
    """The API model a test drives: scripted, with faults to inject and the requests it was asked."""

    def __init__(
        self,
        script: list[Callable[[FakeCluster], None]] | None = None,
        *,
        namespace: str = "training",
        gc_per_list: int | None = None,
    ):
        self.script = list(script or [])
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        # (method or None for any, path fragment, status, body): answered instead, first match wins.
        self.faults: list[tuple[str | None, str, int, dict[str, Any]]] = []
        self.fail_create: tuple[int, dict[str, Any]] | None = None
        super().__init__(namespace=namespace, gc_per_list=gc_per_list, watch_wait_s=0)

    def inject(self, fragment: str, code: int, body: dict[str, Any], *, method: str | None = None) -> None:
        """Answer ``code`` and ``body`` to every request (of ``method``; any when None) whose path contains
        ``fragment``, until ``faults`` is cleared: the API server timing out (503, 504), throttling (429), failing
        (500), refusing (403)."""
        self.faults.append((method, fragment, code, body))

    def requests_of(self, method: str, fragment: str) -> list[tuple[str, str, dict[str, Any]]]:
        """The requests made with ``method`` whose path contains ``fragment``."""
        return [r for r in self.requests if r[0] == method and fragment in r[1]]

    def queries(self, method: str, path: str) -> list[dict[str, str]]:
        """The query parameters (the first value of each) of every ``method`` request on exactly ``path``."""
        asked = [urlparse(raw) for m, raw, _ in self.requests if m == method]
        return [{k: v[0] for k, v in parse_qs(u.query).items()} for u in asked if u.path == path]

    def intercept(self, method: str, raw: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        """Record the request; answer an injected fault or ``fail_create``; step the script on a pods watch."""
        self.requests.append((method, raw, body))
        u = urlparse(raw)
        for m, fragment, code, answer in self.faults:
            if m in (None, method) and fragment in u.path:
                return code, answer
        if method == "POST" and self.fail_create is not None and "selfsubjectaccessreviews" not in u.path:
            return self.fail_create
        q = parse_qs(u.query)
        watching = (q.get("watch") or [""])[0].lower() in ("true", "1")
        if method == "GET" and watching and u.path.endswith("/pods") and self.script:
            self.script.pop(0)(self)
        return None
