"""The local cluster's controllers: what the JobSet and Job controllers, the garbage collector and the kubelets do.

``LocalControllers`` serves one local run's Kubernetes API (``apiserver.ApiServer``) on a unix socket and acts on
it as a cluster's controllers act on theirs (docs/LOCAL.md); every step, train-segment included, reaches the
cluster through that API alone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any

from jaxrec.model.records import now
from workflows.local.apiserver import JOBSET_NAME_LABEL, ApiServer, status
from workflows.local.cluster import TICK, LocalCluster, read_manifest
from workflows.local.slices import LocalSlice, jobset_status, slice_objects


class LocalControllers:
    """One local run's API, served on a unix socket, and the controllers that act on it over ``cluster``."""

    def __init__(self, cluster: LocalCluster, namespace: str):
        self.cluster = cluster
        # A unix socket: a machine may let no process open a TCP socket, even on loopback (a TPU VM's sandbox).
        self._dir = tempfile.mkdtemp(prefix="jaxrec-api-")
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)  # at exit too
        self.api = ApiServer(namespace=namespace, socket_path=os.path.join(self._dir, "api.sock"))
        self.api.admit = self._admit
        self.api.on_create = self._created
        self.api.kubelet_holds = self._holds
        self.api.on_delete = self._deleted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="local-kubelets", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The API's address (``unix://<path>``: what every step is given as ``JAXREC_K8S_HOST``)."""
        return self.api.url

    def stop_gangs(self) -> None:
        """SIGKILL every gang still running and publish how each ended (its pods Failed, its Job and JobSet too)."""
        ended = list(self.cluster.live.values())
        self.cluster.kill_all()
        for sl in ended:
            for _ in range(5):  # the kubelets' pass, then the controllers' from it: settled within two
                if not self.publish(sl):
                    break

    def close(self) -> None:
        """The run is over: SIGKILL every gang still running, stop the kubelets and the API."""
        self.stop_gangs()
        self._stop.set()
        self._thread.join(timeout=5)
        self.api.close()
        self._remove_dir()

    def adopt(self, sl: LocalSlice) -> None:
        """Hold ``sl``, its workers started elsewhere, as a running JobSet of the API (one a lost supervisor left)."""
        self.cluster.adopt(sl)
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
        sl = self.cluster.create(obj)  # admitted: _admit read it
        if sl is not None:
            api.put("jobs", slice_objects(sl)["jobs"][0])

    def _holds(self, pod: dict[str, Any]) -> bool:
        """Whether the pod's worker still runs (its kubelet removes the pod once it has exited)."""
        sl = self.cluster.find((pod["metadata"].get("labels") or {}).get(JOBSET_NAME_LABEL, ""))
        w = sl.worker_of(pod["metadata"]["name"]) if sl is not None else None
        return w is not None and w.proc is not None and w.returncode is None

    def _deleted(self, api: ApiServer, resource: str, obj: dict[str, Any], q: dict[str, list[str]]) -> None:
        name = obj["metadata"]["name"]
        if resource == "jobsets":
            sl = self.cluster.find(name)
            if sl is not None and sl.deleted_at is None:
                self.cluster.delete(sl, now())
        elif resource == "pods":
            sl = self.cluster.find((obj["metadata"].get("labels") or {}).get(JOBSET_NAME_LABEL, ""))
            grace = (q.get("gracePeriodSeconds") or [""])[0]
            if sl is not None and grace == "0":
                self.cluster.force_delete(sl, name)
            elif sl is not None:
                conditions = (obj.get("status") or {}).get("conditions", [])
                disrupted = [c for c in conditions if c["type"] == "DisruptionTarget"]
                self.cluster.delete_pod(sl, name, float(grace) if grace else sl.grace_seconds, now(), *disrupted)

    # -- the kubelets and the Job controller --

    def _run(self) -> None:
        settled: set[int] = set()  # slices whose end is published
        while not self._stop.is_set():
            live = list(self.cluster.live.values())
            for sl in live:
                self.cluster.poll(sl)
                self.cluster.tick(sl, now())
                self.publish(sl)
            # A slice settled (its supervisor done, or its Workflow deleted): its last state, once.
            running = {id(sl) for sl in live}
            for sl in [sl for sl in self.cluster.slices if id(sl) not in running | settled]:
                self.cluster.poll(sl)
                if not self.publish(sl):
                    settled.add(id(sl))
            time.sleep(TICK)

    def publish(self, sl: LocalSlice) -> bool:
        """Put what changed of the slice into the API; whether anything did.

        Its pods, nodes, Job and JobSet; the pods whose worker is gone are removed. The kubelets first, then the
        Job and JobSet controllers from the same pods (the API holds the failed pod before the Job it fails). A pod
        the API no longer has (deleted with grace period 0) is not put back; nor is one once its JobSet is deleted.
        """
        objs = slice_objects(sl)
        api = self.api
        with api.lock:
            before = api.rv
            self._kubelets(sl, objs)
            for job in objs["jobs"]:
                stored = api.jobs.get(job["metadata"]["name"])
                if stored is not None and stored.get("status") != job["status"]:
                    api.put("jobs", {**stored, "status": job["status"]})
                stored_js = api.jobsets.get(sl.jobset)
                want = jobset_status(job)
                if stored_js is not None and want and (stored_js.get("status") or {}) != want:
                    api.put("jobsets", {**stored_js, "status": want})
            return api.rv != before

    def _kubelets(self, sl: LocalSlice, objs: dict[str, list[dict[str, Any]]]) -> None:
        """The kubelets' pass: the pods and nodes that changed put, the pods gone removed."""
        last, api = sl.published, self.api
        for node in objs["nodes"]:
            stored = api.nodes.get(node["metadata"]["name"])
            if stored is not None and "unschedulable" in stored.get("spec", {}):  # a cordon: not the kubelet's field
                node["spec"]["unschedulable"] = stored["spec"]["unschedulable"]
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
