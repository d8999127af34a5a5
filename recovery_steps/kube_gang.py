"""The supervisor's gang over the Kubernetes API, beside the client it uses (``adapters.kube``).

The attempt's JobSet, its Jobs, pods and their nodes kept current by LIST + WATCH (``Watcher``), behind the
``model.gang.Gang`` port (``KubeGang``): the one adapter of both worlds, as the local runner serves its cluster as
the Kubernetes API too (``workflows.local.controllers``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from jaxrec.adapters.kube import API_TIMEOUT_S, CONNECT_TIMEOUT_S, Kube
from jaxrec.adapters.store import first_line
from jaxrec.model.contract import ExitCode
from jaxrec.model.gang import Attachment
from jaxrec.model.names import ATTEMPT_LABEL
from jaxrec.model.snapshot import (
    ClusterSnapshot,
    JobEvidence,
    NodeEvidence,
    PodEvidence,
    PodPhase,
    job_from_api,
    jobset_from_api,
    node_from_api,
    parse_time,
    pod_from_api,
)
from recovery_steps.step import StepError

log = logging.getLogger(__name__)

# The API server ends a watch after timeoutSeconds; a new one continues from the last resourceVersion.
WATCH_TIMEOUT_S = 60
# How long the first LIST of the JobSet, its Jobs and pods may take before the supervisor leaves with exit 69
# (transient: Argo retries it and the retry re-attaches). A view that fails later is bounded by the supervisor
# (``supervision.STALE_VIEW_LIMIT_S``).
SYNC_TIMEOUT_S = 300
# While the gang has fewer pods than hosts, how often its Jobs' warning events are read: the Job controller reports
# a pod the API refused (FailedCreate) only there, and a policy's refusal ends the attempt at once.
JOB_EVENTS_EVERY_S = 2.0


class Watcher(threading.Thread):
    """Keeps the current objects of one list (by name) with LIST, then WATCH from its ``resourceVersion``.

    The watch is the client library's (``kubernetes.watch.Watch().stream``, kubernetes-client/python 35.0.0
    ``kubernetes/watch/watch.py``): it parses the event stream and raises ``ApiException(410)`` on an ``ERROR``
    event with code 410 when ``timeout_seconds`` is given. A watch that ends is resumed from the last version seen
    (bookmarks included); ``410 Gone`` (the version was compacted away, kubernetes API concepts "Efficient
    detection of changes") starts over with a fresh LIST.
    """

    def __init__(self, kind: str, list_call: Callable[..., Any], changed: threading.Event, stop: threading.Event):
        super().__init__(name=f"watch-{kind}", daemon=True)
        self.kind = kind
        self.list_call = list_call
        self.changed = changed
        self.stop = stop
        self.objects: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.synced = threading.Event()
        self.error: str | None = None  # why the last list or watch failed; None once one succeeds again

    def snapshot(self) -> list[dict[str, Any]]:
        """The objects now, sorted by name."""
        with self.lock:
            return [self.objects[k] for k in sorted(self.objects)]

    def _relist(self) -> str:
        resp = self.list_call(_preload_content=False, _request_timeout=API_TIMEOUT_S)
        body = json.loads(resp.data)
        with self.lock:
            self.objects = {o["metadata"]["name"]: o for o in body.get("items") or []}
        self.synced.set()
        self.changed.set()
        return (body.get("metadata") or {}).get("resourceVersion") or ""

    def _watch(self, rv: str) -> tuple[str, int]:
        """One watch from ``rv`` until the server ends it; returns the last version seen and the events applied."""
        from kubernetes import watch

        # return_type "object": the events' objects stay the API's JSON (no model is built). The read timeout
        # bounds the silence between chunks: the server ends the watch after WATCH_TIMEOUT_S and sends bookmarks
        # meanwhile, so a longer silence is a dead connection.
        stream = watch.Watch(return_type="object").stream(
            self.list_call,
            resource_version=rv,
            timeout_seconds=WATCH_TIMEOUT_S,
            allow_watch_bookmarks=True,
            _request_timeout=(CONNECT_TIMEOUT_S, WATCH_TIMEOUT_S + 15),
        )
        events = 0
        for ev in stream:
            obj, kind = ev.get("raw_object") or {}, ev.get("type")
            rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
            if kind == "BOOKMARK":
                continue
            events += 1
            with self.lock:
                if kind == "DELETED":
                    self.objects.pop(obj["metadata"]["name"], None)
                else:
                    self.objects[obj["metadata"]["name"]] = obj
            self.changed.set()
        return rv, events

    def run(self) -> None:
        """List, then watch until stopped."""
        from kubernetes.client import ApiException

        rv: str | None = None
        while not self.stop.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                self.error = None
                rv, events = self._watch(rv)
                self.error = None
                if not events:
                    self.stop.wait(0.2)  # a watch that ended at once: do not spin against the server
            except ApiException as e:
                if e.status == 410:
                    log.info("watch %s: resourceVersion %s expired (410 Gone); listing again", self.kind, rv)
                    rv = None
                    continue
                self.error = f"{e.status} {e.reason}"
                rv = None  # list again once the API answers: events may have been missed
                self.stop.wait(1)
            except Exception as e:  # noqa: BLE001 - the API may drop for a while; keep the last view
                self.error = f"{type(e).__name__}: {e}"
                rv = None
                self.stop.wait(1)


class KubeGang:
    """The attempt's JobSet on a cluster: the supervisor's port (``model.gang.Gang``) over the Kubernetes API.

    The JobSet, its Jobs and pods are followed by one watcher each; the nodes the pods are bound to are read on
    every ``observe`` (an unreadable node keeps its last known state).
    """

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        jobset: str,
        *,
        clock: Callable[[], float] = time.time,
        say: Callable[[str], None] = log.info,
        expected_pods: int | None = None,
    ):
        self.kube = Kube(api_client, namespace)
        self.name = jobset
        self.clock, self.say = clock, say
        self.expected_pods = expected_pods
        self.job_events: dict[str, list[str]] = {}  # each Job's warning events, read while pods are missing
        self.events_read_at = -math.inf
        self.changed = threading.Event()
        self.stopped = threading.Event()
        lists = {
            "jobset": lambda **kw: self.kube.list_jobsets(jobset, **kw),
            "jobs": lambda **kw: self.kube.list_jobs(jobset, **kw),
            "pods": lambda **kw: self.kube.list_pods(jobset, **kw),
        }
        self.watch = {k: Watcher(k, f, self.changed, self.stopped) for k, f in lists.items()}
        self.node_cache: dict[str, NodeEvidence] = {}

    def find(self) -> Attachment | None:
        """The JobSet, or None when it does not exist."""
        obj = self.kube.get_jobset(self.name)
        if obj is None:
            return None
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        return Attachment(self.name, parse_time(meta.get("creationTimestamp")), labels.get(ATTEMPT_LABEL))

    def create(self, manifest: Mapping[str, Any]) -> Attachment | None:
        """Create the JobSet; None when it already exists (409 Conflict)."""
        if not self.kube.create_jobset(dict(manifest)):
            return None
        return Attachment(self.name, None, ((manifest.get("metadata") or {}).get("labels") or {}).get(ATTEMPT_LABEL))

    def delete(self) -> None:
        """Delete the JobSet; foreground propagation removes its Jobs and pods before the JobSet itself."""
        from kubernetes.client import ApiException

        with contextlib.suppress(ApiException):  # the stop goes on observing: what is left says what happened
            self.kube.delete_jobset(self.name)

    def force_delete(self, pod: str) -> None:
        """Delete a pod with grace period 0: the API removes it without the kubelet's confirmation."""
        from kubernetes.client import ApiException

        with contextlib.suppress(ApiException):
            self.kube.force_delete_pod(pod)

    def start(self) -> None:
        """Start the watchers; return once each has listed (exit 69 after ``SYNC_TIMEOUT_S`` without)."""
        for w in self.watch.values():
            w.start()
        give_up = self.clock() + SYNC_TIMEOUT_S
        for w in self.watch.values():
            while not w.synced.wait(1):
                if w.error:
                    self.say(f"waiting for the {w.kind} watch: {w.error}")
                if self.clock() > give_up:
                    raise StepError(
                        ExitCode.TRANSIENT,
                        f"cannot list the attempt's {w.kind} for {SYNC_TIMEOUT_S} s: {w.error or 'no answer'}; "
                        "the gang is left running for the retry to re-attach",
                    )

    def observe(self) -> ClusterSnapshot:
        """The JobSet, its Jobs, pods and their nodes as the watches hold them now.

        A watch in error or a node that could not be read leaves its last view in place and says so in the
        snapshot's ``unreadable``: the supervisor gives no stall verdict on it (``supervision.decide``), and ends
        the step as transient once the view has stayed unreadable for ``supervision.STALE_VIEW_LIMIT_S``.
        """
        failing = [f"the {w.kind} watch: {w.error}" for w in self.watch.values() if w.error]
        pods = [pod_from_api(p) for p in self.watch["pods"].snapshot()]
        for name in sorted({p.node for p in pods if p.node}):
            try:
                body = self.kube.get_node(name)
            except Exception as e:  # noqa: BLE001 - an unreadable node keeps its last known state, said stale
                # One observation takes one API timeout at most: the other nodes keep their last state too.
                failing.append(f"node {name}: {type(e).__name__}: {first_line(e)}")
                break
            # A node gone from the API keeps the pool it was last seen in: the next gang's placement avoids it.
            prev = self.node_cache.get(name)
            gone = NodeEvidence(name=name, found=False, pool=prev.pool if prev else None)
            self.node_cache[name] = node_from_api(body) if body else gone
        js = self.watch["jobset"].snapshot()
        jobset = jobset_from_api(js[0]) if js else None
        jobs = [job_from_api(j) for j in self.watch["jobs"].snapshot()]
        pods, jobs = self._consistent(pods, jobs, jobset_failed=bool(jobset and jobset.terminal_state == "Failed"))
        if self.expected_pods is not None and len(pods) < self.expected_pods:
            failing += self._read_job_events([j.name for j in jobs])
        return ClusterSnapshot(
            taken_at=self.clock(),
            jobset=jobset,
            jobs=[j.model_copy(update={"events": self.job_events.get(j.name, [])}) for j in jobs],
            pods=pods,
            nodes=[self.node_cache[n] for n in sorted(self.node_cache)],
            unreadable="; ".join(failing) or None,
        )

    def _consistent(
        self, pods: list[PodEvidence], jobs: list[JobEvidence], *, jobset_failed: bool = False
    ) -> tuple[list[PodEvidence], list[JobEvidence]]:
        """The pods and Jobs listed once more when one watch shows a failure the other does not.

        The watches deliver independently: a Job's ``FailureTarget`` or the JobSet's failure can arrive before the
        pod that caused it, and a failed pod before the Job controller's verdict on it. A LIST answers as of the
        API's latest state, so the verdict's snapshot names the worker and holds the Job's reason as the API has
        them now. A LIST that fails keeps the watched view.
        """
        job_failed = any(j.failure() is not None for j in jobs)
        pod_failed = any(p.phase == PodPhase.FAILED for p in pods)
        # A JobSet fails only after one of its Jobs and a pod did: its failure asks the others to show theirs.
        if job_failed == pod_failed and (not jobset_failed or job_failed):
            return pods, jobs
        try:
            pods = [pod_from_api(p) for p in self.kube.items(self.kube.list_pods, self.name)]
            jobs = [job_from_api(j) for j in self.kube.items(self.kube.list_jobs, self.name)]
        except Exception as e:  # noqa: BLE001 - the watched view stands
            self.say(f"could not list the pods and Jobs again: {type(e).__name__}: {first_line(e)}")
        return pods, jobs

    def _read_job_events(self, jobs: list[str]) -> list[str]:
        """Read the Jobs' warning events (a FailedCreate: the API refused their pods), at most every few seconds.

        Returns what could not be read (the events kept are the last read).
        """
        now = time.monotonic()
        if now - self.events_read_at < JOB_EVENTS_EVERY_S:
            return []
        self.events_read_at = now
        for name in jobs:
            try:
                self.job_events[name] = self.kube.job_warnings(name)
            except Exception as e:  # noqa: BLE001 - the events kept are said stale, like a node's
                return [f"the events of Job {name}: {type(e).__name__}"]
        return []

    def wait(self, timeout: float) -> bool:
        """Until a watcher saw a change, or ``timeout`` seconds; whether one did."""
        changed = self.changed.wait(timeout)
        self.changed.clear()
        return changed

    def close(self) -> None:
        """Stop the watchers."""
        self.stopped.set()
