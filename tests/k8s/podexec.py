"""A process kubelet for the real-controller tier (simulated: no container runtime here): Argo's step pods and the
JobSet's worker pods run as local processes.

It registers Nodes that KWOK does not manage (no ``jaxrec.test/kwok`` label; ``--node`` repeated, ``--label`` on
each), keeps them Ready by renewing their Leases, and runs every pod the real scheduler binds to them:

- the main container (Argo's ``main``; the only container of any other pod, such as a worker's ``trainer``), its
  command and args (after Argo's ``argoexec emissary ... --`` prefix), with ``python`` meaning this interpreter
  and this checkout on ``PYTHONPATH`` (the image's code), and the container's env (values and the downward-API
  fieldRefs Argo's and JobSet's pods use, the completion index among them) over podexec's own environment (the
  node's: the GCS emulator's address when the tier started one);
- in the host's network namespace, as pods with ``hostNetwork`` run: an address a pod spec names on 127.0.0.1 is
  the host's loopback, shared by every pod. A gang of the local slice (``argo/local-cpu.yaml``) joins on the
  coordinator address its manifest names, ``127.0.0.1:<port provision-slice chose>``, with nothing rewritten. A
  TPU slice's manifest names no address (on GKE, JAX finds the coordinator from the TPU environment GKE injects):
  those pods stay on KWOK, whose nodes carry the TPU labels, taints and ``google.com/tpu`` capacity;
- as the pod's ServiceAccount when its token is mounted (the admission plugin added the projected token volume):
  a bound token (TokenRequest for the pod), the cluster's CA and the namespace in the files the projected volume
  holds, bind-mounted at the container's mount path (``/var/run/secrets/kubernetes.io/serviceaccount``), and
  ``KUBERNETES_SERVICE_HOST``/``PORT`` naming the API server, as the kubelet gives every container: the client's
  in-cluster config works unchanged. A pod whose account mounts none (the workers') gets no credentials at all;
- with paths of its own: in a private mount namespace (``unshare -m``), each directory the template names for an
  input artifact or output parameter (``/tmp/inputs``, ``/tmp/outputs``) is a bind mount of a directory under the
  pod's own root, so two steps never share an output file. Raw input artifacts are written there first, as
  Argo's init container does. The host keeps those directories as empty mount points. The process's pid is
  written to the pod's folder (``pid``), where a test finds the trainer to SIGKILL.

For a step pod, what Argo's ``wait`` container does is done here, in its order (argo-workflows v4.0.5
``cmd/argoexec/commands/wait.go``, ``workflow/executor/{executor,taskresult}.go``): a WorkflowTaskResult named
after the node ID with ``report-outputs-completed=false`` before the step runs; after it ends, the declared output
parameters read from their files (one trailing newline trimmed; the first missing file without a default stops the
saving and is the wait container's error), the outputs reported, the label set to ``true``. Only then is the pod
reported finished: the main container ``terminated{exitCode}``, ``wait`` terminated (1 after an error), phase
Succeeded or Failed. The task result is written with the pod's own token: the executor's RBAC is the project's.

The container's exit code is the process's (128 + N when a signal N ended it), reported as the kubelet does: the
Job controller matches it against the podFailurePolicy. A deleted pod is killed as the kubelet kills it: SIGTERM
to the process group, SIGKILL after the grace period, then the pod is removed (delete with grace 0); a pod removed
from the API at once (force deletion) has its process killed the same way. Every process dies with the runner
thread that started it (``PR_SET_PDEATHSIG``), and so with podexec and the test run. A pod on a node podexec runs
cannot be exec'd into (no kubelet API is served). Run as
``python podexec.py --kubeconfig K --node N [--node N2 ...] [--label K=V ...] --root DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("podexec")

ARGO = ("argoproj.io", "v1alpha1")
WAIT, MAIN = "wait", "main"
LEASE_S = 4
# The image's code is this checkout: ``python -m X`` in a pod imports the project from here, whatever the
# interpreter's site-packages hold (an editable install may point at another checkout).
REPO = Path(__file__).resolve().parents[2]


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


MIN_GRACE_S = 2
"""The kubelet gives every container at least this long after SIGTERM, a pod deleted with grace 0 included
(kubernetes v1.36.3, ``pkg/kubelet/kuberuntime/kuberuntime_container.go``: ``minimumGracePeriodInSeconds``)."""


def kill_grace(pod: dict[str, Any]) -> float:
    """Seconds from SIGTERM to SIGKILL for a deleted pod: its deletion grace, else its spec's, at least 2."""
    grace = pod["metadata"].get("deletionGracePeriodSeconds")
    grace = grace if grace is not None else pod["spec"].get("terminationGracePeriodSeconds", 30)
    return float(max(MIN_GRACE_S, grace))


def pdeathsig() -> None:  # SIGKILL when the thread that started the step ends (the pod's runner, or this process)
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)


def main_command(container: dict[str, Any]) -> list[str]:
    """The command Argo's emissary runs: what follows its ``--`` (``workflowpod.go``: argoexec emissary ... --)."""
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    if len(argv) > 1 and argv[0].endswith("/argoexec") and argv[1] == "emissary" and "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def field_value(pod: dict[str, Any], path: str) -> str:
    """A ``fieldRef`` of the downward API (the forms Argo and JobSet pods use)."""
    meta = pod["metadata"]
    for key in ("annotations", "labels"):
        prefix = f"metadata.{key}['"
        if path.startswith(prefix):
            return (meta.get(key) or {}).get(path[len(prefix) : -2], "")
    simple = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.hostIP": "127.0.0.1",
        "status.podIP": "127.0.0.1",
    }
    if path not in simple:
        raise ValueError(f"fieldRef {path} is not resolved by podexec")
    return simple[path]


def container_env(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif (e.get("valueFrom") or {}).get("fieldRef"):
            env[e["name"]] = field_value(pod, e["valueFrom"]["fieldRef"]["fieldPath"])
    return env


def main_container(pod: dict[str, Any]) -> dict[str, Any]:
    """The container podexec runs: Argo's ``main`` in a step pod; the only container of any other pod (a JobSet
    worker's ``trainer``). Sidecars are not run."""
    containers = pod["spec"]["containers"]
    return next((c for c in containers if c["name"] == MAIN), containers[0])


def mounts_token(pod: dict[str, Any]) -> bool:
    """Whether the pod gets its ServiceAccount's token: the ServiceAccount admission plugin adds the projected
    ``serviceAccountToken`` volume only when neither the pod nor its account turns automounting off."""
    return bool(token_volumes(pod))


def token_volumes(pod: dict[str, Any]) -> set[str]:
    """The names of the pod's projected volumes that hold a ServiceAccount token."""
    return {
        v["name"]
        for v in pod["spec"].get("volumes") or []
        if any("serviceAccountToken" in src for src in (v.get("projected") or {}).get("sources") or [])
    }


SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def token_mount_path(pod: dict[str, Any], container: dict[str, Any]) -> str:
    """Where ``container`` mounts the projected ServiceAccount volume (the admission plugin's ``SA_MOUNT``)."""
    names = token_volumes(pod)
    paths = [m["mountPath"] for m in container.get("volumeMounts") or [] if m.get("name") in names]
    return paths[0] if paths else SA_MOUNT


def argo_env(pod: dict[str, Any]) -> dict[str, str]:
    """What Argo gives its executor containers (init and wait): the template, node ID, workflow name and uid.
    Empty for a pod Argo did not make."""
    env: dict[str, str] = {}
    main = main_container(pod)["name"]
    for c in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
        if c["name"] != main:
            env.update(container_env(pod, c))
    return env


def mount_points(template: dict[str, Any]) -> list[str]:
    """The directories a template reads inputs from and writes outputs to."""
    paths = [a["path"] for a in (template.get("inputs") or {}).get("artifacts") or [] if a.get("path")]
    paths += [
        p["valueFrom"]["path"]
        for p in (template.get("outputs") or {}).get("parameters") or []
        if (p.get("valueFrom") or {}).get("path")
    ]
    return sorted({os.path.dirname(p) for p in paths})


def save_parameters(template: dict[str, Any], private: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The template's output parameters with their values (Argo's ``SaveParameters``); and its error, if any."""
    params = [dict(p) for p in (template.get("outputs") or {}).get("parameters") or []]
    for p in params:
        path = (p.get("valueFrom") or {}).get("path")
        if not path:
            continue
        f = private / path.lstrip("/")
        if f.is_file():
            value = f.read_text()
        elif "default" in p["valueFrom"]:
            value = p["valueFrom"]["default"]
        else:
            return params, f"open {path}: no such file or directory"
        p["value"] = value[:-1] if value.endswith("\n") else value
    return params, None


@dataclass
class PodRun:
    """One pod: its process and what has been reported about it."""

    kubelet: Kubelet
    pod: dict[str, Any]
    proc: subprocess.Popen | None = None
    deleting: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ns(self) -> str:
        return self.pod["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.pod["metadata"]["name"]

    @property
    def root(self) -> Path:
        return self.kubelet.root / f"{self.ns}_{self.name}_{self.pod['metadata']['uid'][:8]}"

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:
            log.exception("pod %s/%s", self.ns, self.name)
            # What podexec cannot run fails the pod at once (exit 128, as a runtime's start error), so a test
            # stops on the reason instead of waiting on a pod left Pending.
            with contextlib.suppress(Exception):
                self.kubelet.report_terminated(self.pod, now(), 128, wait_code=1, error=f"podexec: {e}")
        finally:
            self.done.set()
            if self.deleting.is_set():
                self.kubelet.remove(self.ns, self.name)

    def _run(self) -> None:
        main = main_container(self.pod)
        aenv = argo_env(self.pod)
        template = json.loads(aenv.get("ARGO_TEMPLATE") or "{}")
        self.root.mkdir(parents=True, exist_ok=True)
        private = self.root / "fs"
        secrets, result = None, None
        if mounts_token(self.pod):
            token = self.kubelet.token(self.pod)
            secrets = self.kubelet.write_token_volume(private, main, self.pod, token)
            if "ARGO_NODE_ID" in aenv:  # a step pod: its wait container's task result
                result = TaskResult(self.kubelet, self.pod, aenv, token)
        for a in (template.get("inputs") or {}).get("artifacts") or []:
            if "raw" in a:  # what Argo's init container does for a raw artifact
                (private / a["path"].lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                (private / a["path"].lstrip("/")).write_text(a["raw"]["data"])
        if result is not None:
            result.initialize()
        started = now()
        self.kubelet.report_running(self.pod, started)
        code = self._execute(main, template, private, secrets)
        params, error = save_parameters(template, private)
        if result is not None:
            result.report(params, error)
        self.kubelet.report_terminated(self.pod, started, code, wait_code=1 if error else 0, error=error)

    def _execute(self, main: dict[str, Any], template: dict[str, Any], private: Path, secrets: str | None) -> int:
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        env.update(self.kubelet.service_env())
        env.update(container_env(self.pod, main))
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        binds = []
        for d in [*mount_points(template), *([secrets] if secrets else [])]:
            Path(d).mkdir(parents=True, exist_ok=True)  # the host's (empty) mount point
            (private / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
            binds.append(f'mount --bind "{private / d.lstrip("/")}" "{d}"')
        script = " && ".join([*binds, 'exec "$@"'])
        argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "step", *main_command(main)]
        with (self.root / "main.log").open("ab") as out:
            if self.deleting.is_set():
                return 143
            self.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=self.root,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=pdeathsig,
            )
        (self.root / "pid").write_text(f"{self.proc.pid}\n")  # the container's process (tests signal it)
        if self.deleting.is_set():  # deleted between the check above and the start: kill() found no process
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        log.info(
            "pod %s/%s: started %s (pid %d)", self.ns, self.name, " ".join(main_command(main))[:200], self.proc.pid
        )
        code = self.proc.wait()
        code = 128 - code if code < 0 else code  # killed by signal N: the runtime reports 128 + N
        log.info("pod %s/%s: exit %d", self.ns, self.name, code)
        return code

    def kill(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` (the kubelet's kill of a deleted pod)."""
        if self.deleting.is_set():
            return
        self.deleting.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        log.info("pod %s/%s deleted: SIGTERM, SIGKILL after %.0f s", self.ns, self.name, grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)

        def later() -> None:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

        threading.Thread(target=later, daemon=True).start()


@dataclass
class TaskResult:
    """The WorkflowTaskResult of one node, written as Argo's wait container writes it, with the pod's token."""

    kubelet: Kubelet
    pod: dict[str, Any]
    env: dict[str, str]
    token: str

    def _api(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.kubelet.client(self.token))

    def initialize(self) -> None:
        from kubernetes.client.exceptions import ApiException

        wf = self.env["ARGO_WORKFLOW_NAME"]
        body = {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "WorkflowTaskResult",
            "metadata": {
                "name": self.env["ARGO_NODE_ID"],
                "labels": {
                    "workflows.argoproj.io/workflow": wf,
                    "workflows.argoproj.io/report-outputs-completed": "false",
                },
                "ownerReferences": [
                    {
                        "apiVersion": "argoproj.io/v1alpha1",
                        "kind": "Workflow",
                        "name": wf,
                        "uid": self.env["ARGO_WORKFLOW_UID"],
                    }
                ],
            },
        }
        try:
            self._api().create_namespaced_custom_object(
                *ARGO, self.pod["metadata"]["namespace"], "workflowtaskresults", body
            )
        except ApiException as e:
            if e.status != 409:
                raise

    def report(self, params: list[dict[str, Any]], error: str | None) -> None:
        ns, name = self.pod["metadata"]["namespace"], self.env["ARGO_NODE_ID"]
        outputs: dict[str, Any] = {"parameters": params} if params else {}
        patch: dict[str, Any] = {"outputs": outputs} if outputs else {}
        if patch:
            self._api().patch_namespaced_custom_object(*ARGO, ns, "workflowtaskresults", name, patch)
        labels = {"metadata": {"labels": {"workflows.argoproj.io/report-outputs-completed": "true"}}}
        self._api().patch_namespaced_custom_object(*ARGO, ns, "workflowtaskresults", name, labels)
        if error:
            log.info("pod %s/%s: wait container error: %s", ns, self.pod["metadata"]["name"], error)


class Kubelet:
    """The node, its Lease, the pod watch and the pods' runs."""

    def __init__(self, kubeconfig: Path, node: str, root: Path, labels: dict[str, str] | None = None):
        from kubernetes import config

        self.kubeconfig, self.node, self.root = kubeconfig, node, root
        self.labels = labels or {}
        self.admin = config.new_client_from_config(str(kubeconfig))
        self.server = self.admin.configuration.host
        self.ca = self.admin.configuration.ssl_ca_cert
        self.runs: dict[str, PodRun] = {}

    def client(self, token: str) -> Any:
        from kubernetes import client

        cfg = client.Configuration(host=self.server)
        cfg.ssl_ca_cert = self.ca
        cfg.api_key = {"authorization": f"Bearer {token}"}
        cfg.retries = 3
        return client.ApiClient(cfg)

    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.admin)

    def token(self, pod: dict[str, Any]) -> str:
        """A token of the pod's ServiceAccount bound to the pod (TokenRequest, as the kubelet's projected token)."""
        from kubernetes import client

        meta = pod["metadata"]
        req = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[],
                expiration_seconds=3600,
                bound_object_ref=client.V1BoundObjectReference(
                    kind="Pod", api_version="v1", name=meta["name"], uid=meta["uid"]
                ),
            )
        )
        sa = pod["spec"].get("serviceAccountName") or "default"
        return self.core().create_namespaced_service_account_token(sa, meta["namespace"], req).status.token

    def service_env(self) -> dict[str, str]:
        """``KUBERNETES_SERVICE_HOST``/``PORT``: the kubelet's environment for every container (the API server)."""
        from urllib.parse import urlsplit

        url = urlsplit(self.server)
        return {"KUBERNETES_SERVICE_HOST": url.hostname or "", "KUBERNETES_SERVICE_PORT": str(url.port or 443)}

    def write_token_volume(self, private: Path, container: dict[str, Any], pod: dict[str, Any], token: str) -> str:
        """The projected ServiceAccount volume's files (token, ca.crt, namespace) under the pod's own root; the
        container's mount path of that volume (where the client's in-cluster config reads them)."""
        path = token_mount_path(pod, container)
        d = private / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "token").write_text(token)
        (d / "ca.crt").write_text(Path(self.ca).read_text())
        (d / "namespace").write_text(pod["metadata"]["namespace"])
        return path

    # --- node --------------------------------------------------------------------------------------

    def register(self) -> None:
        """Create the node (not managed by KWOK) and report it Ready."""
        from kubernetes.client.exceptions import ApiException

        res = {"cpu": "16", "memory": "64Gi", "pods": "110"}
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node,
                "labels": {
                    "kubernetes.io/hostname": self.node,
                    "kubernetes.io/os": "linux",
                    "jaxrec.test/podexec": "true",
                    **self.labels,
                },
            },
        }
        try:
            self.core().create_node(body)
        except ApiException as e:
            if e.status != 409:
                raise
        t = now()
        ready = {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "podexec is posting ready status",
            "lastHeartbeatTime": t,
            "lastTransitionTime": t,
        }
        status = {
            "status": {
                "conditions": [ready],
                "capacity": res,
                "allocatable": res,
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.node},
                ],
                "nodeInfo": {
                    "kubeletVersion": "podexec",
                    "containerRuntimeVersion": "podexec",
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "osImage": "podexec",
                    "kernelVersion": "",
                    "kubeProxyVersion": "",
                    "machineID": "",
                    "bootID": "",
                    "systemUUID": "",
                },
            }
        }
        self.core().patch_node_status(self.node, status)

    def renew_lease(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        coord = client.CoordinationV1Api(self.admin)
        node = self.core().read_node(self.node)
        t = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": self.node, "leaseDurationSeconds": LEASE_S, "renewTime": t}
        try:
            coord.patch_namespaced_lease(self.node, "kube-node-lease", {"spec": spec})
        except ApiException as e:
            if e.status != 404:
                raise
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node.metadata.uid}
            body = {"metadata": {"name": self.node, "ownerReferences": [owner]}, "spec": spec}
            coord.create_namespaced_lease("kube-node-lease", body)

    def heartbeat(self) -> None:
        while True:
            try:
                self.renew_lease()
            except Exception:
                log.exception("lease")
            time.sleep(LEASE_S / 4)

    # --- pods -----------------------------------------------------------------------------------------

    def report_running(self, pod: dict[str, Any], started: str) -> None:
        spec = pod["spec"]
        status = {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "podIP": "127.0.0.1",  # the host's network namespace (hostNetwork, in effect)
            "startTime": started,
            "conditions": [
                {"type": t, "status": "True", "lastTransitionTime": started}
                for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")
            ],
            "initContainerStatuses": [
                _status(
                    c,
                    {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": started, "finishedAt": started}},
                )
                for c in spec.get("initContainers") or []
            ],
            "containerStatuses": [
                _status(c, {"running": {"startedAt": started}}, ready=True) for c in spec["containers"]
            ],
        }
        self.core().patch_namespaced_pod_status(
            pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": status}
        )

    def report_terminated(
        self, pod: dict[str, Any], started: str, code: int, wait_code: int, error: str | None
    ) -> None:
        t = now()
        main = main_container(pod)["name"]

        def term(c: dict[str, Any]) -> dict[str, Any]:
            n = code if c["name"] == main else wait_code if c["name"] == WAIT else 0
            state = {"exitCode": n, "reason": "Completed" if n == 0 else "Error", "startedAt": started, "finishedAt": t}
            if c["name"] == WAIT and error:
                state["message"] = error
            return _status(c, {"terminated": state})

        status = {
            "phase": "Succeeded" if code == 0 and wait_code == 0 else "Failed",
            "conditions": [
                {"type": t_, "status": "False", "reason": "PodCompleted", "lastTransitionTime": t}
                for t_ in ("Ready", "ContainersReady")
            ],
            "containerStatuses": [term(c) for c in pod["spec"]["containers"]],
        }
        self.core().patch_namespaced_pod_status(
            pod["metadata"]["name"], pod["metadata"]["namespace"], {"status": status}
        )

    def remove(self, ns: str, name: str) -> None:
        """Confirm a deletion (grace 0), as the kubelet does once the containers are gone."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            self.core().delete_namespaced_pod(name, ns, body=client.V1DeleteOptions(grace_period_seconds=0))

    def on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        meta = pod["metadata"]
        if kind == "DELETED":
            run = self.runs.pop(uid, None)
            if run is not None and not run.done.is_set():  # force-deleted: the kubelet kills what still runs
                run.kill(kill_grace(pod))
            return
        run = self.runs.get(uid)
        if meta.get("deletionTimestamp"):
            if run is None:
                self.remove(meta["namespace"], meta["name"])
            else:
                run.kill(kill_grace(pod))
                if run.done.is_set():  # else its runner removes it once the pod's end is reported
                    self.remove(meta["namespace"], meta["name"])
            return
        if run is None and pod["status"].get("phase") in (None, "Pending"):
            run = self.runs[uid] = PodRun(self, pod)
            threading.Thread(target=run.run, name=f"pod-{meta['name']}").start()

    def watch(self) -> None:
        from kubernetes import watch

        while True:
            try:
                w = watch.Watch()
                for ev in w.stream(
                    self.core().list_pod_for_all_namespaces,
                    field_selector=f"spec.nodeName={self.node}",
                    timeout_seconds=60,
                ):
                    self.on_pod(ev["type"], ev["raw_object"])
            except Exception:
                log.exception("watch")
                time.sleep(1)


def _status(c: dict[str, Any], state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {
        "name": c["name"],
        "image": c["image"],
        "imageID": "",
        "ready": ready,
        "restartCount": 0,
        "started": "running" in state,
        "state": state,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--node", required=True, action="append", help="a node to run (repeat for several)")
    p.add_argument("--label", action="append", default=[], help="KEY=VALUE on every node (repeatable)")
    p.add_argument("--root", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")
    labels = dict(kv.split("=", 1) for kv in args.label)
    kubelets = [Kubelet(args.kubeconfig, n, args.root, labels) for n in args.node]
    for k in kubelets:
        k.register()
        k.renew_lease()
        threading.Thread(target=k.heartbeat, name=f"lease-{k.node}", daemon=True).start()
        threading.Thread(target=k.watch, name=f"watch-{k.node}", daemon=True).start()
    threading.Event().wait()  # until SIGTERM (the default action ends the process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
