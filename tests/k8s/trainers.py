"""Runs of argo/local-cpu.yaml with real trainers in the real-controller tier: submission, waits and clean-up
(the gang's pods run as processes on podexec's nodes; see ``podexec``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import argoctl
from argoctl import LOCAL_ARGO_FILE
from realcluster import RealCluster, wait_for
from tier import HOSTS, INDEX, REPO, CpuHosts

from jaxrec.adapters.documents import read_worker_reports
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import load_config
from jaxrec.model.names import jobset_name

TERMINAL = argoctl.TERMINAL
TOTAL_STEPS = load_config(REPO / "configs" / LOCAL_ARGO_FILE).training.total_steps


@dataclass
class TrainerRun:
    """One submission of argo/local-cpu.yaml with a run id and a GCS prefix of its own."""

    rc: RealCluster
    hosts: CpuHosts
    store_root: str
    run_id: str
    name: str = ""
    seconds: float = 0.0
    nodes: set[str] = field(default_factory=set)
    gang: int = HOSTS  # worker processes of the run's gang
    shape: Callable[[dict[str, Any]], None] | None = None  # what the run changes in the file's config, if anything

    @property
    def ns(self) -> str:
        return self.hosts.namespace

    @property
    def store(self) -> RunStore:
        return RunStore(self.store_root, self.run_id)

    def submit(self, params: dict[str, str] | None = None, edit_config=None) -> str:
        """Submit the file for this run (``params`` over its own, ``edit_config``: ``argoctl.submit``)."""
        params = {"store-root": self.store_root, "run-id": self.run_id, **(params or {})}
        edits = [e for e in (self.shape, edit_config) if e is not None]

        def edit(cfg: dict[str, Any]) -> None:
            for e in edits:
                e(cfg)

        wf = argoctl.submit(self.rc, REPO / "argo" / LOCAL_ARGO_FILE, params, edit_config=edit if edits else None)
        self.name = wf["metadata"]["name"]
        return self.name

    def wf(self) -> dict[str, Any]:
        return argoctl.workflow(self.rc, self.ns, self.name)

    def wait_done(self, timeout: float) -> dict[str, Any]:
        return argoctl.wait_finished(self.rc, self.ns, self.name, timeout)

    def workers(self, attempt: int, timeout: float = 240) -> list[dict[str, Any]]:
        """The attempt's worker pods once all are Running, by completion index."""
        sel = f"jobset.sigs.k8s.io/jobset-name={jobset_name(self.run_id, attempt)}"

        def running():
            pods = [p for p in self.rc.pods(self.ns, sel) if p["status"].get("phase") == "Running"]
            n = self.gang
            return sorted(pods, key=lambda p: int(p["metadata"]["labels"][INDEX])) if len(pods) >= n else None

        return self.until(f"{self.gang} worker pods Running of attempt {attempt}", running, timeout, 0.5)

    def committed_past(self, attempt: int, timeout: float = 300) -> tuple[int, int]:
        """Wait until a checkpoint has committed (manifest written) and the attempt trained past it; both steps."""

        def past():
            steps = [s for s in self.store.checkpoint_steps() if self.store.exists(RunLayout.checkpoint_manifest(s))]
            beats = [
                self.store.read_json(RunLayout.heartbeat(attempt, i))
                for i in range(self.gang)
                if self.store.exists(RunLayout.heartbeat(attempt, i))
            ]
            step = min((b["step"] for b in beats), default=None) if len(beats) == self.gang else None
            return (steps[-1], step) if steps and step is not None and step > steps[-1] else None

        return self.until(f"attempt {attempt} past a committed checkpoint", past, timeout, 0.2)

    def until(self, what: str, check: Any, timeout: float, interval: float) -> Any:
        """``wait_for(check)``, failing at once (with the Workflow's nodes) when the Workflow ends first."""
        ended = object()

        def probe():
            got = check()
            return got if got else ended if (self.wf().get("status") or {}).get("phase") in TERMINAL else None

        try:
            got = wait_for(what, probe, timeout, interval)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{argoctl.summary(self.wf())}") from None
        if got is ended:
            raise AssertionError(f"{what}: the Workflow ended first\n{argoctl.summary(self.wf())}")
        return got


def clean_run(rc: RealCluster, ns: str, run_id: str | None) -> None:
    """Delete the run's Workflows, JobSets and pods (every run's when ``run_id`` is None); wait until no pod of
    them is left."""
    from kubernetes import client

    objs = client.CustomObjectsApi(rc.admin)
    sel = f"jaxrec/run-id={run_id}" if run_id else "jaxrec/run-id"
    what = run_id or "any run"
    for group, plural in (("argoproj.io", "workflows"), ("jobset.x-k8s.io", "jobsets")):
        version = "v1alpha1" if group == "argoproj.io" else "v1alpha2"
        objs.delete_collection_namespaced_custom_object(group, version, ns, plural, label_selector=sel)
    # Argo's pods go with their Workflow (garbage collector), but not always within the wait: delete them too.
    rc.core().delete_collection_namespaced_pod(ns, label_selector=sel)
    try:
        wait_for(f"no pods of {what} left", lambda: not rc.pods(ns, sel), STALE_JOBS_S, 0.5)
        return
    except AssertionError:
        held = _held_by_a_stale_job_view(rc, ns, sel)
    if held:
        # kube-controller-manager's view of Jobs stuck behind its own writes after an API server restart: it
        # refuses to sync ("read version ... is not as new as written version ... jobs.batch", the stale-controller
        # check of kubernetes v1.36 pkg/controller/util/consistency) and never sees the Job gone, so it never takes
        # its tracking finalizer off the Job's deleted, finished pods. Done as an operator would: restart it (it
        # lists every Job and pod again); counted as a finding of the real components.
        import chaos

        chaos.SUMMARY.findings += 1
        print(f"finding: {len(held)} finished pod(s) of deleted Jobs kept by {JOB_TRACKING}: {held}; "
              "kube-controller-manager restarted, as an operator would")  # fmt: skip
        rc.restart("kube-controller-manager")
    try:
        wait_for(f"no pods of {what} left", lambda: not rc.pods(ns, sel), 90 - STALE_JOBS_S, 0.5)
    except AssertionError as e:
        left = [
            (
                p["metadata"]["name"],
                p["spec"].get("nodeName"),
                p["status"].get("phase"),
                p["metadata"].get("deletionTimestamp"),
                p["metadata"].get("finalizers"),
            )
            for p in rc.pods(ns, sel)
        ]
        raise AssertionError(f"{e}: {left}") from None


STALE_JOBS_S = 30.0
"""How long a run's deleted pods may take to go before the clean-up looks for the Job controller's stale view (its
garbage collection and finalizer removal take seconds)."""
JOB_TRACKING = "batch.kubernetes.io/job-tracking"


def _held_by_a_stale_job_view(rc: RealCluster, ns: str, sel: str) -> list[str]:
    """The run's pods that are deleted and finished, held only by the Job controller's tracking finalizer, whose
    Job the API no longer has: the controller's view of its Jobs is behind (a pod whose Job cannot be read now is
    not counted: unknown is not absence)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    batch = client.BatchV1Api(rc.admin)
    held = []
    for p in rc.pods(ns, sel):
        meta = p["metadata"]
        owners = [o["name"] for o in meta.get("ownerReferences") or [] if o.get("kind") == "Job"]
        if not (meta.get("deletionTimestamp") and meta.get("finalizers") == [JOB_TRACKING] and owners):
            continue
        if p["status"].get("phase") not in ("Succeeded", "Failed"):
            continue
        try:
            batch.read_namespaced_job(owners[0], ns)
        except ApiException as e:
            if e.status == 404:
                held.append(meta["name"])
    return held


BUCKET = "tier-trainers"  # created in the session's GCS emulator


CHAOS_HOSTS = 2
CHAOS_STEPS = 30
CHAOS_INTERVAL = 5
CHAOS_COORDINATION_HEARTBEAT_S = 15


LADDER_LOCAL_INTERVAL = 2


def with_local_tier(cfg: dict[str, Any]) -> None:
    """The host-local tier on: each host's part of every other step on its node's disk (podexec's node folder, a
    ``hostPath``) and a copy on the other host. A trainer restarted in place (level 0), or a gang recreated on the
    same nodes, restores the step it had reached from there instead of the last GCS step, as on a slice's hosts."""
    cfg["checkpoint"]["local"] = {"interval_steps": LADDER_LOCAL_INTERVAL, "peers": 1, "keep": 3}


def chaos_shape(cfg: dict[str, Any]) -> None:
    """The chaos runs' job: the local file's on two hosts, 30 steps, a checkpoint every 5 (its faults find a gang
    of two as they find one of four, at half the start-up, and a checkpoint to lose every few steps)."""
    cfg["slice"]["hosts"] = CHAOS_HOSTS
    cfg["training"]["total_steps"] = CHAOS_STEPS
    cfg["checkpoint"]["interval_steps"] = CHAOS_INTERVAL
    # The control plane restarts on the gang's own two cores here (never on a slice's hosts): seed 1 once starved
    # worker 0's JAX coordination heartbeat past the local 5 s while the API server restarted under a slowed etcd,
    # and both workers exited 20 on a healthy gang. A killed worker is still found at once (its pod fails the Job).
    cfg["training"]["heartbeat_timeout_s"] = CHAOS_COORDINATION_HEARTBEAT_S


def new_run(
    rc: RealCluster,
    hosts: CpuHosts,
    gcs_emulator: Any,
    prefix: str = "tier",
    shape: Callable[[dict[str, Any]], None] | None = None,
) -> TrainerRun:
    """A run with a run id and a GCS prefix of its own (not submitted yet); ``shape``: ``chaos_shape`` or None."""
    gcs_emulator.create_bucket(BUCKET)
    run_id = f"{prefix}-{uuid.uuid4().hex[:6]}"
    n = CHAOS_HOSTS if shape is chaos_shape else HOSTS
    return TrainerRun(rc, hosts, f"gs://{BUCKET}/{run_id}", run_id, gang=n, shape=shape)


def run_undisturbed(r: TrainerRun) -> tuple[TrainerRun, dict[str, Any]]:
    """Submit a run nothing disturbs and wait for its end: the run (seconds, worker nodes) and its Workflow."""
    t0 = time.monotonic()
    r.submit()
    r.nodes = {p["spec"]["nodeName"] for p in r.workers(0)}
    wf = r.wait_done(240)
    r.seconds = time.monotonic() - t0
    return r, wf


def final_reports(r: Any, attempt: int) -> list[Any]:
    """The attempt's worker exit reports, by process index (none unreadable)."""
    reports, problems = read_worker_reports(r.store, attempt)
    assert not problems, problems
    return sorted(reports, key=lambda w: w.process_index)


def final_digest(r: Any) -> str:
    """The final parameters' digest every worker of the run's last attempt reported (all equal)."""
    last = r.store.attempts()[-1]
    digests = {w.params_digest for w in final_reports(r, last)}
    assert len(digests) == 1 and None not in digests, digests
    return digests.pop()
