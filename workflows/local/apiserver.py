"""The local cluster's Kubernetes API: one model of the API objects, served over HTTP on this machine alone.

One model of the objects the steps read and write (pods, nodes, namespaces, service accounts, events, Jobs,
JobSets, Argo Workflows), answered as kube-apiserver v1.36 answers them:

- get, list (label and field selectors), watch, create, patch and delete, on the paths the API server serves
  (``/api/v1/...``, ``/apis/<group>/<version>/...``, namespaced and cluster-scoped);
- failures as ``metav1.Status`` bodies: 404 NotFound (an object, or a resource the server does not serve, as
  when a CRD is not installed), 409 AlreadyExists, 422 Invalid, 400 BadRequest;
- SelfSubjectAccessReviews, answered from the verbs ``denied`` names (none: everything is allowed);
- a pod's eviction (``POST .../pods/<name>/eviction``, no PodDisruptionBudget here): the pod gets the
  ``DisruptionTarget`` condition the API server stamps and is deleted with its grace (kubernetes
  ``pkg/registry/core/pod/storage/eviction.go``, ``addConditionAndDeletePod``), answered 201 ``Success``.

Objects carry ``metadata.resourceVersion`` from one counter, as the API server's do; a watch returns the events
after the version it asks for as newline-delimited JSON (``{"type": "ADDED", "object": ...}``) and ends, waiting
up to ``watch_wait_s`` (and the request's ``timeoutSeconds``) for a first one; a version older than the
compaction horizon gets an ``ERROR`` event with a 410 ``Status``, as the API server sends (kubernetes API concepts,
"Efficient detection of changes").

Deleting a JobSet hands its Jobs and pods to the garbage collector, by the request's ``propagationPolicy``
(query or DeleteOptions body), as kube-controller-manager v1.36's does (Kubernetes docs "Garbage Collection"):

- ``Background`` (what a custom resource gets when none is asked): the JobSet and its Jobs go at once, their pods
  after;
- ``Foreground``: the JobSet stays, with ``deletionTimestamp`` and the ``foregroundDeletion`` finalizer, until none
  of its Jobs and pods is left, then goes;
- ``Orphan``: the JobSet goes, its Jobs and pods stay.

The collector is asynchronous in a real cluster: the pods go some time after the DELETE was answered, a few at a
time. ``gc_per_list`` sets its pace here: None (the default), it finishes within the DELETE request (a collector
faster than any poll); n, it removes n more of the deleted JobSets' pods after each pods LIST is answered, so a
caller that polls for them sees them go. A pod on a lost node stays Terminating either way (its kubelet cannot
confirm it) until it is deleted with ``gracePeriodSeconds=0``; the Jobs, and a foreground-deleted JobSet, go when
the last of their pods has. ``on_create`` and ``on_delete`` let the local cluster's controllers act on what the
API was asked (a JobSet created, a JobSet or pod deleted), as real controllers act on their watches.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import socketserver
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
# How long a watch with nothing to send waits for a first event before it ends (the client watches again).
WATCH_WAIT_S = 5.0


def iso(t: float) -> str:
    """Epoch seconds as the API's RFC 3339 timestamps."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    """A ``metav1.Status`` body; ``details`` (name, group, kind, causes, retryAfterSeconds) when given."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


class Stream:
    """A response body sent as newline-delimited JSON, then the connection closes (a watch that ended)."""

    def __init__(self, events: list[dict[str, Any]]):
        self.events = events


Route = Callable[[str, str, dict[str, Any]], tuple[int, Any]]
"""``route(method, raw_path, request_body) -> (status, response body)``."""


class _Quiet:
    """A client gone before its answer (a watcher whose process was killed) is no error of the server."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[misc]


class _UnixHttpServer(_Quiet, socketserver.ThreadingUnixStreamServer):
    pass


class _TcpHttpServer(_Quiet, ThreadingHTTPServer):
    pass


class JsonServer:
    """Serves GET, POST, PATCH and DELETE, answering each request with ``route``.

    On 127.0.0.1 (any free port), or on the unix socket ``socket_path`` (``url`` is then ``unix://<path>``).
    """

    def __init__(self, route: Route, socket_path: str | None = None):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                code, payload = route(self.command, self.path, body)
                if isinstance(payload, Stream):
                    # No Content-Length: the client reads lines until the server closes (HTTP/1.0 here).
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    for ev in payload.events:
                        self.wfile.write(json.dumps(ev).encode() + b"\n")
                    return
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_DELETE = do_POST = do_PATCH = _answer

        self.socket_path = socket_path
        if socket_path is not None:
            self.server: socketserver.BaseServer = _UnixHttpServer(socket_path, Handler)
            self.url = f"unix://{socket_path}"
        else:
            tcp = _TcpHttpServer(("127.0.0.1", 0), Handler)
            self.server, self.url = tcp, f"http://127.0.0.1:{tcp.server_port}"
        threading.Thread(target=self.server.serve_forever, name="kube-api", daemon=True).start()

    def close(self) -> None:
        """Stop serving and free the port (or remove the socket)."""
        self.server.shutdown()
        self.server.server_close()
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)


@dataclass(frozen=True)
class Resource:
    """A resource the API server serves: its group/version, its kind, and whether its objects live in a namespace."""

    api_version: str
    kind: str
    namespaced: bool = True
    status_subresource: bool = True  # a create drops the body's ``status`` (only the status subresource writes it)

    @property
    def group(self) -> str:
        """The API group ("" for the core group)."""
        return self.api_version.rpartition("/")[0]


RESOURCES = {
    "pods": Resource("v1", "Pod"),
    "events": Resource("v1", "Event", status_subresource=False),
    "serviceaccounts": Resource("v1", "ServiceAccount", status_subresource=False),
    "nodes": Resource("v1", "Node", namespaced=False),
    "namespaces": Resource("v1", "Namespace", namespaced=False),
    "jobs": Resource("batch/v1", "Job"),
    "jobsets": Resource("jobset.x-k8s.io/v1alpha2", "JobSet"),
    # Argo's Workflow CRD has no status subresource: the controller writes status with the object.
    "workflows": Resource("argoproj.io/v1alpha1", "Workflow", status_subresource=False),
}
REVIEWS = "selfsubjectaccessreviews"  # authorization.k8s.io/v1, created and answered, never stored
NOT_ALLOWED = "the server does not allow this method on the requested resource"


@dataclass(frozen=True)
class Where:
    """What a request path names: ``/api/v1[/namespaces/<ns>]/<resource>[/<name>]`` or ``/apis/<g>/<v>/...``."""

    api_version: str
    resource: str
    namespace: str | None = None
    name: str | None = None


_EVICTION = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction")


def parse_path(path: str) -> Where | None:
    """The resource, namespace and name a path asks for; None when it is no resource path."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "api":
        api_version, rest = parts[1], parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        api_version, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
    ns = None
    if len(rest) >= 3 and rest[0] == "namespaces":  # /namespaces/<ns> alone is the Namespace object
        ns, rest = rest[1], rest[2:]
    if len(rest) > 2:
        return None  # a subresource (status, log, exec): none is served here
    return Where(api_version, rest[0], ns, rest[1] if len(rest) > 1 else None)


def _terms(selector: str) -> list[str]:
    """The comma-separated requirements of a selector (commas inside ``in (a,b)`` belong to their set)."""
    return [t.strip() for t in re.split(r",(?![^(]*\))", selector) if t.strip()]


def labels_match(selector: str, labels: dict[str, str]) -> bool:
    """Whether ``labels`` satisfy a label selector.

    ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (..)``, ``k notin (..)`` (apimachinery's labels.Parse;
    ``!=`` and ``notin`` match an absent key).
    """
    for term in _terms(selector):
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term):
            key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",")}
            if (labels.get(key) in values) != (op == "in"):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def fields_match(selector: str, obj: dict[str, Any]) -> bool:
    """Whether ``obj`` satisfies a field selector.

    ``path=v``, ``path==v``, ``path!=v`` on dotted paths such as ``metadata.name`` or ``involvedObject.kind`` (an
    absent field reads as the empty string).
    """
    for term in _terms(selector):
        negate = "!=" in term
        path, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
        field: Any = obj
        for key in path.strip().split("."):
            field = field.get(key) if isinstance(field, dict) else None
        if ((field if field is not None else "") == value.strip()) == negate:
            return False
    return True


def _flag(q: dict[str, list[str]], key: str) -> str:
    return (q.get(key) or [""])[0]


def _watching(q: dict[str, list[str]]) -> bool:
    return _flag(q, "watch").lower() in ("true", "1")


def _merged(target: Any, patch: Any) -> Any:
    """``target`` with the JSON merge patch ``patch`` applied (RFC 7386)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merged(out.get(k), v)
    return out


class ApiServer:
    """The API objects of one namespace and the cluster-scoped ones, served at ``url``.

    Served on 127.0.0.1 or on the unix socket ``socket_path``. ``api.pods`` (any resource's name) is
    ``api.objects["pods"]``, by object name. It starts as a cluster does: the namespace and ``kube-system`` exist.
    A request for another namespace finds nothing there (404 for an object, an empty list).
    """

    def __init__(
        self,
        *,
        namespace: str = "training",
        gc_per_list: int | None = None,
        watch_wait_s: float = WATCH_WAIT_S,
        socket_path: str | None = None,
    ):
        self.ns = namespace
        self.gc_per_list = gc_per_list
        self.watch_wait_s = watch_wait_s
        # JobSets whose dependents the garbage collector is removing: name -> whether the JobSet waits for them
        # (foreground deletion).
        self.collecting: dict[str, bool] = {}
        self.rv = 100
        self.served = dict(RESOURCES)
        self.objects: dict[str, dict[str, dict[str, Any]]] = {r: {} for r in RESOURCES}
        self.changes: dict[str, list[tuple[int, str, dict[str, Any]]]] = {r: [] for r in RESOURCES}
        self.compacted: dict[str, int] = dict.fromkeys(RESOURCES, 0)
        self.denied: set[tuple[str, str]] = set()  # (verb, resource) a SelfSubjectAccessReview says no to
        self.reviews: list[dict[str, Any]] = []  # the resourceAttributes of each review asked
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        # Called with each object as created (not on a dry run), and with each JobSet or pod as its DELETE is
        # answered: the local cluster's controllers act on them.
        self.on_create: Callable[[ApiServer, dict[str, Any]], None] | None = None
        # Asked before an object is stored, as a validating admission webhook: a (status, Status) refuses it.
        self.admit: Callable[[str, dict[str, Any]], tuple[int, Any] | None] | None = None
        # Whether a kubelet still runs a pod's container: a graceful delete leaves such a pod Terminating (its
        # kubelet removes it once the container has exited); None: every kubelet confirms at once.
        self.kubelet_holds: Callable[[dict[str, Any]], bool] | None = None
        self.on_delete: Callable[[ApiServer, str, dict[str, Any], dict[str, list[str]]], None] | None = None
        for ns in dict.fromkeys((namespace, "kube-system")):
            self.put("namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "uid": _uid()}})
        self.server = JsonServer(self.route, socket_path)
        self.url = self.server.url

    def __getattr__(self, name: str) -> dict[str, dict[str, Any]]:
        objects = self.__dict__.get("objects")
        if objects is None or name not in objects:
            raise AttributeError(name)
        return objects[name]

    def close(self) -> None:
        """Stop the server."""
        self.server.close()

    # -- mutations (the local cluster's controllers, tests) --

    def put(self, coll: str, *objs: dict[str, Any]) -> None:
        """Create or replace objects (stored as given, in this namespace when namespaced); emits ADDED or MODIFIED."""
        with self.lock:
            for obj in objs:
                self.rv += 1
                meta = obj["metadata"]
                meta["resourceVersion"] = str(self.rv)
                if RESOURCES[coll].namespaced:
                    meta.setdefault("namespace", self.ns)
                kind = "MODIFIED" if meta["name"] in self.objects[coll] else "ADDED"
                self.objects[coll][meta["name"]] = obj
                self.changes[coll].append((self.rv, kind, obj))
            self._changed.notify_all()

    def remove(self, coll: str, name: str) -> None:
        """Delete an object; emits DELETED.

        A deleted JobSet's last pod gone, its Jobs (and the JobSet, when it waits for them) go too.
        """
        with self.lock:
            obj = self.objects[coll].pop(name, None)
            if obj is not None:
                self.rv += 1
                obj["metadata"]["resourceVersion"] = str(self.rv)
                self.changes[coll].append((self.rv, "DELETED", obj))
                self._changed.notify_all()
                if coll == "pods" and self.collecting:
                    self._finish_gangs()

    def compact(self, coll: str) -> None:
        """Forget the event history of ``coll``: an older resourceVersion now gets 410 Gone."""
        with self.lock:
            self.rv += 1
            self.compacted[coll] = self.rv

    def uninstall(self, resource: str) -> None:
        """Stop serving ``resource``, as a cluster without its CRD: every request for it is 404."""
        self.served.pop(resource, None)

    # -- the API --

    def intercept(self, method: str, raw: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        """An answer given instead of the model's (None: the model answers); called under the lock."""
        return None

    def route(self, method: str, raw: str, body: dict[str, Any]) -> tuple[int, Any]:
        """Answer one request."""
        u = urlparse(raw)
        q = parse_qs(u.query)
        with self.lock:
            answer = self.intercept(method, raw, body)
            if answer is not None:
                return answer
            evicted = _EVICTION.fullmatch(u.path)
            if evicted is not None and method == "POST":
                return self._evict(Where("v1", "pods", evicted.group(1), evicted.group(2)), q)
            at = parse_path(u.path)
            if at is not None and at.resource == REVIEWS and at.api_version == "authorization.k8s.io/v1":
                return self._review(method, body)
            res = self.served.get(at.resource) if at else None
            if at is None or res is None or res.api_version != at.api_version or (at.namespace and not res.namespaced):
                return 404, status(404, "NotFound", "the server could not find the requested resource")
            if method == "GET" and at.name is None:
                if at.resource == "pods" and self.gc_per_list and not _watching(q):
                    listed = copy.deepcopy(self._list(at, q))  # as answered, before the collector's next pass
                    self._collect(self.gc_per_list)
                    return listed
                return self._list(at, q)
            if method == "GET":
                return self._get(at)
            if method == "POST" and at.name is None:
                return self._create(at, body, dry_run=_flag(q, "dryRun") == "All")
            if method == "DELETE" and at.name is not None:
                return self._delete(at, q, body)
            if method == "PATCH" and at.name is not None:
                return self._patch(at, body)
        return 405, status(405, "MethodNotAllowed", NOT_ALLOWED)

    def _here(self, at: Where) -> dict[str, dict[str, Any]]:
        """The objects the path can see: none in another namespace than the fake's."""
        if at.namespace is not None and at.namespace != self.ns:
            return {}
        return self.objects[at.resource]

    def _about(self, code: int, reason: str, resource: str, name: str, says: str) -> tuple[int, dict[str, Any]]:
        """A Status about one object as the API server words it.

        As ``pods "x" not found``, ``jobsets.jobset.x-k8s.io "x" already exists``, with details naming it.
        """
        group = self.served[resource].group
        qualified = f"{resource}.{group}" if group else resource
        details = {"name": name, **({"group": group} if group else {}), "kind": resource}
        return code, status(code, reason, f'{qualified} "{name}" {says}', **details)

    def _not_found(self, at: Where) -> tuple[int, dict[str, Any]]:
        return self._about(404, "NotFound", at.resource, at.name or "", "not found")

    def _get(self, at: Where) -> tuple[int, Any]:
        """GET of one object: 200 and the object, or 404 NotFound."""
        obj = self._here(at).get(at.name or "")
        return (200, copy.deepcopy(obj)) if obj is not None else self._not_found(at)

    def _list(self, at: Where, q: dict[str, list[str]]) -> tuple[int, Any]:
        """LIST, or with ``watch`` the changes after ``resourceVersion``.

        Items sorted by name, as etcd returns its keys; both filtered by ``labelSelector`` and ``fieldSelector``.
        """
        labels, fields = _flag(q, "labelSelector"), _flag(q, "fieldSelector")

        def match(o: dict[str, Any]) -> bool:
            if at.namespace is not None and o["metadata"].get("namespace", at.namespace) != at.namespace:
                return False
            return labels_match(labels, o["metadata"].get("labels") or {}) and fields_match(fields, o)

        if _watching(q):
            rv = int(_flag(q, "resourceVersion") or 0)
            asked = float(_flag(q, "timeoutSeconds") or self.watch_wait_s)
            until = time.monotonic() + min(self.watch_wait_s, asked)
            while True:
                if rv < self.compacted[at.resource]:
                    gone = status(410, "Expired", f"too old resource version: {rv}")
                    return 200, Stream([{"type": "ERROR", "object": gone}])
                evs = [{"type": t, "object": o} for v, t, o in self.changes[at.resource] if v > rv and match(o)]
                left = until - time.monotonic()
                if evs or left <= 0:
                    return 200, Stream(copy.deepcopy(evs))
                self._changed.wait(left)  # releases the lock while it waits
        here = self._here(at)
        items = [here[name] for name in sorted(here) if match(here[name])]
        res = self.served[at.resource]
        return 200, copy.deepcopy(
            {
                "kind": f"{res.kind}List",
                "apiVersion": res.api_version,
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
        )

    def _create(self, at: Where, body: dict[str, Any], *, dry_run: bool = False) -> tuple[int, Any]:
        """POST to a collection.

        201 and the object as stored (name from ``generateName`` when it has none, uid, generation 1, creationTimestamp,
        resourceVersion; ``status`` dropped where the status subresource writes it); 409 AlreadyExists for a taken
        name, 422 Invalid for no name, 400 BadRequest for another namespace in the body than in the path, 404 for a
        namespace that does not exist. ``dryRun=All``: the same answer, and nothing stored or reacted to.
        """
        res = self.served[at.resource]
        meta = dict(body.get("metadata") or {})
        if at.namespace is not None and meta.get("namespace", at.namespace) != at.namespace:
            msg = "the namespace of the provided object does not match the namespace sent on the request"
            return 400, status(400, "BadRequest", msg)
        if res.namespaced and at.namespace != self.ns:
            return 404, status(
                404, "NotFound", f'namespaces "{at.namespace}" not found', name=at.namespace, kind="namespaces"
            )
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            msg = f'{res.kind} "" is invalid: metadata.name: Required value: name or generateName is required'
            return 422, status(422, "Invalid", msg, kind=res.kind)
        if name in self.objects[at.resource]:
            return self._about(409, "AlreadyExists", at.resource, name, "already exists")
        obj = copy.deepcopy(body)
        obj["metadata"] = {**meta, "uid": _uid(), "generation": 1, "creationTimestamp": iso(_now())}
        if res.status_subresource:
            obj.pop("status", None)
        if dry_run:
            return 201, obj
        if self.admit is not None and (refused := self.admit(at.resource, obj)) is not None:
            return refused
        self.put(at.resource, obj)
        if self.on_create:
            self.on_create(self, obj)
        return 201, copy.deepcopy(obj)

    def _delete(self, at: Where, q: dict[str, list[str]], body: dict[str, Any]) -> tuple[int, Any]:
        """DELETE of one object: 200 and the object, or 404 NotFound.

        A JobSet's Jobs and pods go to the garbage collector (:meth:`_delete_jobset`); a pod goes at once on a live
        node or with ``gracePeriodSeconds=0``, and stays Terminating on a lost node, whose kubelet cannot confirm it;
        any other object goes.
        """
        obj = self._here(at).get(at.name or "")
        if obj is None:
            return self._not_found(at)
        if self.on_delete is not None:
            self.on_delete(self, at.resource, obj, q)
        if at.resource == "jobsets":
            policy = _flag(q, "propagationPolicy") or (body or {}).get("propagationPolicy") or "Background"
            return 200, copy.deepcopy(self._delete_jobset(obj, policy))
        elif at.resource == "pods" and _flag(q, "gracePeriodSeconds") != "0" and self._held(obj):
            self._terminating(obj)
        else:
            self.remove(at.resource, obj["metadata"]["name"])
        return 200, copy.deepcopy(obj)

    def _evict(self, at: Where, q: dict[str, list[str]]) -> tuple[int, Any]:
        """An eviction: the pod marked ``DisruptionTarget`` (EvictionByEvictionAPI), then deleted with its grace."""
        pod = self._here(at).get(at.name or "")
        if pod is None:
            return self._not_found(at)
        marked = copy.deepcopy(pod)
        st = marked.setdefault("status", {})
        conditions = [c for c in st.get("conditions", []) if c.get("type") != "DisruptionTarget"]
        stamp = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
        stamp |= {"message": "Eviction API: evicting", "lastTransitionTime": iso(_now())}
        st["conditions"] = [*conditions, stamp]
        self.put("pods", marked)
        self._delete(at, q, {})
        return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    def _patch(self, at: Where, body: dict[str, Any]) -> tuple[int, Any]:
        """PATCH of one object with a JSON merge patch.

        RFC 7386: a null removes the key (what the Python client sends for custom objects); 200 and the object as
        stored, or 404 NotFound.
        """
        obj = self._here(at).get(at.name or "")
        if obj is None:
            return self._not_found(at)
        patched = _merged(copy.deepcopy(obj), body)
        self.put(at.resource, patched)
        return 200, patched

    def _review(self, method: str, body: dict[str, Any]) -> tuple[int, Any]:
        """A SelfSubjectAccessReview: 201 and ``status.allowed`` (RBAC's no, with an empty reason, when denied)."""
        if method != "POST":
            return 405, status(405, "MethodNotAllowed", NOT_ALLOWED)
        attrs = body["spec"]["resourceAttributes"]
        self.reviews.append(attrs)
        allowed = (attrs["verb"], attrs["resource"]) not in self.denied
        return 201, {**body, "status": {"allowed": allowed, **({} if allowed else {"reason": ""})}}

    def _held(self, p: dict[str, Any]) -> bool:
        """Whether a deleted pod stays Terminating: its node is lost, or its kubelet still runs its container."""
        return self._on_lost_node(p) or (self.kubelet_holds is not None and self.kubelet_holds(p))

    def _on_lost_node(self, p: dict[str, Any]) -> bool:
        n = self.objects["nodes"].get(p["spec"].get("nodeName") or "")
        return n is not None and n["status"]["conditions"][0]["status"] != "True"

    def _terminating(self, p: dict[str, Any]) -> None:
        meta = {**p["metadata"], "deletionTimestamp": iso(_now()), "deletionGracePeriodSeconds": 30}
        self.put("pods", {**p, "metadata": meta})

    def _delete_jobset(self, obj: dict[str, Any], policy: str) -> dict[str, Any]:
        """A JobSet's DELETE by propagation policy (module docstring).

        Returns what the API answers, the object as it is left (with its ``deletionTimestamp`` while it waits).
        """
        name = obj["metadata"]["name"]
        if policy == "Foreground" and not obj["metadata"].get("deletionTimestamp"):
            meta = {**obj["metadata"], "deletionTimestamp": iso(_now()), "deletionGracePeriodSeconds": 0}
            meta["finalizers"] = [*meta.get("finalizers", []), "foregroundDeletion"]
            obj = {**obj, "metadata": meta}
            self.put("jobsets", obj)
        elif policy != "Foreground":
            self.remove("jobsets", name)
        if policy == "Background":  # the Jobs are deleted in the background too: they go before their pods
            for job in self._gang_of("jobs", name):
                self.remove("jobs", job)
        if policy != "Orphan":
            self.collecting[name] = self.collecting.get(name, False) or policy == "Foreground"
            self._collect(None if self.gc_per_list is None else 0)
        return obj

    def _gang_of(self, coll: str, jobset: str) -> list[str]:
        """The names of the ``coll`` objects of ``jobset`` (by its jobset-name label)."""
        objs = self.objects[coll]
        return [n for n in sorted(objs) if (objs[n]["metadata"].get("labels") or {}).get(JOBSET_NAME_LABEL) == jobset]

    def _collect(self, limit: int | None) -> None:
        """One pass of the garbage collector: up to ``limit`` (None: all) of the deleted JobSets' pods go.

        Those on a lost node stay Terminating; then :meth:`_finish_gangs`.
        """
        for jobset in list(self.collecting):
            for name in self._gang_of("pods", jobset):
                p = self.objects["pods"][name]
                if p["metadata"].get("deletionTimestamp"):
                    continue  # already Terminating: the kubelet (or a forced delete) ends it
                if limit is not None and limit <= 0:
                    break
                if limit is not None:
                    limit -= 1
                if self._held(p):
                    self._terminating(p)
                else:
                    self.remove("pods", name)
        self._finish_gangs()

    def _finish_gangs(self) -> None:
        """A deleted JobSet with no pod left: its Jobs go, then the JobSet when it waits for them (foreground)."""
        for jobset, waits in list(self.collecting.items()):
            if self._gang_of("pods", jobset):
                continue
            del self.collecting[jobset]
            for name in self._gang_of("jobs", jobset):
                self.remove("jobs", name)
            if waits:
                self.remove("jobsets", jobset)


def _uid() -> str:
    return str(uuid.uuid4())


def _now() -> float:
    return time.time()
