"""What provision-slice (and the lease and finalize tests) meet on a GKE cluster, as builders for the one fake of the
Kubernetes API (:mod:`support.fake_k8s`): the run's JobSets with their Jobs and worker pods, TPU nodes; and a run
store holding a pinned config."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import load_config
from support.fake_k8s import JOBSET_NAME_LABEL, FakeCluster, pod

REPO = Path(__file__).resolve().parents[2]
NS = "training"
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
PODS = f"/api/v1/namespaces/{NS}/pods"
NODES = "/api/v1/nodes"
TPU_LABELS = {
    "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
    "cloud.google.com/gke-tpu-topology": "4x4",
}
MAINTENANCE = {"cloud.google.com/active-node-maintenance": "true"}


def store_config(root: str, name: str) -> str:
    """Pin configs/<name> for its run in the store at ``root``; the run id."""
    cfg = load_config(REPO / "configs" / name)
    RunStore(root, cfg.run_id).write_json(
        RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()}
    )
    return cfg.run_id


def node(name, *, pool="tpu-pool-a", ready=True, taints=(), labels=None, unschedulable=False, spot=True):
    """A TPU node of a GKE node pool (a spot one unless ``spot`` is False) as the API returns it."""
    lbl = {**TPU_LABELS, "cloud.google.com/gke-nodepool": pool, **(labels or {})}
    if spot:
        lbl["cloud.google.com/gke-spot"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": lbl},
        "spec": {
            "taints": [{"key": k, "effect": e, "value": "present"} for k, e in taints],
            "unschedulable": unschedulable,
        },
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def jobset(
    name: str, run_id: str, *, attempt_label: bool = True, deleting: bool = False, namespace: str = NS
) -> dict[str, Any]:
    """A run's JobSet, labelled as model.jobset labels it (its attempt, when ``attempt_label``: the name ends
    -a<attempt>); ``deleting``: its deletion is under way."""
    labels = {"jaxrec/run-id": run_id}
    if attempt_label:
        labels["jaxrec/attempt"] = name.rsplit("-a", 1)[-1]
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2024-05-01T10:00:00Z"
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta, "spec": {}, "status": {}}


def put_gang(cluster: FakeCluster, name: str, run_id: str, *, pods: int = 1, attempt_label: bool = True) -> None:
    """A run's JobSet ``name`` in ``cluster`` with its Job and ``pods`` of its worker pods (Pending, on no node),
    labelled as the JobSet controller labels them."""
    attempt = name.rsplit("-a", 1)[-1]
    cluster.put("jobsets", jobset(name, run_id, attempt_label=attempt_label, namespace=cluster.ns))
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-workers-0"}}
    job["metadata"]["labels"] = {JOBSET_NAME_LABEL: name, "jaxrec/run-id": run_id, "jaxrec/attempt": attempt}
    cluster.put("jobs", job)
    for i in range(pods):
        p = pod(name, i, 0.0, attempt=attempt)
        p["metadata"]["namespace"] = cluster.ns
        p["metadata"]["labels"]["jaxrec/run-id"] = run_id
        cluster.put("pods", p)


def slice_cluster(
    *,
    jobsets: Sequence[str] = (),
    nodes: Sequence[dict[str, Any]] = (),
    pods_per_gang: int = 1,
    other_pods: Sequence[dict[str, Any]] = (),
    labelled: bool = False,
    run_id: str = "lm-v5e-4x4",
) -> FakeCluster:
    """The API as provision-slice meets it: the run's JobSets ``jobsets`` (each with ``pods_per_gang`` worker
    pods; with their attempt label when ``labelled``), ``nodes``, and other runs' pods; the garbage collector
    removes one pod of the deleted JobSets per pods list."""
    cluster = FakeCluster(namespace=NS, gc_per_list=1)
    for name in jobsets:
        put_gang(cluster, name, run_id, pods=pods_per_gang, attempt_label=labelled)
    cluster.put("nodes", *copy.deepcopy(list(nodes)))
    cluster.put("pods", *copy.deepcopy(list(other_pods)))
    return cluster
