"""One submission of the shipped Workflow on the real Argo controller (``ArgoRun``), its clean-up, and a lost
supervisor: what test_argo.py and its stand-in check (standin.py) share."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import argoctl
from argoctl import ARGO_FILE
from realcluster import RealCluster, wait_for
from tier import HOSTS, INDEX, REPO

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import JobConfig
from jaxrec.model.names import jobset_name
from jaxrec.model.records import Ledger, WorkerHeartbeat

# How long after its start the supervisor's node is evicted. Argo v4.0.5 treats a pod that vanishes within
# RECENTLY_STARTED_POD_DURATION (10 s) of its node's start as not yet synced and creates it again for the same node
# (workflow/controller/operator.go podReconciliation, ``recentlyStarted``); later, the node is Error "pod deleted"
# and the retryStrategy decides. The shipped train-segment retryStrategy has no maxDuration (asserted below), so
# no age of the segment makes Argo refuse the retry.
RAN_LONGER_S = 15


@dataclass
class ArgoRun:
    """One submission of the shipped Workflow with a run store of the test's own."""

    rc: RealCluster
    cfg: JobConfig
    store_root: Path
    name: str = ""

    @property
    def ns(self) -> str:
        return self.cfg.namespace

    @property
    def store(self) -> RunStore:
        return RunStore(str(self.store_root), self.cfg.run_id)

    def submit(self, edit_config: Callable[[dict[str, Any]], None] | None = None) -> str:
        """Submit the shipped file (``edit_config``: what the test changes in its config, beside the backoff)."""

        def edit(cfg: dict[str, Any]) -> None:
            argoctl.tier_backoff(cfg)
            if edit_config is not None:
                edit_config(cfg)

        params = {"store-root": str(self.store_root)}
        wf = argoctl.submit(self.rc, REPO / "argo" / ARGO_FILE, params, edit_config=edit)
        self.name = wf["metadata"]["name"]
        return self.name

    def wf(self) -> dict[str, Any]:
        return argoctl.workflow(self.rc, self.ns, self.name)

    def wait_done(self, timeout: float) -> dict[str, Any]:
        return argoctl.wait_finished(self.rc, self.ns, self.name, timeout)

    def workers(self, attempt: int, timeout: float = 180) -> list[dict[str, Any]]:
        """The attempt's worker pods once all are Running (by completion index)."""
        sel = f"jobset.sigs.k8s.io/jobset-name={jobset_name(self.cfg.run_id, attempt)}"

        def running():
            pods = [p for p in self.rc.pods(self.ns, sel) if p["status"].get("phase") == "Running"]
            return sorted(pods, key=lambda p: int(p["metadata"]["labels"][INDEX])) if len(pods) >= HOSTS else None

        try:
            return wait_for(f"{HOSTS} worker pods Running of attempt {attempt}", running, timeout, 0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{argoctl.summary(self.wf())}") from None

    def beat(self, attempt: int, step: int, checkpoint: int | None = None) -> None:
        """Every worker's heartbeat at ``step`` (what the trainer writes to the run store)."""
        t = time.time()
        for i in range(HOSTS):
            b = WorkerHeartbeat(process_index=i, step=step, checkpoint_step=checkpoint, at=t, first_step_at=t)
            self.store.write_json(RunLayout.heartbeat(attempt, i), b.model_dump())

    def ledger(self) -> Ledger:
        return Ledger.model_validate(self.store.read_json(RunLayout.LEDGER))

    def exit_all(self, attempt: int, code: int) -> None:
        for p in self.workers(attempt):
            self.rc.exit_pod(self.ns, p["metadata"]["name"], code)


def clean(rc: RealCluster, ns: str) -> None:
    from kubernetes import client

    objs = client.CustomObjectsApi(rc.admin)
    for group, version, plural in (
        ("argoproj.io", "v1alpha1", "workflows"),
        ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    ):
        objs.delete_collection_namespaced_custom_object(group, version, ns, plural)
    wait_for(f"no pods left in {ns}", lambda: not rc.pods(ns), 90, 0.5)


def _supervisor_pod(r: ArgoRun, not_uid: str = "") -> dict[str, Any]:
    """A Running pod of train-segment (any try) other than ``not_uid``."""

    def running():
        for p in r.rc.pods(r.ns, f"workflows.argoproj.io/workflow={r.name}"):
            node = (p["metadata"].get("annotations") or {}).get("workflows.argoproj.io/node-name", "")
            if ".train-segment(" in node and p["status"].get("phase") == "Running" and p["metadata"]["uid"] != not_uid:
                return p
        return None

    return wait_for("a train-segment pod Running" + (" after the lost one" if not_uid else ""), running, 180, 0.5)


def lose_supervisor(r: ArgoRun) -> dict[str, Any]:
    """Evict the Running train-segment pod (the Eviction API, as a node drain does) once the controller has had its
    node Running longer than RAN_LONGER_S; wait until its retry runs. The evicted pod."""
    from kubernetes import client

    first = _supervisor_pod(r)
    node = wait_for(
        "train-segment Running in the Workflow",
        lambda: next((n for n in argoctl.pods_of(r.wf(), "train-segment") if n["phase"] == "Running"), None),
        60,
        0.5,
    )
    started = datetime.strptime(node["startedAt"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    time.sleep(max(0.0, started + RAN_LONGER_S - time.time()))
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=first["metadata"]["name"], namespace=r.ns))
    r.rc.core().create_namespaced_pod_eviction(first["metadata"]["name"], r.ns, body)
    _supervisor_pod(r, not_uid=first["metadata"]["uid"])
    return first
