"""The Kubernetes API as provision-slice (and the lease and finalize tests) meet it, at its HTTP boundary: JobSets,
pods and nodes with the shapes the API server returns; and a run store holding a pinned config."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlparse

from recovery_steps.kernel.config import load_config
from recovery_steps.kernel.store import RunLayout, RunStore
from support.fake_http import JsonServer

REPO = Path(__file__).resolve().parents[2]
NS = "training"
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
TPU_LABELS = {
    "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
    "cloud.google.com/gke-tpu-topology": "4x4",
}
MAINTENANCE = {"cloud.google.com/active-node-maintenance": "true"}


def store_config(root: str, name: str) -> str:
    cfg = load_config(REPO / "configs" / name)
    RunStore(root, cfg.run_id).write_json(
        RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()}
    )
    return cfg.run_id


def node(name, *, pool="tpu-pool-a", ready=True, taints=(), labels=None, unschedulable=False, spot=True):
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


class FakeKube:
    """Answers the few Kubernetes API paths provision-slice uses, with the shapes the API server returns."""

    def __init__(self, *, jobsets=(), nodes=(), pods_after_delete=1, jobset_status=200, other_pods=(), labelled=False):
        self.labelled = labelled  # each JobSet labelled with its attempt (its name ends -a<attempt>)
        self.other_pods = list(other_pods)
        self.jobsets = list(jobsets)
        self.nodes = list(nodes)
        self.pods_left = 0
        self.pods_after_delete = pods_after_delete
        self.jobset_status = jobset_status
        self.requests: list[tuple[str, str, dict]] = []
        self.http = JsonServer(self._route)
        self.url = self.http.url

    def _route(self, method: str, raw: str, body: dict) -> tuple[int, dict]:
        u = urlparse(raw)
        if method == "DELETE":
            self.requests.append(("DELETE", u.path, body))
            return self.delete(u.path)
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        self.requests.append(("GET", u.path, q))
        return self.get(u.path, q)

    def get(self, path, q):
        if path == JOBSETS:
            if self.jobset_status != 200:
                return self.jobset_status, {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "reason": "Forbidden",
                    "code": self.jobset_status,
                }
            items = [
                {
                    "apiVersion": "jobset.x-k8s.io/v1alpha2",
                    "kind": "JobSet",
                    "metadata": {"name": n, "namespace": NS, "labels": {"jaxrec/run-id": "lm-v5e-4x4"}},
                }
                for n in self.jobsets
            ]
            for js in items if self.labelled else ():
                js["metadata"]["labels"]["jaxrec/attempt"] = js["metadata"]["name"].rsplit("-a", 1)[1]
            return 200, {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSetList", "metadata": {}, "items": items}
        if path == f"/api/v1/namespaces/{NS}/pods" and "!=" in q.get("labelSelector", ""):
            # Other runs' pods (selector "jaxrec/run-id,jaxrec/run-id!=<this run>").
            mine = q["labelSelector"].split("!=", 1)[1]
            items = [p for p in self.other_pods if p["metadata"]["labels"]["jaxrec/run-id"] != mine]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        if path == f"/api/v1/namespaces/{NS}/pods":
            items = [{"metadata": {"name": f"lm-v5e-4x4-a0-workers-0-{i}-x"}} for i in range(self.pods_left)]
            self.pods_left = max(0, self.pods_left - 1)  # the garbage collector removes one per poll
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}
        if path == "/api/v1/nodes":
            want = dict(kv.split("=", 1) for kv in q.get("labelSelector", "").split(",") if kv)
            items = [n for n in self.nodes if all(n["metadata"]["labels"].get(k) == v for k, v in want.items())]
            return 200, {"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": items}
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}

    def delete(self, path):
        name = path.rsplit("/", 1)[-1]
        if path.startswith(JOBSETS + "/") and name in self.jobsets:
            self.jobsets.remove(name)
            self.pods_left += self.pods_after_delete
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name}}
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}

    def close(self):
        self.http.close()
