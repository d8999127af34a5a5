"""The local cluster's controllers: what the JobSet and Job controllers, the garbage collector and the kubelets do.

``LocalControllers`` serves one local run's Kubernetes API (``apiserver.ApiServer``) and acts on it as a cluster's
controllers act on theirs:

- a JobSet created through the API is admitted (one the local cluster cannot read is refused 422, as JobSet's
  validating webhook refuses it), its Job is created and its pods' workers are started (``LocalCluster.create``);
- a JobSet deleted through the API has its workers stopped as the kubelet stops a deleted pod's container (SIGTERM,
  then SIGKILL once the pod's termination grace is over); the API keeps each pod Terminating until its worker has
  exited, then removes it, and the foreground-deleted JobSet goes with its last pod;
- a pod deleted with grace period 0 has its worker SIGKILLed;
- every ``TICK`` the kubelets publish their pods' and nodes' status and the Job controller its Job's conditions
  (``slices.slice_objects``), and the runner's hooks act on a running slice (fault injection).

Every step, train-segment included, reaches these through the API alone, with the kubeconfig ``kubeconfig`` writes.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from jaxrec.model.records import now
from workflows.local.apiserver import JOBSET_NAME_LABEL, ApiServer, status
from workflows.local.cluster import TICK, InvalidManifest, LocalCluster, read_manifest
from workflows.local.slices import LocalSlice, pod_name, slice_objects


class LocalControllers:
    """One local run's API, served on loopback, and the controllers that act on it over ``cluster``."""

    def __init__(self, cluster: LocalCluster, namespace: str):
        self.cluster = cluster
        self.api = ApiServer(namespace=namespace)
        self.api.admit = self._admit
        self.api.on_create = self._created
        self.api.kubelet_holds = self._holds
        self.api.on_delete = self._deleted
        self._published: dict[str, dict[str, str]] = {}  # JobSet -> pod or node name -> its JSON as last put
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="local-kubelets", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The API's address."""
        return self.api.url

    def kubeconfig(self, path: Path) -> Path:
        """Write a kubeconfig for the API at ``path`` (what every step is given as ``KUBECONFIG``)."""
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "local", "cluster": {"server": self.api.url}}],
            "users": [{"name": "local", "user": {}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "local", "namespace": self.api.ns}}],
            "current-context": "local",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
        return path

    def close(self) -> None:
        """Stop the kubelets and the API."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.api.close()

    def adopt(self, sl: LocalSlice) -> None:
        """Hold ``sl``, its workers started elsewhere, as a running JobSet of the API (one a lost supervisor left)."""
        self.cluster.adopt(sl)
        self._published[sl.jobset] = {}
        objs = slice_objects(sl)
        self.api.put("jobsets", objs["jobsets"][0])
        self.api.put("jobs", objs["jobs"][0])
        self.publish(sl)

    # -- what the API was asked --

    def _admit(self, resource: str, obj: dict[str, Any]) -> tuple[int, Any] | None:
        """Refuse a JobSet the local cluster cannot make workers of, as JobSet's validating webhook would."""
        if resource != "jobsets":
            return None
        name = obj["metadata"].get("name", "")
        try:
            read_manifest(obj)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            msg = f'JobSet.jobset.x-k8s.io "{name}" is invalid: the local cluster cannot read it ({e})'
            return 422, status(422, "Invalid", msg, name=name, group="jobset.x-k8s.io", kind="JobSet")
        return None

    def _created(self, api: ApiServer, obj: dict[str, Any]) -> None:
        """A JobSet was created: its Job, and its workers started (the JobSet and Job controllers, the kubelets)."""
        if obj.get("kind") != "JobSet":
            return
        try:
            sl = self.cluster.create(obj)
        except InvalidManifest:  # admitted above: not reached
            return
        if sl is not None:
            self._published[sl.jobset] = {}
            api.put("jobs", slice_objects(sl)["jobs"][0])

    def _holds(self, pod: dict[str, Any]) -> bool:
        """Whether the pod's worker still runs (its kubelet removes the pod once it has exited)."""
        sl = self.cluster.find((pod["metadata"].get("labels") or {}).get(JOBSET_NAME_LABEL, ""))
        if sl is None:
            return False
        return any(
            pod_name(sl.jobset, w.index) == pod["metadata"]["name"] and w.proc is not None and w.returncode is None
            for w in sl.workers
        )

    def _deleted(self, api: ApiServer, resource: str, obj: dict[str, Any], q: dict[str, list[str]]) -> None:
        name = obj["metadata"]["name"]
        if resource == "jobsets":
            sl = self.cluster.find(name)
            if sl is not None and sl.deleted_at is None:
                self.cluster.delete(sl, now())
        elif resource == "pods" and (q.get("gracePeriodSeconds") or [""])[0] == "0":
            jobset = (obj["metadata"].get("labels") or {}).get(JOBSET_NAME_LABEL, "")
            sl = self.cluster.find(jobset)
            if sl is not None:
                self.cluster.force_delete(sl, name)

    # -- the kubelets and the Job controller --

    def _run(self) -> None:
        while not self._stop.is_set():
            for sl in list(self.cluster.live.values()):
                at = now()
                self.cluster.poll(sl)
                self.cluster.tick(sl, at)
                self.publish(sl)
            time.sleep(TICK)

    def publish(self, sl: LocalSlice) -> None:
        """Put what changed of the slice's pods, nodes and Job into the API; remove the pods whose worker is gone.

        A pod the API no longer has (deleted with grace period 0) is not put back; nor is one once its JobSet is
        deleted.
        """
        objs = slice_objects(sl, image="")
        last = self._published.setdefault(sl.jobset, {})
        api = self.api
        with api.lock:
            for job in objs["jobs"]:
                stored = api.jobs.get(job["metadata"]["name"])
                if stored is not None and stored.get("status") != job["status"]:
                    api.put("jobs", {**stored, "status": job["status"]})
            for node in objs["nodes"]:
                self._put(last, "nodes", node)
            wanted = {p["metadata"]["name"]: p for p in objs["pods"]}
            for name, pod in wanted.items():
                if f"pods/{name}" in last and name not in api.pods:
                    continue  # deleted through the API: it does not come back
                if sl.deleted_at is not None and name not in api.pods:
                    continue
                self._put(last, "pods", pod)
            for key in [k for k in last if k.startswith("pods/") and k[5:] not in wanted]:
                if key[5:] in api.pods:
                    api.remove("pods", key[5:])

    def _put(self, last: dict[str, str], coll: str, obj: dict[str, Any]) -> None:
        key = f"{coll}/{obj['metadata']['name']}"
        text = json.dumps(obj, sort_keys=True)
        if last.get(key) != text or obj["metadata"]["name"] not in self.api.objects[coll]:
            last[key] = text
            self.api.put(coll, obj)
