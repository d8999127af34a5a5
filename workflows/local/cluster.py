"""The local cluster: the JobSets of one local run by name, and their worker processes.

``LocalCluster`` is the one place a local slice is created from its JobSet manifest, found by its JobSet's name,
polled, stopped and force-deleted; the controllers (``controllers.LocalControllers``) do so for what the steps ask of
the local cluster's Kubernetes API. What a local process gets in place of a pod (``python`` mapped to this
interpreter, the container paths mapped into a folder, the env's fieldRefs resolved) is here too: the executor's
container templates run the same way.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from jaxrec.adapters.kube import IN_POD_ENV
from jaxrec.model.names import ATTEMPT_LABEL, NODEPOOL_LABEL, TERMINATION_LOG_ENV
from jaxrec.model.records import now
from workflows.local.emulator import free_port
from workflows.local.engine import FAILED, SUCCEEDED, NodePhase, WorkflowError
from workflows.local.slices import FIRST_POOL, LocalSlice, WorkerProc

_PATH_PREFIXES = ("/tmp/outputs", "/tmp/inputs")
COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"
# How often a running slice's hooks act (fault injection), and a killed slice's workers are reaped.
TICK = 0.05
# How long the whole run's deletion waits for the SIGKILLed workers of a slice to be reaped.
KILL_WAIT_S = 10.0


def rewrite_arg(arg: str, node_dir: Path) -> str:
    """Map the container paths ``/tmp/outputs`` and ``/tmp/inputs`` (anywhere in ``arg``) into ``node_dir``."""
    for prefix in _PATH_PREFIXES:
        arg = arg.replace(prefix, str(node_dir / prefix.removeprefix("/tmp/")))
    return arg


def local_command(command: list[str], node_dir: Path) -> list[str]:
    """The container command as a local one: ``python`` is this interpreter; container paths mapped."""
    out = [rewrite_arg(str(a), node_dir) for a in command]
    if out and out[0] in ("python", "python3", "python3.11", "/usr/bin/python3", "/usr/local/bin/python"):
        out[0] = sys.executable
    return out


def resolve_env(env: list[Mapping[str, Any]], field_values: Mapping[str, str]) -> dict[str, str]:
    """A container's ``env`` list as a dict, ``valueFrom.fieldRef`` resolved from ``field_values``.

    Raises:
        WorkflowError: for a fieldRef this runner cannot resolve.
    """
    out = {}
    for e in env or []:
        if "value" in e:
            out[e["name"]] = str(e["value"])
            continue
        ref = (e.get("valueFrom") or {}).get("fieldRef")
        if ref is None:
            continue  # secrets and config maps do not exist locally
        path = ref["fieldPath"]
        if path not in field_values:
            raise WorkflowError(f"env {e['name']}: fieldRef {path!r} is not known to the local runner")
        out[e["name"]] = field_values[path]
    return out


def process_env(repo_root: Path, base_env: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a local process: this one's, ``base_env``, the repository on ``PYTHONPATH``, ``extra``."""
    # Not a pod, even when the runner itself runs in one: the steps act on local processes (adapters.kube.in_pod).
    env = {k: v for k, v in os.environ.items() if k != IN_POD_ENV}
    env.update(base_env)
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(repo_root) + (os.pathsep + pp if pp else "")
    env.update(extra)
    return env


def arg_value(cmd: list[str], flag: str) -> str | None:
    """The value a command line gives ``flag`` (``--flag v`` or ``--flag=v``), None when it gives none."""
    for i, a in enumerate(cmd):
        if a == flag and i + 1 < len(cmd):
            return cmd[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def read_manifest(manifest: Mapping[str, Any]) -> tuple[Mapping[str, Any], int]:
    """The first replicated Job of a JobSet manifest and its pod count.

    Raises:
        KeyError, IndexError, TypeError, ValueError: the manifest lacks what a slice is made from.
    """
    rj = manifest["spec"]["replicatedJobs"][0]
    job_spec = rj["template"]["spec"]
    job_spec["template"]["spec"]["containers"][0]  # noqa: B018 - a slice's workers run this container
    return rj, int(job_spec.get("parallelism") or job_spec.get("completions") or 1) * int(rj.get("replicas", 1))


class SliceHooks:
    """What the runner lets an injector do around a local slice (all optional)."""

    def extra_env(self, attempt: int) -> dict[str, str]:
        """Environment added to every worker of ``attempt``."""
        return {}

    def on_tick(self, sl: LocalSlice) -> None:
        """Called about every 50 ms while the slice runs."""

    def after_slice(self, sl: LocalSlice, phase: NodePhase) -> None:
        """Called once every worker has exited, before the record is written and the next node runs."""

    def withheld(self, attempt: int, hosts: int) -> dict[int, str]:
        """Workers of ``attempt`` the slice does not start, and the reason their pod would show."""
        return {}

    def placement(self, attempt: int, hosts: int) -> list[str]:
        """The node each worker of ``attempt`` runs on (its host-local directory is ``hosts/<node>``)."""
        return [f"local-host-{i}" for i in range(hosts)]


@dataclass(frozen=True)
class ClusterSetup:
    """What every slice of a local cluster is made with."""

    repo_root: Path
    work_dir: Path
    base_env: Mapping[str, str] = field(default_factory=dict)
    events_dir: Path | None = None  # None: work_dir / "events"
    # None: each JobSet's own terminationGracePeriodSeconds (a number overrides it, for benchmarks).
    grace_seconds: float | None = None
    # Its node pools, each a slice's worth of hosts (``slices.node_pools``); a JobSet's gang runs on one of them.
    node_pools: tuple[str, ...] = (FIRST_POOL,)

    @property
    def events(self) -> Path:
        """The folder the workers write their events to."""
        return self.events_dir or (self.work_dir / "events")


def scheduled_pool(pod_spec: Mapping[str, Any], pools: tuple[str, ...]) -> str:
    """The node pool a gang with ``pod_spec``'s node affinity lands on, as the scheduler would choose it.

    Each pool scores the weights of the preferred node-affinity terms on the pool label its nodes match
    (kube-scheduler's NodeAffinity score; JobSet's exclusive placement puts the whole gang in the leader's pool);
    the highest scores, the first pool listed on a tie. A preference never keeps a gang from running: with one pool
    it is always that one. Other kinds of term, and required terms, are not modelled (the product renders none).
    """
    affinity = (pod_spec.get("affinity") or {}).get("nodeAffinity") or {}
    preferred = affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []

    def score(pool: str) -> int:
        total = 0
        for term in preferred:
            exprs = (term.get("preference") or {}).get("matchExpressions") or []
            if exprs and all(_pool_matches(e, pool) for e in exprs):
                total += int(term.get("weight", 0))
        return total

    return max(pools, key=lambda p: (score(p), -pools.index(p)))


def _pool_matches(expr: Mapping[str, Any], pool: str) -> bool:
    """Whether a node of ``pool`` matches one node selector requirement (only the pool label is known of it)."""
    if expr.get("key") != NODEPOOL_LABEL:
        return False
    values, op = expr.get("values") or [], expr.get("operator")
    return {"In": pool in values, "NotIn": pool not in values, "Exists": True}.get(op, False)


class LocalCluster:
    """The JobSets of a local run by name: their worker processes, and their pods and nodes as the API shows them.

    One per run: every Workflow of the run (a continuation, one submitted again) finds the JobSets the ones before
    it left.
    """

    def __init__(self, setup: ClusterSetup, hooks: SliceHooks | None = None):
        self.setup = setup
        self.hooks = hooks or SliceHooks()
        self._lock = threading.Lock()
        # Every slice this cluster created, in order (the runner times its incidents from them).
        self.slices: list[LocalSlice] = []
        # JobSets whose workers are still running: a retried supervisor re-attaches to them.
        self._live: dict[str, LocalSlice] = {}

    @property
    def live(self) -> Mapping[str, LocalSlice]:
        """The JobSets whose workers still run, by name (a read-only view)."""
        return MappingProxyType(self._live)

    def latest(self, attempt: int) -> LocalSlice | None:
        """The last slice created for ``attempt``."""
        return next((sl for sl in reversed(self.slices) if sl.attempt == attempt), None)

    def supervisor_lost(self, attempt: int) -> bool:
        """Whether a hook made the supervisor of ``attempt`` lose its pod (rehearsal); asking clears it."""
        sl = self.latest(attempt)
        if sl is None or not sl.supervisor_lost.is_set():
            return False
        sl.supervisor_lost.clear()
        return True

    def kill_all(self) -> None:
        """The Workflow is deleted with its gangs: SIGKILL every running slice's workers and settle it, unhooked."""
        for sl in list(self._live.values()):
            self.kill(sl)
            self.settle(sl, now(), True, None, hooks=False)

    def find(self, name: str) -> LocalSlice | None:
        """The slice of JobSet ``name`` if its workers still run."""
        return self._live.get(name)

    def adopt(self, sl: LocalSlice) -> None:
        """Hold ``sl`` as the running JobSet of its name (one a lost supervisor left running, to re-attach to)."""
        self._live[sl.jobset] = sl

    def create(self, manifest: Mapping[str, Any]) -> LocalSlice | None:
        """Create the JobSet ``manifest`` describes and start its workers (those a hook withholds stay Pending).

        None when a JobSet of that name is running already. The manifest is one the API admitted
        (``read_manifest`` reads it).
        """
        if manifest["metadata"]["name"] in self._live:
            return None
        sl = self.build_slice(manifest)
        sl.withheld = dict(self.hooks.withheld(sl.attempt, len(sl.workers)))
        with self._lock:
            self.slices.append(sl)
            self._live[sl.jobset] = sl
        self.setup.events.mkdir(parents=True, exist_ok=True)
        for w in sl.workers:
            if w.index not in sl.withheld:
                sl.spawn(w)
        return sl

    def build_slice(self, manifest: Mapping[str, Any]) -> LocalSlice:
        """The slice of the JobSet ``manifest``, its workers not started: one per pod of its first replicated Job.

        The JobSet's own folder maps the container paths; the attempt is the command's, else the JobSet's label.
        """
        setup = self.setup
        name, rj, n = manifest["metadata"]["name"], *read_manifest(manifest)
        job_spec = rj["template"]["spec"]
        pod_spec = job_spec["template"]["spec"]
        c = pod_spec["containers"][0]
        command = local_command([*c.get("command", []), *c.get("args", [])], setup.work_dir / "jobsets" / name)
        labelled = (manifest["metadata"].get("labels") or {}).get(ATTEMPT_LABEL)
        attempt = int(arg_value(command, "--attempt") or labelled or 0)
        log_dir = setup.work_dir / "logs" / f"attempt-{attempt}"
        sl = LocalSlice(name, attempt, command, str(setup.repo_root), log_dir)
        sl.failure_policy = list((job_spec.get("podFailurePolicy") or {}).get("rules") or [])
        sl.backoff_limit = int(job_spec.get("backoffLimit", 6))
        sl.namespace = str(manifest["metadata"].get("namespace") or "default")
        sl.image = str(c.get("image", ""))
        sl.pod_labels = {
            str(k): str(v) for k, v in ((job_spec["template"].get("metadata") or {}).get("labels") or {}).items()
        }
        # The kubelet's default grace is 30 s when the pod spec names none (Kubernetes API PodSpec).
        grace = pod_spec.get("terminationGracePeriodSeconds", 30)
        sl.grace_seconds = float(grace if setup.grace_seconds is None else setup.grace_seconds)
        # A gang of one joins no coordinator: no port is taken (a machine may let no process open a socket).
        port = free_port() if n > 1 else 0
        extra = self.hooks.extra_env(attempt)
        sl.pool = scheduled_pool(pod_spec, setup.node_pools)
        # The hooks place the workers on the first pool's hosts (and replace them); another pool's are its own.
        nodes = (
            self.hooks.placement(attempt, n)
            if sl.pool == setup.node_pools[0]
            else [f"{sl.pool}-host-{i}" for i in range(n)]
        )
        for i in range(n):
            pod = f"{name}-{rj.get('name', 'workers')}-0-{i}"
            fields = {
                f"metadata.annotations['{COMPLETION_INDEX_KEY}']": str(i),
                f"metadata.labels['{COMPLETION_INDEX_KEY}']": str(i),
                "metadata.name": pod,
                "metadata.namespace": manifest["metadata"].get("namespace", "default"),
                "status.podIP": "127.0.0.1",
                "spec.nodeName": nodes[i],
            }
            env = resolve_env(c.get("env", []), fields)
            env.setdefault("TRAINER_COORDINATOR_ADDRESS", f"127.0.0.1:{port}")
            env.setdefault("TRAINER_NUM_PROCESSES", str(n))
            env["JOB_COMPLETION_INDEX"] = str(i)
            env["HOSTNAME"] = pod
            # One machine, one directory per node: what a hostPath volume is to the pods of one node.
            env.setdefault("TRAINER_LOCAL_DIR", str(setup.work_dir / "hosts" / nodes[i]))
            env.setdefault("TRAINER_EVENTS_DIR", str(setup.events))
            # Each container's own terminationMessagePath, as the kubelet gives it one.
            env.setdefault(TERMINATION_LOG_ENV, str(log_dir / f"{pod}.termination-log"))
            env.update(extra)
            sl.workers.append(WorkerProc(i, process_env(setup.repo_root, setup.base_env, env)))
        return sl

    @staticmethod
    def poll(sl: LocalSlice) -> None:
        """Reap the workers of ``sl`` that exited (a worker restarted on purpose is not reaped)."""
        with sl.lock:
            for w in sl.workers:
                if w.returncode is None and w.proc is not None and w.index not in sl.expected_exit:
                    rc = w.proc.poll()
                    if rc is not None:
                        w.returncode, w.ended_at = rc, w.exited_at or now()

    def tick(self, sl: LocalSlice, at: float) -> None:
        """Let time pass for ``sl``: its kubelets keep the deleted pods' grace; the hooks act on a running slice.

        The kubelet SIGKILLs a deleted pod's container once its termination grace is over (the pod's own, or its
        JobSet's deletion's); a lost host has no kubelet to do it.
        """
        for w in sl.workers:
            if w.kill_at is not None and at >= w.kill_at and w.index not in sl.lost:
                sl.signal_worker(w.index, signal.SIGKILL)
        if sl.deleted_at is None:
            self.hooks.on_tick(sl)

    @staticmethod
    def delete(sl: LocalSlice, at: float) -> None:
        """Delete the JobSet of ``sl`` at ``at``: SIGTERM every running worker whose host is not lost.

        Deleting the JobSet deletes its pods: the kubelet sends SIGTERM and starts the pod's termination grace
        (Kubernetes docs "Pod Lifecycle", termination of pods).
        """
        sl.deleted_at = at
        for w in sl.workers:
            if w.returncode is None and w.proc is not None and w.index not in sl.lost:
                w.stopped_by_jobset = True
                w.kill_at = min(w.kill_at or float("inf"), at + sl.grace_seconds)
                sl.signal_worker(w.index, signal.SIGCONT)
                sl.signal_worker(w.index, signal.SIGTERM)

    @staticmethod
    def delete_pod(sl: LocalSlice, pod: str, grace_s: float, at: float, disruption: dict | None = None) -> None:
        """Delete one pod of ``sl``: its kubelet sends SIGTERM now and SIGKILL once ``grace_s`` is over.

        ``disruption``: the DisruptionTarget condition an eviction stamped on it, which its status keeps.
        """
        w = sl.worker_of(pod)
        if w is not None and w.returncode is None and w.deleted_at is None:
            w.deleted_at, w.kill_at, w.disruption = at, at + grace_s, disruption
            sl.signal_worker(w.index, signal.SIGCONT)
            sl.signal_worker(w.index, signal.SIGTERM)

    @staticmethod
    def force_delete(sl: LocalSlice, pod: str) -> None:
        """SIGKILL the worker of ``pod`` (its host is lost: nothing else would end it)."""
        w = sl.worker_of(pod)
        if w is not None:
            sl.signal_worker(w.index, signal.SIGCONT)
            sl.signal_worker(w.index, signal.SIGKILL)

    def kill(self, sl: LocalSlice) -> None:
        """The whole run is deleted: SIGKILL every worker of ``sl``, wait up to ``KILL_WAIT_S`` for them."""
        for w in sl.workers:
            sl.signal_worker(w.index, signal.SIGCONT)
            sl.signal_worker(w.index, signal.SIGKILL)
        end = now() + KILL_WAIT_S
        while now() < end and any(w.returncode is None and w.proc is not None for w in sl.workers):
            self.poll(sl)
            time.sleep(TICK)

    def settle(self, sl: LocalSlice, detected: float, failed: bool, worker: int | None, *, hooks: bool = True) -> None:
        """The slice's own state once its supervisor is done: when the end was seen, which worker failed first.

        The JobSet is no longer running (nothing re-attaches to it); the hooks see it unless told not to (the
        Workflow is being deleted).
        """
        sl.detected_at, sl.phase = detected, FAILED if failed else SUCCEEDED
        exited = [w for w in sl.workers if w.returncode not in (None, 0) and (w.ended_at or detected) <= detected]
        if failed and exited and sl.first_failure_index is None:
            first = min(exited, key=lambda w: w.ended_at or detected)
            first.first_failure, sl.first_failure_index = True, first.index
        elif failed and worker is not None and sl.first_failure_index is None:
            sl.first_failure_index = worker
        sl.mark_stopped(detected)
        with self._lock:
            self._live.pop(sl.jobset, None)
        if hooks:
            self.hooks.after_slice(sl, sl.phase)
