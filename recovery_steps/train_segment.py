"""``train-segment``: create (or re-attach to) the attempt's JobSet, supervise it until it is over, then stop it.

The JobSet alone cannot end every attempt (see ``recovery_steps.supervision``): this program watches
the JobSet, its Jobs and its pods with the Kubernetes watch API, reads each worker's heartbeat from
the run store, and calls the pure ``decide()`` on every change and at least every
``supervision.watch_interval_s``. When the attempt is over it records each pod's and node's last state,
deletes the JobSet (foreground propagation: the pods go first), force-deletes pods stuck Terminating on
a lost node after ``supervision.force_delete_grace_s``, writes ``attempts/<n>/supervision.json`` and
its outputs, and exits 0 (succeeded) or 1 (failed or stalled: classify-failure follows).

If its own pod is lost (evicted, node drained) Argo retries it; the retry finds the attempt's JobSet
and re-attaches instead of creating a second gang. It reports ``step/total_steps`` through Argo's
progress file (``ARGO_PROGRESS_FILE``, argo docs "Progress").

Outputs (``<output-dir>/<name>``): ``outcome``, ``stall-kind``, ``reason``, ``last-step``, ``checkpoint-step``.
Exit codes: 0 succeeded; 1 the attempt failed or stalled; 2 configuration (no config, the manifest is
bad, the Kubernetes API refuses with 4xx); 69 transient (the API answers 429/5xx or cannot be reached, a watch
fails for minutes, the run store cannot be written): the gang is left as it is and the retry re-attaches.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from recovery_steps.kernel import cli
from recovery_steps.kernel.checkpoints import newest_complete_step
from recovery_steps.kernel.config import JobConfig
from recovery_steps.kernel.contract import ExitCode
from recovery_steps.kernel.k8s import (
    API_TIMEOUT_S,
    ATTEMPT_LABEL,
    CONNECT_TIMEOUT_S,
    JOBSET_GROUP,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    api_error_line,
    api_exit_code,
)
from recovery_steps.kernel.outputs import SegmentOutputs
from recovery_steps.kernel.records import SupervisionRecord, WorkerHeartbeat, WorkerSupervision, now
from recovery_steps.kernel.snapshot import (
    ClusterSnapshot,
    NodeEvidence,
    job_from_api,
    jobset_from_api,
    node_from_api,
    pod_from_api,
)
from recovery_steps.kernel.store import DocumentError, RunLayout, RunStore, store_errors
from recovery_steps.supervision import (
    UNREACHABLE_TAINT,
    AttemptState,
    JobObservation,
    NodeObservation,
    Observation,
    PodCondition,
    PodObservation,
    Verdict,
    WaitClock,
    WorkerProgress,
    decide,
    wait_clock,
)

log = logging.getLogger(__name__)

TRAINER_CONTAINER = "trainer"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
OUTPUTS = ("outcome", "stall-kind", "reason", "last-step", "checkpoint-step")
# The API server ends a watch after timeoutSeconds; a new one continues from the last resourceVersion.
WATCH_TIMEOUT_S = 60
# How long the first LIST of the JobSet, its Jobs and pods may take, and how long a watcher may stay in error
# later, before the supervisor leaves with exit 69 (transient: Argo retries it and the retry re-attaches)
# rather than decide on a view it cannot refresh.
SYNC_TIMEOUT_S = 300
# How long the stop waits, beyond the pods' own termination grace, before it reports pods left over.
STOP_SLACK_S = 30


class AlreadyDecided(Exception):
    """An earlier try of this step already decided the attempt (its record is ``record``)."""

    def __init__(self, record: SupervisionRecord):
        super().__init__(record.reason)
        self.record = record


def recorded_verdict(store: RunStore, attempt: int) -> SupervisionRecord | None:
    """The attempt's supervision verdict (succeeded, failed or stalled) if a supervisor recorded one."""
    rec = store.read_record(RunLayout.supervision(attempt), SupervisionRecord)
    if rec is not None and rec.decided:
        return rec
    return None


class SegmentError(Exception):
    """train-segment cannot supervise this attempt; ``code`` is its exit code."""

    def __init__(self, code: ExitCode, message: str):
        super().__init__(message)
        self.code = code


def _ts(text: str | None) -> float | None:
    """An RFC 3339 API timestamp as epoch seconds."""
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


# --- from API objects to the observation (pure) -----------------------------------------------


def _conditions(obj: Mapping[str, Any]) -> tuple[PodCondition, ...]:
    return tuple(
        PodCondition(
            type=c["type"],
            status=c.get("status", "True"),
            reason=c.get("reason"),
            message=c.get("message"),
            since=_ts(c.get("lastTransitionTime")),
        )  # fmt: skip
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def _index(pod: Mapping[str, Any]) -> int | None:
    meta = pod.get("metadata") or {}
    for src in (meta.get("labels") or {}, meta.get("annotations") or {}):
        v = src.get(COMPLETION_INDEX)
        if v is not None and str(v).isdigit():
            return int(v)
    return None


def pod_observation(pod: Mapping[str, Any], waiting_since: float | None) -> PodObservation:
    """One pod's API JSON as the decision sees it (``waiting_since``: when its current failure was first seen)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    cs = next((c for c in status.get("containerStatuses") or [] if c.get("name") == TRAINER_CONTAINER), None)
    state = (cs or {}).get("state") or {}
    waiting, run, term = state.get("waiting") or {}, state.get("running") or {}, state.get("terminated") or {}
    return PodObservation(
        name=meta.get("name", "?"),
        index=_index(pod),
        phase=status.get("phase") or "Pending",
        node=(pod.get("spec") or {}).get("nodeName"),
        created_at=_ts(meta.get("creationTimestamp")),
        conditions=_conditions(pod),
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
        waiting_since=waiting_since if waiting.get("reason") else None,
        running_since=_ts(run.get("startedAt") or term.get("startedAt")),
        exit_code=term.get("exitCode"),
        terminated_reason=term.get("reason"),
        deletion_timestamp=_ts(meta.get("deletionTimestamp")),
    )


def node_observation(name: str, node: Mapping[str, Any] | None, seen_lost_at: float | None = None) -> NodeObservation:
    """A node's API JSON (None: the Node object is gone) as the decision sees it.

    Its Spot label and maintenance labels or taints are read as the snapshot reads them (``node_from_api``), so the
    verdict and classify-failure name the same facts.
    """
    if node is None:
        return NodeObservation(name=name, ready=None, exists=False, seen_lost_at=seen_lost_at)
    ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
    taints = {t.get("key") for t in (node.get("spec") or {}).get("taints") or []}
    status = (ready or {}).get("status")
    seen = node_from_api(dict(node))
    return NodeObservation(
        name=name,
        ready=True if status == "True" else (False if status == "False" else None),
        unreachable=UNREACHABLE_TAINT in taints,
        since=_ts((ready or {}).get("lastTransitionTime")),
        ready_reason=(ready or {}).get("reason"),
        ready_message=(ready or {}).get("message"),
        seen_lost_at=seen_lost_at,
        spot=seen.spot,
        maintenance=seen.maintenance(),
    )


def observation(
    *,
    now: float,
    expected: int,
    jobset: Mapping[str, Any] | None,
    jobs: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    nodes: Mapping[str, Mapping[str, Any] | None],
    beats: Sequence[WorkerHeartbeat],
    waits: Mapping[str, WaitClock],
    created_at: float,
    lost_seen: Mapping[str, float] | None = None,
) -> Observation:
    """The decision's input from the API objects the watches hold and the heartbeats in the store.

    ``waits``: each pod's clock of its current pull or creation failure (``wait_clock``); ``lost_seen``: when the
    supervisor first saw each lost node lost.
    """
    lost_seen = lost_seen or {}
    obs_pods = []
    for p in pods:
        po = pod_observation(p, None)
        clock = waits.get(po.name) if po.waiting_reason else None
        obs_pods.append(po.model_copy(update={"waiting_since": clock.since if clock else None,
                                              "waiting_cause": clock.cause if clock else None}))  # fmt: skip
    js_status = (jobset or {}).get("status") or {}
    return Observation(
        now=now,
        expected_workers=expected,
        created_at=_ts(((jobset or {}).get("metadata") or {}).get("creationTimestamp")) or created_at,
        jobset_exists=jobset is not None,
        jobset_terminal_state=js_status.get("terminalState"),
        jobset_conditions=_conditions(jobset or {}),
        jobs=tuple(
            JobObservation(name=(j.get("metadata") or {}).get("name", "?"), conditions=_conditions(j)) for j in jobs
        ),  # fmt: skip
        pods=tuple(obs_pods),
        nodes=tuple(node_observation(n, body, lost_seen.get(n)) for n, body in sorted(nodes.items())),
        progress=tuple(
            WorkerProgress(index=b.process_index, step=b.step, at=b.at, first_step_at=b.first_step_at) for b in beats
        ),  # fmt: skip
    )


# --- the Kubernetes adapter: list + watch ------------------------------------------------------


def _lines(resp: Any) -> Iterator[bytes]:
    """Newline-delimited JSON lines of a watch response, as they arrive."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line
    if buf.strip():
        yield buf


class Watcher(threading.Thread):
    """Keeps the current objects of one list (by name) with LIST, then WATCH from its ``resourceVersion``.

    A watch that ends is resumed from the last version seen; ``410 Gone`` (the version was compacted
    away, kubernetes API concepts "Efficient detection of changes") starts over with a fresh LIST.
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
        self.relists = 0
        self.error: str | None = None
        self.error_since: float | None = None  # monotonic time of the first error since the last success
        self.last_heard = time.monotonic()

    def snapshot(self) -> list[dict[str, Any]]:
        """The objects now, sorted by name."""
        with self.lock:
            return [self.objects[k] for k in sorted(self.objects)]

    def failing_for(self) -> float:
        """Seconds this watcher has been unable to list or watch (0 when it is fine)."""
        return 0.0 if self.error_since is None else time.monotonic() - self.error_since

    def _ok(self) -> None:
        self.error, self.error_since, self.last_heard = None, None, time.monotonic()

    def _failed(self, what: str) -> None:
        self.error = what
        if self.error_since is None:
            self.error_since = time.monotonic()

    def _relist(self) -> str:
        resp = self.list_call(_preload_content=False, _request_timeout=API_TIMEOUT_S)
        body = json.loads(resp.data)
        with self.lock:
            self.objects = {o["metadata"]["name"]: o for o in body.get("items") or []}
        self.relists += 1
        self.synced.set()
        self.changed.set()
        return (body.get("metadata") or {}).get("resourceVersion") or ""

    def run(self) -> None:
        """List, then watch until stopped."""
        from kubernetes.client import ApiException

        rv: str | None = None
        while not self.stop.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                self._ok()
                # The read timeout bounds the silence between chunks: the server ends the watch after
                # WATCH_TIMEOUT_S and sends bookmarks meanwhile, so a longer silence is a dead connection.
                resp = self.list_call(watch=True, resource_version=rv, timeout_seconds=WATCH_TIMEOUT_S,
                                      allow_watch_bookmarks=True, _preload_content=False,
                                      _request_timeout=(CONNECT_TIMEOUT_S, WATCH_TIMEOUT_S + 15))  # fmt: skip
                events = 0
                for line in _lines(resp):
                    self.last_heard = time.monotonic()
                    ev = json.loads(line)
                    obj, kind = ev.get("object") or {}, ev.get("type")
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            log.info("watch %s: resourceVersion %s expired (410 Gone); listing again", self.kind, rv)
                        rv = None
                        break
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
                resp.release_conn()
                self._ok()
                if not events:
                    self.stop.wait(0.2)  # a watch that ended at once: do not spin against the server
            except ApiException as e:
                if e.status == 410:
                    rv = None
                    continue
                self._failed(f"{e.status} {e.reason}")
                rv = None  # list again once the API answers: events may have been missed
                self.stop.wait(1)
            except Exception as e:  # noqa: BLE001 - the API may drop for a while; keep the last view
                self._failed(f"{type(e).__name__}: {e}")
                rv = None
                self.stop.wait(1)


class Cluster:
    """The calls the supervisor makes to the Kubernetes API (raw JSON, ``_preload_content=False``)."""

    def __init__(self, api_client: Any, namespace: str, jobset: str):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.ns = namespace
        self.name = jobset

    def get_jobset(self) -> dict[str, Any] | None:
        """The JobSet, or None when it does not exist."""
        from kubernetes.client import ApiException

        try:
            resp = self.custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL,
                                                            self.name, _preload_content=False,
                                                            _request_timeout=API_TIMEOUT_S)  # fmt: skip
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def create_jobset(self, manifest: Mapping[str, Any]) -> None:
        """Create the JobSet (409 Conflict is returned to the caller as ApiException)."""
        self.custom.create_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL,
                                                    dict(manifest), _preload_content=False,
                                                    _request_timeout=API_TIMEOUT_S)  # fmt: skip

    def delete_jobset(self) -> None:
        """Delete the JobSet; foreground propagation removes its Jobs and pods before the JobSet itself."""
        from kubernetes.client import ApiException

        with contextlib.suppress(ApiException):
            self.custom.delete_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL,
                                                        self.name, propagation_policy="Foreground",
                                                        _preload_content=False,
                                                        _request_timeout=API_TIMEOUT_S)  # fmt: skip

    def force_delete_pod(self, name: str) -> None:
        """Delete a pod with grace period 0: the API removes it without the kubelet's confirmation."""
        from kubernetes.client import ApiException

        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(
                name, self.ns, grace_period_seconds=0, _preload_content=False, _request_timeout=API_TIMEOUT_S
            )

    def get_node(self, name: str) -> dict[str, Any] | None:
        """A node, or None when the Node object is gone."""
        from kubernetes.client import ApiException

        try:
            return json.loads(self.core.read_node(name, _preload_content=False, _request_timeout=API_TIMEOUT_S).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def watchers(self, changed: threading.Event, stop: threading.Event) -> dict[str, Watcher]:
        """One watcher each for the JobSet, its Jobs and its pods."""
        sel = f"{JOBSET_NAME_LABEL}={self.name}"

        def jobsets(**kw: Any) -> Any:
            by_name = f"metadata.name={self.name}"
            return self.custom.list_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL, field_selector=by_name, **kw
            )

        def jobs(**kw: Any) -> Any:
            return self.batch.list_namespaced_job(self.ns, label_selector=sel, **kw)

        def pods(**kw: Any) -> Any:
            return self.core.list_namespaced_pod(self.ns, label_selector=sel, **kw)

        return {k: Watcher(k, f, changed, stop) for k, f in (("jobset", jobsets), ("jobs", jobs), ("pods", pods))}


# --- the supervisor ------------------------------------------------------------------------------


def read_heartbeats(
    store: RunStore, attempt: int, hosts: int, last: Mapping[int, WorkerHeartbeat] | None = None
) -> list[WorkerHeartbeat]:
    """Every worker's newest heartbeat.

    A heartbeat that cannot be read now (torn, the store or its credentials unreachable) is the last one read
    (``last``): a store outage is not a worker that stopped stepping, and never escapes the supervision loop.
    A worker with no readable heartbeat yet has none.
    """
    last = last or {}
    out = []
    for i in range(hosts):
        try:
            beat = store.read_record(RunLayout.heartbeat(attempt, i), WorkerHeartbeat)
        except (DocumentError, *store_errors()) as e:
            log.warning("heartbeat of worker %d unreadable (keeping the last one read): %s", i, e)
            beat = last.get(i)
        if beat is not None:
            out.append(beat)
    return out


class Progress:
    """One log line per change of the gang's state, and Argo's progress file."""

    def __init__(self, hosts: int, total_steps: int, progress_file: str | None, say: Callable[[str], None]):
        self.hosts, self.total, self.file, self.say = hosts, total_steps, progress_file, say
        self.seen: dict[str, Any] = {}

    def _note(self, key: str, value: Any, line: str) -> None:
        if value is not None and self.seen.get(key) != value:
            self.seen[key] = value
            self.say(line)

    def update(self, obs: Observation, verdict: Verdict) -> None:
        """Log what changed since the last call; rewrite the progress file when the step moved."""
        scheduled = sum(1 for p in obs.pods if p.node is not None)
        running = sum(1 for p in obs.pods if p.phase == "Running")
        self._note("scheduled", scheduled, f"workers scheduled {scheduled}/{self.hosts}")
        self._note("running", running, f"workers running {running}/{self.hosts}")
        steps = [b.step for b in obs.progress if b.step is not None]
        step = min(steps) if len(steps) == self.hosts else None
        if step is not None and step != self.seen.get("step") and self.file:
            with contextlib.suppress(OSError):
                Path(self.file).write_text(f"{step}/{self.total}")
        self._note("step", step, f"step {step}")
        if verdict.over:
            self._note("verdict", verdict.state, f"{verdict.state.value}: {verdict.reason}")

    def checkpoint(self, step: int | None) -> None:
        """Log a newly committed checkpoint."""
        self._note("checkpoint", step, f"checkpoint {step}")


def worker_records(obs: Observation, beats: Sequence[WorkerHeartbeat], hosts: int) -> list[WorkerSupervision]:
    """Per worker: pod, node, scheduled/started/first-step times, last step and last state."""
    pods = {p.index: p for p in obs.pods if p.index is not None}
    by_beat = {b.process_index: b for b in beats}
    nodes = {n.name: n for n in obs.nodes}
    out = []
    for i in range(hosts):
        p, b = pods.get(i), by_beat.get(i)
        sched = p.condition("PodScheduled") if p else None
        out.append(
            WorkerSupervision(
                index=i,
                pod=p.name if p else None,
                node=p.node if p else None,
                scheduled_at=sched.since if sched is not None and sched.status == "True" else None,
                started_at=p.running_since if p else None,
                first_step_at=b.first_step_at if b else None,
                last_step=b.step if b else None,
                last_state=_pod_line(p, nodes.get(p.node) if p and p.node else None) if p else "no pod",
            )
        )
    return out


def _pod_line(p: PodObservation, n: NodeObservation | None) -> str:
    parts = [p.phase]
    if p.waiting_reason:
        parts.append(f"waiting {p.waiting_reason}")
    if p.exit_code is not None:
        parts.append(f"exit {p.exit_code} {p.terminated_reason or ''}".strip())
    if p.deletion_timestamp is not None:
        parts.append("Terminating")
    sched = p.condition("PodScheduled")
    if sched is not None and sched.status == "False":
        parts.append(f"unschedulable: {sched.message or sched.reason}")
    if n is not None:
        parts.append(f"node {n.name} " + ("gone" if not n.exists else "unreachable" if n.unreachable
                                           else "Ready" if n.ready else "NotReady"))  # fmt: skip
    return ", ".join(parts)


def evidence_lines(obs: Observation) -> list[str]:
    """Each pod's and node's last state, one line each (recorded before the attempt is stopped)."""
    nodes = {n.name: n for n in obs.nodes}
    lines = [f"pod {p.name} ({p.label}): {_pod_line(p, nodes.get(p.node) if p.node else None)}"
             for p in sorted(obs.pods, key=lambda p: p.name)]  # fmt: skip
    for n in obs.nodes:
        state = "gone" if not n.exists else f"Ready={n.ready}" + (" unreachable" if n.unreachable else "")
        lines.append(f"node {n.name}: {state}")
    return lines


class Supervisor:
    """Supervises one attempt's JobSet until the decision says it is over, then stops it."""

    def __init__(
        self,
        cfg: JobConfig,
        attempt: int,
        cluster: Cluster,
        store: RunStore,
        *,
        clock: Callable[[], float] = time.time,
        progress_file: str | None = None,
        say: Callable[[str], None] = log.info,
        renew: Callable[[float], str | None] | None = None,
    ):
        self.cfg, self.attempt, self.cluster, self.store = cfg, attempt, cluster, store
        self.renew = renew
        self.clock = clock
        self.hosts = cfg.slice.num_hosts
        self.progress = Progress(self.hosts, cfg.training.total_steps, progress_file, say)
        self.say = say
        self.changed = threading.Event()
        self.stop = threading.Event()
        self.watch = cluster.watchers(self.changed, self.stop)
        self.waits: dict[str, WaitClock] = {}
        self.lost_seen: dict[str, float] = {}
        self.node_cache: dict[str, dict[str, Any] | None] = {}
        self.created_at = self.clock()
        self.reattached = False
        self.beats: dict[int, WorkerHeartbeat] = {}

    def ensure_jobset(self, manifest: Mapping[str, Any]) -> None:
        """Create the attempt's JobSet, or re-attach when it already exists (the supervisor's pod was lost).

        Raises:
            AlreadyDecided: The JobSet is gone and this attempt's verdict is in the store: an earlier try of
                this step decided and stopped it (never create a second gang for a decided attempt).
        """
        from kubernetes.client import ApiException

        existing = self.cluster.get_jobset()
        if existing is None:
            decided = recorded_verdict(self.store, self.attempt)
            if decided is not None:
                raise AlreadyDecided(decided)
            try:
                self.cluster.create_jobset(manifest)
                self.say(f"created JobSet {self.cluster.name}")
                return
            except ApiException as e:
                if e.status != 409:
                    raise
                existing = self.cluster.get_jobset()
        labels = ((existing or {}).get("metadata") or {}).get("labels") or {}
        if labels.get(ATTEMPT_LABEL) not in (None, str(self.attempt)):
            raise SegmentError(
                ExitCode.CONFIGURATION,
                f"JobSet {self.cluster.name} exists but belongs to attempt {labels.get(ATTEMPT_LABEL)}, not "
                f"{self.attempt}: provision-slice must delete it first",
            )
        self.reattached = True
        self.created_at = _ts(((existing or {}).get("metadata") or {}).get("creationTimestamp")) or self.clock()
        self.say(f"re-attached to JobSet {self.cluster.name} (it already exists: not creating a second gang)")

    def check_watchers(self) -> None:
        """Leave transient (exit 69, retried; the retry re-attaches) when a watcher has failed too long."""
        for w in self.watch.values():
            if w.failing_for() > SYNC_TIMEOUT_S:
                raise SegmentError(
                    ExitCode.TRANSIENT,
                    f"the {w.kind} watch has failed for {w.failing_for():.0f} s ({w.error}): not deciding on a "
                    "stale view; the gang is left running for the retry to re-attach",
                )

    def observe(self) -> tuple[Observation, list[WorkerHeartbeat]]:
        """The attempt now."""
        now = self.clock()
        pods = self.watch["pods"].snapshot()
        waits: dict[str, WaitClock] = {}
        for p in pods:
            po = pod_observation(p, None)
            # The clock of a pod's current pull or creation failure: kept while the same failure repeats, started
            # again when it changes, dropped once the container starts.
            clock = wait_clock(self.waits.get(po.name), po.waiting_reason, po.waiting_message, now)
            if clock is not None:
                waits[po.name] = clock
        self.waits = waits
        for name in sorted({n for p in pods if (n := (p.get("spec") or {}).get("nodeName"))}):
            with contextlib.suppress(Exception):  # an unreadable node keeps its last known state
                self.node_cache[name] = self.cluster.get_node(name)
        # When each lost node was first seen lost: the grace counts from it when the node's Ready condition gives no
        # time (the Node is gone). A node seen healthy again starts over.
        for name, body in self.node_cache.items():
            if node_observation(name, body).lost:
                self.lost_seen.setdefault(name, now)
            else:
                self.lost_seen.pop(name, None)
        beats = read_heartbeats(self.store, self.attempt, self.hosts, self.beats)
        self.beats = {b.process_index: b for b in beats}
        js = self.watch["jobset"].snapshot()
        obs = observation(now=now, expected=self.hosts, jobset=js[0] if js else None,
                          jobs=self.watch["jobs"].snapshot(), pods=pods, nodes=dict(self.node_cache), beats=beats,
                          waits=self.waits, created_at=self.created_at, lost_seen=self.lost_seen)  # fmt: skip
        return obs, beats

    def snapshot(self) -> ClusterSnapshot:
        """The JobSet, its Jobs, pods and their nodes as the watches hold them now (recorded before the stop)."""
        js = self.watch["jobset"].snapshot()
        return ClusterSnapshot(
            taken_at=self.clock(),
            jobset=jobset_from_api(js[0]) if js else None,
            jobs=[job_from_api(j) for j in self.watch["jobs"].snapshot()],
            pods=[pod_from_api(p) for p in self.watch["pods"].snapshot()],
            nodes=[node_from_api(n) if n is not None else NodeEvidence(name=name, found=False)
                   for name, n in sorted(self.node_cache.items())],
        )  # fmt: skip

    def run(self, manifest: Mapping[str, Any]) -> SupervisionRecord:
        """Create or re-attach, supervise until over, stop, and record. Returns the supervision record."""
        self.ensure_jobset(manifest)
        for w in self.watch.values():
            w.start()
        try:
            give_up = self.clock() + SYNC_TIMEOUT_S
            for w in self.watch.values():
                while not w.synced.wait(1):
                    if w.error:
                        self.say(f"waiting for the {w.kind} watch: {w.error}")
                    if self.clock() > give_up:
                        raise SegmentError(
                            ExitCode.TRANSIENT,
                            f"cannot list the attempt's {w.kind} for {SYNC_TIMEOUT_S} s: {w.error or 'no answer'}; "
                            "the gang is left running for the retry to re-attach",
                        )
            interval = self.cfg.supervision.watch_interval_s
            while True:
                self.check_watchers()
                lost = self.renew(self.clock()) if self.renew is not None else None
                if lost is not None:
                    self.say(f"{lost}: deleting this Workflow's gang, the run belongs to another one now")
                    self.cluster.delete_jobset()
                    raise SegmentError(ExitCode.CONFIGURATION, f"{lost}; this Workflow's JobSet was deleted")
                obs, beats = self.observe()
                verdict = decide(obs, self.cfg.supervision)
                self.progress.update(obs, verdict)
                ckpts = [b.checkpoint_step for b in beats if b.checkpoint_step is not None]
                self.progress.checkpoint(max(ckpts) if ckpts else None)
                if verdict.over:
                    break
                self.changed.wait(interval)
                self.changed.clear()
            detected = self.clock()
            record = SupervisionRecord(
                attempt=self.attempt, jobset=self.cluster.name, outcome=verdict.state.value,
                stall_kind=verdict.kind.value if verdict.kind else None, reason=verdict.reason, worker=verdict.worker,
                created_at=self.created_at, reattached=self.reattached, detected_at=detected,
                last_step=max((b.step for b in beats if b.step is not None), default=None),
                checkpoint_step=max(ckpts) if ckpts else None, workers=worker_records(obs, beats, self.hosts),
                evidence=evidence_lines(obs), snapshot=self.snapshot(),
            )  # fmt: skip
            # The verdict is in the store before anything is stopped: a supervisor that cannot report does not
            # act (its retry re-attaches to the gang and decides again), and one lost during the stop leaves
            # its verdict for the retry (``recorded_verdict``) instead of a deleted gang it would re-create.
            self.store.write_record(RunLayout.supervision(self.attempt), record)
            if verdict.state != AttemptState.SUCCEEDED:
                record = self.stop_attempt(record)
            else:
                record = record.model_copy(update={"stopped_at": detected})
            # After the stop: a worker that got SIGTERM saved its step on the way out.
            newest = newest_complete_step(self.store)
            if newest is not None and (record.checkpoint_step is None or newest > record.checkpoint_step):
                record = record.model_copy(update={"checkpoint_step": newest})
            return record
        finally:
            self.stop.set()

    def stop_attempt(self, record: SupervisionRecord) -> SupervisionRecord:
        """Delete the JobSet; force-delete pods stuck Terminating on a lost node; wait for the pods to go."""
        started = self.clock()
        self.say(f"stopping the attempt: deleting JobSet {self.cluster.name}")
        self.cluster.delete_jobset()
        grace = self.cfg.supervision.force_delete_grace_s
        pod_grace = max((int(((p.get("spec") or {}).get("terminationGracePeriodSeconds") or 30))
                         for p in self.watch["pods"].snapshot()), default=30)  # fmt: skip
        bound = started + grace + pod_grace + STOP_SLACK_S
        forced: list[str] = []
        while True:
            obs, _ = self.observe()
            if not obs.pods:
                return record.model_copy(update={"stopped_at": self.clock(), "force_deleted": forced})
            now = self.clock()
            nodes = {n.name: n for n in obs.nodes}
            for p in obs.pods:
                n = nodes.get(p.node) if p.node else None
                if p.name not in forced and n is not None and n.lost and now - started >= grace:
                    # The kubelet of a lost node never confirms the kill; the pod would stay Terminating
                    # until the Node object is deleted (GKE-NOTES: taint manager, pod GC, jobset#576).
                    self.say(f"force-deleting pod {p.name}: Terminating on node {p.node}, which is lost")
                    self.cluster.force_delete_pod(p.name)
                    forced.append(p.name)
            if now >= bound:
                left = ", ".join(p.name for p in obs.pods)
                self.say(f"pods still present after {now - started:.0f} s: {left}")
                evidence = [*record.evidence, f"pods left after stop: {left}"]
                return record.model_copy(update={"force_deleted": forced, "evidence": evidence})
            self.changed.wait(min(1.0, self.cfg.supervision.watch_interval_s))
            self.changed.clear()


# --- the step program ----------------------------------------------------------------------------


def load_manifest(text: str, attempt: int) -> dict[str, Any]:
    """The JobSet manifest (JSON or YAML) as rendered by ``workflows.jobset``; SegmentError when unusable."""
    try:
        manifest = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1} column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise SegmentError(
            ExitCode.CONFIGURATION, f"--jobset-manifest: not JSON or YAML ({problem}{at}); pass the rendered JobSet"
        ) from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("kind") != "JobSet"
        or not (manifest.get("metadata") or {}).get("name")
    ):
        raise SegmentError(ExitCode.CONFIGURATION, "--jobset-manifest: expected a JobSet with metadata.name")
    return manifest


def lease_renewal(
    store: RunStore, holder: str, ttl_s: float, say: Callable[[str], None]
) -> Callable[[float], str | None]:
    """A per-loop call that renews the run lease when due; it returns a line when the lease was lost."""
    from recovery_steps import lease

    state = {"next_at": 0.0}

    def renew(at: float) -> str | None:
        r = lease.renew_if_due(store, holder, ttl_s, at, next_at=state["next_at"])
        state["next_at"] = r.next_at
        if r.line:
            say(r.line)
        return (r.line or "the run lease is lost") if r.status == lease.RenewStatus.LOST else None

    return renew


def outputs_of(record: SupervisionRecord) -> SegmentOutputs:
    """The step's declared outputs from its supervision record."""
    return SegmentOutputs(
        outcome=record.outcome,
        stall_kind=record.stall_kind or "",
        reason=record.reason,
        last_step=record.last_step if record.last_step is not None else -1,
        checkpoint_step=record.checkpoint_step if record.checkpoint_step is not None else -1,
    )


def run(
    store_root: str,
    run_id: str,
    attempt: int,
    manifest_text: str,
    output_dir: Path,
    *,
    api_client: Any = None,
    k8s_host: str | None = None,
    clock: Callable[[], float] = time.time,
    progress_file: str | None = None,
    say: Callable[[str], None] = log.info,
    holder: str | None = None,
) -> SupervisionRecord:
    """Supervise attempt ``attempt`` of the run to its end; write the record and the outputs.

    ``holder`` (the Workflow's uid) renews the run lease while the segment runs (``lease.renew_if_due``): a
    segment outlives the lease's TTL. A lease another Workflow holds now ends this one's gang (exit 2).

    Raises:
        SegmentError: The attempt cannot be supervised (its ``code`` is the exit code).
    """
    import urllib3
    from kubernetes.client import ApiException

    from recovery_steps.provision_slice import ProvisionError, k8s_config_errors, load_run_config

    try:
        cfg = load_run_config(store_root, run_id)
    except ProvisionError as e:
        raise SegmentError(e.code, str(e)) from None
    manifest = load_manifest(manifest_text, attempt)
    store = RunStore(store_root, run_id)
    if api_client is None:
        from recovery_steps.kernel.k8s import make_api_client

        try:
            api_client = make_api_client(k8s_host)
        except k8s_config_errors() as e:
            detail = " ".join(str(e).split())[:200]
            raise SegmentError(
                ExitCode.CONFIGURATION,
                f"no Kubernetes API: {type(e).__name__}: {detail}; run in the cluster or give --k8s-host",
            ) from None
    cluster = Cluster(api_client, manifest["metadata"].get("namespace") or cfg.namespace, manifest["metadata"]["name"])
    sup = Supervisor(cfg, attempt, cluster, store, clock=clock, progress_file=progress_file, say=say,
                     renew=lease_renewal(store, holder, cfg.retry.lease_ttl_s, say) if holder else None)  # fmt: skip
    try:
        record = sup.run(manifest)
    except AlreadyDecided as done:
        say(f"attempt {attempt} was decided by an earlier try of this step ({done.record.outcome}); its JobSet is gone")
        record = done.record
    except (ApiException, urllib3.exceptions.HTTPError, OSError) as e:
        code = ExitCode(api_exit_code(e))
        hint = (
            "; retried in place (the retry re-attaches to a gang already created)"
            if code == ExitCode.TRANSIENT
            else ": check argo/rbac.yaml is applied and the JobSet CRD is installed"
        )
        raise SegmentError(code, api_error_line(e) + hint) from None
    store.write_record(RunLayout.supervision(attempt), record)
    outputs_of(record).write(output_dir)
    return record


def record_error(store_root: str, run_id: str, attempt: int, e: SegmentError) -> None:
    """Leave the reason the attempt could not be supervised where classify-failure reads it."""
    rec = SupervisionRecord(attempt=attempt, jobset="", outcome="error", exit_code=int(e.code), reason=str(e),
                            detected_at=now())  # fmt: skip
    try:
        RunStore(store_root, run_id).write_record(RunLayout.supervision(attempt), rec)
    except store_errors() as err:
        print(f"train-segment: could not record the error in the run store: {err}", file=sys.stderr)


class Terminated(BaseException):
    """SIGTERM reached the supervisor (a BaseException: no handler of the loop swallows it)."""


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated()


def left_behind(store_root: str, run_id: str, attempt: int) -> str:
    """One line for a supervisor stopped by SIGTERM: what it leaves and who takes it over."""
    with contextlib.suppress(Exception):
        decided = recorded_verdict(RunStore(store_root, run_id), attempt)
        if decided is not None:
            return (
                f"SIGTERM after the verdict on attempt {attempt} ({decided.outcome}: {decided.reason}); its stop may "
                "be unfinished: a retry finds the verdict, provision-slice deletes what is left"
            )
    return (f"SIGTERM: the gang of attempt {attempt} is left running without a verdict; a retry of this step "
            "re-attaches to it, classify-failure has it supervised again, and the exit handler of a stopped run "
            "deletes it")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    ap = cli.StepArgumentParser(prog="python -m recovery_steps.train_segment", description=__doc__.split("\n")[0])
    ap.add_argument("--store-root", required=True, type=cli.store_root)
    ap.add_argument("--run-id", required=True, type=cli.run_id)
    ap.add_argument("--attempt", type=cli.attempt, required=True)
    ap.add_argument("--jobset-manifest", required=True, help="the JobSet manifest, JSON or YAML (or @FILE)")
    ap.add_argument("--output-dir", type=cli.output_dir, default=Path("/tmp/outputs"))
    ap.add_argument(
        "--k8s-host", default=None, type=cli.http_url, help="Kubernetes API URL (default: in-cluster config)"
    )
    ap.add_argument("--holder", default=None, help="the Workflow's uid: renew the run lease while the segment runs")
    args = ap.parse_args(argv)
    cli.ready_output_dir(ap, args.output_dir, SegmentOutputs.names())  # before a JobSet is created or deleted
    logging.basicConfig(level=logging.INFO, format="%(asctime)s train-segment %(levelname)s %(message)s")
    text = args.jobset_manifest
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as e:
            return cli.fail("train-segment", f"--jobset-manifest: {e.strerror or e}", int(ExitCode.CONFIGURATION))
    # `argo stop`/`argo terminate`, a drain or an eviction SIGTERMs this pod: say what is left behind.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        record = run(args.store_root, args.run_id, args.attempt, text, args.output_dir, k8s_host=args.k8s_host,
                     progress_file=os.environ.get("ARGO_PROGRESS_FILE"), holder=args.holder)  # fmt: skip
    except Terminated:
        print(f"train-segment: {left_behind(args.store_root, args.run_id, args.attempt)}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except SegmentError as e:
        print(f"train-segment: {e}", file=sys.stderr)
        record_error(args.store_root, args.run_id, args.attempt, e)
        return int(e.code)
    except store_errors() as e:
        # The verdict is written before the stop: a retry re-attaches to a gang still there, or finds the verdict.
        url = RunStore(args.store_root, args.run_id).url()
        return cli.fail("train-segment", cli.store_error_line("train-segment", url, e), int(ExitCode.TRANSIENT))
    print(" ".join(f"{k}={v}" for k, v in outputs_of(record).files().items()))
    return int(ExitCode.OK if record.outcome == AttemptState.SUCCEEDED else ExitCode.ATTEMPT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
