"""A small Kubernetes API at its HTTP boundary: JobSets, Jobs, pods and nodes with list, watch and delete.

Objects carry ``metadata.resourceVersion`` from one counter, as the API server's do; a watch returns
the events after the version it asks for as newline-delimited JSON (``{"type": "ADDED", "object":
...}``) and ends; a version older than the compaction horizon gets an ``ERROR`` event with a 410
``Status``, as the API server sends (kubernetes API concepts, "Efficient detection of changes").
Each pods watch request first applies the next step of ``script``: the cluster moves on as the
supervisor watches it, without sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlparse

from support.fake_http import JsonServer, Stream

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
INDEX = "batch.kubernetes.io/job-completion-index"


def iso(t: float) -> str:
    """Epoch seconds as the API's RFC 3339 timestamps."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``metav1.Status`` body."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


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


class FakeCluster:
    """JobSets, Jobs, pods (namespaced) and nodes, with resource versions and watch events."""

    COLLECTIONS = ("jobsets", "jobs", "pods")

    def __init__(self, script: list[Callable[[FakeCluster], None]] | None = None, *, namespace: str = "training"):
        self.ns = namespace
        self.rv = 100
        self.objects: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in self.COLLECTIONS}
        self.events: dict[str, list[tuple[int, str, dict[str, Any]]]] = {c: [] for c in self.COLLECTIONS}
        self.compacted: dict[str, int] = dict.fromkeys(self.COLLECTIONS, 0)
        self.nodes: dict[str, dict[str, Any]] = {}
        self.script = list(script or [])
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        self.lock = threading.RLock()
        self.on_create: Callable[[FakeCluster, dict[str, Any]], None] | None = None
        # (status, body) every create answers instead (an admission webhook failing closed, a 429, RBAC).
        self.fail_create: tuple[int, dict[str, Any]] | None = None
        self.server = JsonServer(self.route)
        self.url = self.server.url

    def close(self) -> None:
        """Stop the server."""
        self.server.close()

    # -- mutations (tests and scripts) --

    def put(self, coll: str, obj: dict[str, Any]) -> None:
        """Create or replace an object; emits ADDED or MODIFIED."""
        with self.lock:
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)
            kind = "MODIFIED" if obj["metadata"]["name"] in self.objects[coll] else "ADDED"
            self.objects[coll][obj["metadata"]["name"]] = obj
            self.events[coll].append((self.rv, kind, obj))

    def remove(self, coll: str, name: str) -> None:
        """Delete an object; emits DELETED."""
        with self.lock:
            obj = self.objects[coll].pop(name, None)
            if obj is not None:
                self.rv += 1
                obj["metadata"]["resourceVersion"] = str(self.rv)
                self.events[coll].append((self.rv, "DELETED", obj))

    def compact(self, coll: str) -> None:
        """Forget the event history of ``coll``: an older resourceVersion now gets 410 Gone."""
        with self.lock:
            self.rv += 1
            self.compacted[coll] = self.rv

    def requests_of(self, method: str, fragment: str) -> list[tuple[str, str, dict[str, Any]]]:
        """The requests made with ``method`` whose path contains ``fragment``."""
        return [r for r in self.requests if r[0] == method and fragment in r[1]]

    # -- the API --

    def _list(self, coll: str, q: dict[str, list[str]]) -> tuple[int, Any]:
        sel = (q.get("labelSelector") or [""])[0]
        field = (q.get("fieldSelector") or [""])[0]

        def match(o: dict[str, Any]) -> bool:
            if sel:
                k, _, v = sel.partition("=")
                if (o["metadata"].get("labels") or {}).get(k) != v:
                    return False
            if field.startswith("metadata.name="):
                return o["metadata"]["name"] == field.split("=", 1)[1]
            return True

        if (q.get("watch") or ["false"])[0].lower() in ("true", "1"):
            rv = int((q.get("resourceVersion") or ["0"])[0] or 0)
            if rv < self.compacted[coll]:
                gone = status(410, "Expired", f"too old resource version: {rv}")
                return 200, Stream([{"type": "ERROR", "object": gone}])
            evs = [{"type": t, "object": o} for v, t, o in self.events[coll] if v > rv and match(o)]
            return 200, Stream(evs)
        items = [o for o in self.objects[coll].values() if match(o)]
        kind = {"jobsets": "JobSetList", "jobs": "JobList", "pods": "PodList"}[coll]
        return 200, {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}, "items": items}

    def route(self, method: str, raw: str, body: dict[str, Any]) -> tuple[int, Any]:
        """Answer one request."""
        u = urlparse(raw)
        q = parse_qs(u.query)
        parts = u.path.strip("/").split("/")
        with self.lock:
            self.requests.append((method, raw, body))
            coll = next((c for c in self.COLLECTIONS if c in parts), None)
            if u.path.startswith("/api/v1/nodes/"):
                n = self.nodes.get(parts[-1])
                return (200, n) if n else (404, status(404, "NotFound", f'nodes "{parts[-1]}" not found'))
            if coll is None:
                return 404, status(404, "NotFound", "the server could not find the requested resource")
            tail = parts[parts.index(coll) + 1 :]
            if method == "GET" and not tail:
                if coll == "pods" and (q.get("watch") or [""])[0] and self.script:
                    self.script.pop(0)(self)
                return self._list(coll, q)
            if method == "GET":
                o = self.objects[coll].get(tail[0])
                return (200, o) if o else (404, status(404, "NotFound", f'{coll} "{tail[0]}" not found'))
            if method == "POST":
                if self.fail_create is not None:
                    return self.fail_create
                name = body["metadata"]["name"]
                if name in self.objects[coll]:
                    return 409, status(409, "AlreadyExists", f'{coll} "{name}" already exists')
                obj = {**body, "metadata": {**body["metadata"], "creationTimestamp": iso(_now()), "uid": "js-uid"}}
                obj["status"] = {}
                self.put(coll, obj)
                if self.on_create:
                    self.on_create(self, obj)
                return 201, obj
            if method == "DELETE":
                o = self.objects[coll].get(tail[0])
                if o is None:
                    return 404, status(404, "NotFound", f'{coll} "{tail[0]}" not found')
                if coll == "pods" and (q.get("gracePeriodSeconds") or [""])[0] == "0":
                    self.remove("pods", tail[0])
                elif coll == "jobsets":
                    self._delete_gang(tail[0])
                return 200, o
        return 405, status(405, "MethodNotAllowed", method)

    def _delete_gang(self, jobset: str) -> None:
        """What the garbage collector does: pods on live nodes go; pods on lost nodes stay Terminating."""
        for name, p in list(self.objects["pods"].items()):
            if p["metadata"]["labels"].get(JOBSET_NAME_LABEL) != jobset:
                continue
            n = self.nodes.get(p["spec"].get("nodeName") or "")
            lost = n is not None and n["status"]["conditions"][0]["status"] != "True"
            if lost:
                p = {
                    **p,
                    "metadata": {**p["metadata"], "deletionTimestamp": iso(_now()), "deletionGracePeriodSeconds": 30},
                }
                self.put("pods", p)
            else:
                self.remove("pods", name)
        for name in list(self.objects["jobs"]):
            self.remove("jobs", name)
        self.remove("jobsets", jobset)


def _now() -> float:
    import time

    return time.time()
