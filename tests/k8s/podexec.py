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
  Argo's init container does. The host keeps those directories as empty mount points. The main process's host
  pid is written to the pod's folder (``pid``), where a test finds the trainer to SIGKILL;
- with each ``hostPath`` directory volume the main container mounts bind-mounted from the node's own folder,
  ``<root>/nodes/<node>/<path>`` (made for ``DirectoryOrCreate``; ``Directory`` must exist): the pods of one node
  share it across their restarts and recreations, and the nodes that share this machine keep theirs apart, as the
  local disks of the hosts of a slice;
- a pod Argo did not make (a worker) in a PID namespace of its own with its own ``/proc``, as a runtime runs a
  container: its main process is PID 1 there, or, with ``spec.shareProcessNamespace``, the child of a
  pause-like PID 1, as on a node where the pause container is PID 1. The kernel delivers to a namespace's init
  only the signals it has a handler for, and SIGKILL from outside the namespace: a main process that is PID 1
  ignores a SIGTERM it has no handler for (it ends at the SIGKILL after the grace period), and nothing inside the
  pod, itself included, can SIGKILL it, as on a node. Argo's step pods stay in the host's (in real Argo the
  emissary is their PID 1 and forwards signals; the step programs exit on SIGTERM either way).

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
thread that started it (``PR_SET_PDEATHSIG``), and so with podexec and the test run.

It serves the kubelet API's exec endpoint (``ExecServer``: HTTPS on one port of 127.0.0.1 for all its nodes,
recorded in each Node's ``status.daemonEndpoints``), so that the Python client's ``connect_get_namespaced_pod_exec``
(the drill's kill-worker) works through the real API server. The API server (kubernetes v1.36.3,
``pkg/registry/core/pod/rest/subresources.go``, ``ExecREST.Connect``) passes a WebSocket upgrade through to the
node as it came, except one asking for ``v5.channel.k8s.io`` (``kubectl exec``'s), which it translates to SPDY
unless the node declares ``ExtendWebSocketsToKubelet`` in ``status.declaredFeatures``. The Python client asks for
``v4.channel.k8s.io``; podexec's nodes declare the feature, so a v5 request reaches podexec as a WebSocket too.
podexec speaks those two (binary messages, the first byte the channel: 1 stdout, 2 stderr, 3 the exit status as
``metav1.Status``) and nothing else: no SPDY, no stdin, no TTY, no attach or port-forward. The command runs
with ``nsenter`` in the main process's PID and mount namespaces and working directory, with the container's
environment. The API server verifies podexec's serving certificate (``--kubelet-certificate-authority``: without
it, it verifies none, ``pkg/kubelet/client/kubelet_client.go``) and presents ``--kubelet-client-certificate``;
podexec requires a client certificate from the tier's CA (``--client-ca-file``), as the kubelet's x509
authentication does, but asks the API server no SubjectAccessReview: any client the CA signed may exec.

The same endpoint serves the kubelet's ``/containerLogs/{namespace}/{pod}/{container}`` (what ``kubectl logs``,
``argo logs`` and the Argo UI's log pane read through the API server): the main container's output (stdout and
stderr together), each line kept with the time it was written, as a container runtime keeps it (RFC 3339 with
nanoseconds, sent first on each line with ``timestamps=true``); ``tailLines``, ``sinceSeconds``/``sinceTime``,
``limitBytes``, and ``follow`` until the container ended. The logs go with the pod, as on a node. Argo's other
containers (``init``, ``wait``) run no process here: their logs are empty.

Run as ``python podexec.py --kubeconfig K --node N [--node N2 ...] [--label K=V ...] --root DIR
[--tls-cert-file C --tls-private-key-file K --client-ca-file CA]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from jaxrec.model.names import TERMINATION_LOG_ENV

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


def first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


API_RETRY_S = 300.0  # how long a pod's API call is retried before its run gives up


def retrying(what: str, call: Any, deadline_s: float = API_RETRY_S, *, refusals: bool = False) -> Any:
    """``call()``, tried again every second while the API does not answer or answers 5xx or 429, as the kubelet's
    pod workers and status manager keep syncing a pod through an API outage (``pkg/kubelet/status``: a failed
    status update is retried on the next sync). A 4xx refusal other than 429 is raised at once, unless
    ``refusals``: the status manager retries whatever the error (an API server just restarted refuses with 403
    until its authorizer's caches are warm)."""
    from kubernetes.client.exceptions import ApiException

    give_up = time.monotonic() + deadline_s
    while True:
        try:
            return call()
        except ApiException as e:
            if e.status is not None and 400 <= e.status < 500 and e.status != 429 and not refusals:
                raise
            err: Exception = e
        except Exception as e:  # noqa: BLE001 - no answer (refused, reset, timed out): try again
            err = e
        if time.monotonic() > give_up:
            raise err
        log.info("%s: %s; again in 1 s", what, str(err).splitlines()[0][:200])
        time.sleep(1)


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


# pkg/kubelet/container/runtime.go (v1.36.3): the most of a log the kubelet makes a termination message of.
TERMINATION_LOG_LINES, TERMINATION_LOG_BYTES = 80, 2048
TERMINATION_MESSAGE_BYTES = 4096  # what the kubelet keeps of the file (pkg/kubelet/container/runtime.go, v1.36.3)


def termination_message(container: dict[str, Any], log: Path, code: int, message_file: Path | None = None) -> str:
    """The terminated state's ``message`` the kubelet gives a container that exited ``code``.

    What the container wrote to its termination-message file first (its last 4096 bytes); else, with
    ``terminationMessagePolicy: FallbackToLogsOnError`` and a non-zero exit, the last 80 lines of its log, at most
    2048 bytes (pkg/kubelet/kuberuntime/kuberuntime_container.go, v1.36.3). The kubelet bind-mounts that file at
    ``terminationMessagePath`` (/dev/termination-log), which podexec cannot without a /dev of the pod's own: it makes
    the file in the pod's folder and names it in ``TRAINER_TERMINATION_LOG``, the variable the project's programs
    read that path from when it is not the kubelet's.
    """
    try:
        written = message_file.read_bytes() if message_file is not None else b""
    except OSError:
        written = b""
    if written:
        return written[-TERMINATION_MESSAGE_BYTES:].decode(errors="replace")
    if code == 0 or container.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    try:
        lines = log.read_bytes().splitlines(keepends=True)[-TERMINATION_LOG_LINES:]
    except OSError as e:
        return f"Error on reading termination message from logs: {e}"
    return b"".join(lines)[-TERMINATION_LOG_BYTES:].decode(errors="replace")


def mount_points(template: dict[str, Any]) -> list[str]:
    """The directories a template reads inputs from and writes outputs to."""
    paths = [a["path"] for a in (template.get("inputs") or {}).get("artifacts") or [] if a.get("path")]
    paths += [
        p["valueFrom"]["path"]
        for p in (template.get("outputs") or {}).get("parameters") or []
        if (p.get("valueFrom") or {}).get("path")
    ]
    return sorted({os.path.dirname(p) for p in paths})


HOST_PATH_TYPES = ("", "Directory", "DirectoryOrCreate")


def host_path_mounts(pod: dict[str, Any], container: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """The container's ``hostPath`` mounts: the node's directory, the mount path, and whether the directory is made
    when missing (``DirectoryOrCreate``; ``Directory`` must exist, the kubelet's type check; an unset type checks
    nothing and, for a path that does not exist, makes a directory too). Other types (files, sockets, devices) and
    ``subPath`` are refused: podexec mounts directories only."""
    volumes = {v["name"]: v["hostPath"] for v in pod["spec"].get("volumes") or [] if "hostPath" in v}
    out = []
    for m in container.get("volumeMounts") or []:
        hp = volumes.get(m.get("name"))
        if hp is None:
            continue
        kind = hp.get("type") or ""
        if kind not in HOST_PATH_TYPES or m.get("subPath"):
            raise ValueError(
                f"hostPath volume {m['name']} (type {kind or 'unset'}, subPath "
                f"{m.get('subPath') or 'none'}) is not mounted by podexec: a whole directory only"
            )
        out.append((hp["path"], m["mountPath"], kind != "Directory"))
    return out


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


def is_step_pod(pod: dict[str, Any]) -> bool:
    """Whether Argo made the pod (its executor containers carry the node ID)."""
    return "ARGO_NODE_ID" in argo_env(pod)


SHIM_ARGV_ENV, PAUSE_ARGV_ENV = "PODEXEC_INIT_ARGV", "PODEXEC_CONTAINER_ARGV"
# Started by ``unshare --pid`` (in the pod's mount namespace, the host's PID namespace), as a runtime's shim: its
# child is PID 1 of a new PID namespace, mounts that namespace's /proc (a system call: no process of its own, so
# the first child of PID 1 is always the main process, which ``main_pid`` relies on) and becomes the pod's first
# process (argv from the environment); the shim ends with that process's exit code, 128 + N after signal N.
# (``unshare --fork`` would do the same but exits 1 when its child dies of SIGKILL: util-linux 2.38.1 cannot
# unblock SIGKILL.) It blocks SIGTERM, so that a deleted pod's SIGTERM is the container's own; SIGKILL ends it
# and, through PR_SET_PDEATHSIG, the namespace.
SHIM = f"""
import ctypes, json, os, signal
argv = json.loads(os.environ.pop({SHIM_ARGV_ENV!r}))
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})
child = os.fork()
if child == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)
    if libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, None) != 0:  # nosuid, nodev, noexec
        raise OSError(ctypes.get_errno(), "mount /proc")
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for s in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(s, signal.SIG_DFL)
    os.execvp(argv[0], argv)
_, status = os.waitpid(child, 0)
code = os.waitstatus_to_exitcode(status)
os._exit(128 - code if code < 0 else code)
"""
# PID 1 of a pod with ``shareProcessNamespace``, as the pause container is on a node: it starts the main container
# (argv from the environment, so that its own command line names no program of the pod), reaps every orphan, and
# ends with the main process's exit code (128 + N after signal N: an init cannot die of most signals). It keeps
# the default action of every signal, so the kernel delivers it none but SIGKILL (from outside the namespace):
# a deleted pod's SIGTERM reaches the main process alone.
PAUSE = f"""
import json, os, signal
argv = json.loads(os.environ.pop({PAUSE_ARGV_ENV!r}))
child = os.fork()
if child == 0:
    for s in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(s, signal.SIG_DFL)
    os.execvp(argv[0], argv)
while True:
    pid, status = os.wait()
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
"""


def container_argv(pod: dict[str, Any], command: list[str]) -> tuple[list[str], dict[str, str]]:
    """How the main container is started, and what that adds to the environment of what starts it.

    Every pod gets a mount namespace of its own. A pod Argo made stays in the host's PID namespace (its main
    process is the emissary's child there). Any other pod gets a PID namespace of its own (``SHIM``), with its
    own ``/proc``: its main process is PID 1 of it, or, with ``spec.shareProcessNamespace``, the child of a
    pause-like PID 1 (``PAUSE``). Neither of those two adds a variable to the container's environment."""
    argv = ["unshare", "--mount", "--propagation", "private"]
    if is_step_pod(pod):
        return [*argv, "--", *command], {}
    if pod["spec"].get("shareProcessNamespace"):
        init, extra = [sys.executable, "-c", PAUSE], {PAUSE_ARGV_ENV: json.dumps(command)}
    else:
        init, extra = command, {}
    return [*argv, "--pid", "--", sys.executable, "-c", SHIM], {SHIM_ARGV_ENV: json.dumps(init), **extra}


def container_depth(pod: dict[str, Any]) -> int:
    """How far below the started process (``unshare``) the main process is: itself, its child, or the child of
    the pause-like PID 1."""
    if is_step_pod(pod):
        return 0
    return 2 if pod["spec"].get("shareProcessNamespace") else 1


def children(pid: int) -> list[int]:
    """The host pids of ``pid``'s children (``/proc/<pid>/stat``'s ppid: this kernel has no ``children`` file)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(d))
    return found


def main_pid(pid: int, depth: int, timeout_s: float = 10.0) -> int:
    """The host pid of the main process, ``depth`` generations below ``pid`` (the first child each time); ``pid``
    itself when it has none yet at the deadline (the container ended before it started)."""
    deadline = time.monotonic() + timeout_s
    for _ in range(depth):
        while not (kids := children(pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not kids:
            return pid
        pid = min(kids)
    return pid


@dataclass
class PodRun:
    """One pod: its process and what has been reported about it."""

    kubelet: Kubelet
    pod: dict[str, Any]
    proc: subprocess.Popen | None = None
    main_pid: int | None = None  # the container's main process (host pid), once started
    env: dict[str, str] = field(default_factory=dict)  # its environment (an exec gets it too)
    deleting: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    log_closed: threading.Event = field(default_factory=threading.Event)  # the container's output ended

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
            why = f"podexec: {e}"
            with contextlib.suppress(Exception):
                retrying(
                    f"{self.name}: status",
                    lambda: self.kubelet.report_terminated(self.pod, now(), 128, wait_code=1, error=why),
                    refusals=True,
                )
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
            token = retrying(f"{self.name}: token", lambda: self.kubelet.token(self.pod))
            secrets = self.kubelet.write_token_volume(private, main, self.pod, token)
            if "ARGO_NODE_ID" in aenv:  # a step pod: its wait container's task result
                result = TaskResult(self.kubelet, self.pod, aenv, token)
        for a in (template.get("inputs") or {}).get("artifacts") or []:
            if "raw" in a:  # what Argo's init container does for a raw artifact
                (private / a["path"].lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                (private / a["path"].lstrip("/")).write_text(a["raw"]["data"])
        if result is not None:
            retrying(f"{self.name}: task result", result.initialize)
        started = now()
        retrying(f"{self.name}: status", lambda: self.kubelet.report_running(self.pod, started))
        code = self._execute(main, template, private, secrets)
        params, error = save_parameters(template, private)
        if result is not None:
            try:
                retrying(f"{self.name}: outputs", lambda: result.report(params, error))
            except Exception as e:  # noqa: BLE001 - Argo's wait container fails on a refused task result
                log.warning("%s: outputs not reported (%s): the wait container fails", self.name, first_line(e))
                error = error or f"failed to report the outputs: {first_line(e)}"
        wait_code = 1 if error else 0
        message = termination_message(main, self.root / "main.log", code, self.root / "termination-log")
        retrying(
            f"{self.name}: status",
            lambda: self.kubelet.report_terminated(
                self.pod, started, code, wait_code=wait_code, error=error, message=message
            ),
            refusals=True,
        )

    def _execute(self, main: dict[str, Any], template: dict[str, Any], private: Path, secrets: str | None) -> int:
        env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        env.update(self.kubelet.service_env())
        env.update(container_env(self.pod, main))
        (self.root / "termination-log").touch()  # as the kubelet makes the file before the container starts
        env[TERMINATION_LOG_ENV] = str(self.root / "termination-log")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        sources: list[tuple[Path, str]] = []  # (what is mounted, where in the container)
        for d in [*mount_points(template), *([secrets] if secrets else [])]:
            (private / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
            sources.append((private / d.lstrip("/"), d))
        for path, target, create in host_path_mounts(self.pod, main):
            on_node = self.kubelet.node_path(path)
            if not on_node.is_dir():
                if not create:
                    raise ValueError(f"hostPath type check failed: {path} is not a directory on {self.kubelet.node}")
                on_node.mkdir(parents=True)
            sources.append((on_node, target))
        for _, target in sources:
            Path(target).mkdir(parents=True, exist_ok=True)  # the host's (empty) mount point
        binds = [f'mount --bind "{src}" "{target}"' for src, target in sources]
        script = " && ".join([*binds, 'exec "$@"'])
        argv, extra = container_argv(self.pod, ["sh", "-c", script, "step", *main_command(main)])
        self.env = env
        if self.deleting.is_set():
            self.log_closed.set()
            return 143
        self.proc = subprocess.Popen(
            argv,
            env={**env, **extra},
            cwd=self.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=pdeathsig,
        )
        pump = threading.Thread(target=self._pump_log, args=(self.proc.stdout,), name=f"log-{self.name}", daemon=True)
        pump.start()
        self.main_pid = main_pid(self.proc.pid, container_depth(self.pod))
        (self.root / "pid").write_text(f"{self.main_pid}\n")  # the container's process (tests signal it)
        if self.deleting.is_set():  # deleted between the check above and the start: kill() found no process
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        log.info(
            "pod %s/%s: started %s (pid %d)", self.ns, self.name, " ".join(main_command(main))[:200], self.proc.pid
        )
        code = self.proc.wait()
        pump.join(LOG_DRAIN_S)  # a process the container left behind may hold the output open: not waited on
        self.log_closed.set()
        code = 128 - code if code < 0 else code  # killed by signal N: the runtime reports 128 + N
        log.info("pod %s/%s: exit %d", self.ns, self.name, code)
        return code

    @property
    def timed_log(self) -> Path:
        """The container's output, one record per line: ``<epoch ns> <RFC 3339 time> <line>``."""
        return self.root / "main.log.timed"

    def _pump_log(self, pipe: Any) -> None:
        """Keep the container's output as the runtime does: each line with the time it was written."""
        with (self.root / "main.log").open("ab") as raw, self.timed_log.open("ab") as timed:
            for line in iter(pipe.readline, b""):
                ns = time.time_ns()
                raw.write(line)
                raw.flush()
                timed.write(f"{ns} {rfc3339_nano(ns)} ".encode() + (line if line.endswith(b"\n") else line + b"\n"))
                timed.flush()
        self.log_closed.set()

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
        self.port = 0  # the exec endpoint's (ExecServer), once serving

    def node_path(self, path: str) -> Path:
        """Where the node's own ``path`` lies (a ``hostPath`` volume's directory): under the node's folder of
        podexec's root, so that the nodes that share this machine keep their disks apart."""
        return self.root / "nodes" / self.node / path.lstrip("/")

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
        ready = self.ready_condition()
        status = {
            "status": {
                "conditions": [ready],
                "capacity": res,
                "allocatable": res,
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.node},
                ],
                # Where the API server proxies exec to (``pkg/kubelet/client/kubelet_client.go``: this port on
                # the node's address of the first of ``--kubelet-preferred-address-types`` it has).
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
                "declaredFeatures": [WEBSOCKETS_FEATURE] if self.port else [],
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

    @staticmethod
    def ready_condition() -> dict[str, Any]:
        t = now()
        return {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "podexec is posting ready status",
            "lastHeartbeatTime": t,
            "lastTransitionTime": t,
        }

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
        # The kubelet posts its node's status again when it differs from what it computes (``tryUpdateNodeStatus``):
        # a Ready the node-lifecycle controller set Unknown while no lease could be renewed goes back to True, and
        # the controller then lifts its taints.
        ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None)
        if ready is None or ready.status != "True":
            self.core().patch_node_status(self.node, {"status": {"conditions": [self.ready_condition()]}})
            log.info("node %s: Ready was %s; posted Ready", self.node, ready.status if ready else None)

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
        self, pod: dict[str, Any], started: str, code: int, wait_code: int, error: str | None, message: str = ""
    ) -> None:
        t = now()
        main = main_container(pod)["name"]

        def term(c: dict[str, Any]) -> dict[str, Any]:
            n = code if c["name"] == main else wait_code if c["name"] == WAIT else 0
            state = {"exitCode": n, "reason": "Completed" if n == 0 else "Error", "startedAt": started, "finishedAt": t}
            if c["name"] == WAIT and error:
                state["message"] = error
            if c["name"] == main and message:
                state["message"] = message
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
        """Confirm a deletion (grace 0), as the kubelet does once the containers are gone.

        One that fails (the API restarting, 5xx) is confirmed again at the next resync (``reconcile``), as the
        kubelet's status manager keeps syncing a terminating pod until the API takes it; a pod left Terminating
        would hold its Workflow node Running for good.
        """
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            self.core().delete_namespaced_pod(name, ns, body=client.V1DeleteOptions(grace_period_seconds=0))
        except ApiException as e:
            if e.status != 404:
                log.info("pod %s/%s: deletion not confirmed (%s); again at the next resync", ns, name, e.status)
        except Exception as e:  # noqa: BLE001 - no answer: the next resync confirms it
            log.info("pod %s/%s: deletion not confirmed (%s); again at the next resync", ns, name, type(e).__name__)

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

    def reconcile(self) -> None:
        """Kill the runs whose pod the API no longer has (deleted while the watch was not connected: the kubelet's
        ``HandlePodRemoves`` after its pod source resyncs)."""
        resp = self.core().list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node}", _request_timeout=10)
        there = {p.metadata.uid for p in resp.items}
        for uid in [u for u in self.runs if u not in there]:
            run = self.runs.pop(uid)
            if not run.done.is_set():
                log.info("pod %s/%s is gone from the API: killed", run.ns, run.name)
                run.kill(kill_grace(run.pod))
        # A pod being deleted whose containers are gone: its deletion confirmed (again, if it failed before).
        for p in resp.items:
            run = self.runs.get(p.metadata.uid)
            if p.metadata.deletion_timestamp is not None and (run is None or run.done.is_set()):
                self.remove(p.metadata.namespace, p.metadata.name)

    def watch(self) -> None:
        from kubernetes import watch

        while True:
            try:
                self.reconcile()
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


# --- the kubelet API's exec endpoint --------------------------------------------------------------------------------

# The remotecommand WebSocket protocols served, preferred first (``k8s.io/streaming`` v0.36.3,
# ``pkg/httpstream/wsstream/doc.go``): v5 adds only a CLOSE message from the client, for stdin, which is not served.
WS_PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
# What a node declares so that the API server passes a v5 WebSocket through to it rather than translating it to
# SPDY (``ExecREST.Connect``; the feature and NodeDeclaredFeatures are beta, on by default, in v1.36).
WEBSOCKETS_FEATURE = "ExtendWebSocketsToKubelet"
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455, section 1.3
STDOUT, STDERR, ERROR = 1, 2, 3  # the channels of the remotecommand WebSocket protocol


class ExecRefused(Exception):
    """An exec podexec does not run: the HTTP status and the reason, answered before any upgrade."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


def exec_status(code: int) -> dict[str, Any]:
    """The ``metav1.Status`` the kubelet writes on the error channel when the command ends (kubernetes v1.36.3: the
    API server's stream translator writes the same, ``staging/src/k8s.io/apiserver/pkg/util/proxy/
    streamtranslator.go``: Success, or Failure with reason NonZeroExitCode and an ``ExitCode`` cause)."""
    if code == 0:
        return {"metadata": {}, "status": "Success"}
    return {
        "metadata": {},
        "status": "Failure",
        "message": f"command terminated with non-zero exit code: exit status {code}",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
    }


def ws_frame(payload: bytes, opcode: int = 0x2) -> bytes:
    """One unmasked, final WebSocket frame (a server's; RFC 6455, section 5.2)."""
    n = len(payload)
    if n < 126:
        head = bytes([0x80 | opcode, n])
    elif n < 1 << 16:
        head = bytes([0x80 | opcode, 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 127]) + n.to_bytes(8, "big")
    return head + payload


def exec_request(path: str, query: str) -> tuple[str, str, str, list[str]]:
    """Namespace, pod, container and command of ``/exec/<ns>/<pod>/<container>?command=..&output=1&error=1``
    (the URL the API server's ``ExecLocation`` builds, ``pkg/registry/core/pod/strategy.go``).

    Raises:
        ExecRefused: Another path, no command, stdin or a TTY asked for, or neither stdout nor stderr.
    """
    from urllib.parse import parse_qs

    parts = path.split("/")
    if len(parts) != 5 or parts[1] != "exec":
        raise ExecRefused(404, f"podexec serves /exec/<namespace>/<pod>/<container> only, not {path}")
    q = parse_qs(query, keep_blank_values=True)
    if q.get("input") or q.get("tty"):
        raise ExecRefused(400, "podexec runs an exec with stdout and stderr only: no stdin, no tty")
    if not (q.get("output") or q.get("error")):
        raise ExecRefused(400, "you must specify at least one of stdout or stderr")
    if not q.get("command"):
        raise ExecRefused(400, "no command given")
    return parts[2], parts[3], parts[4], q["command"]


def exec_argv(run: PodRun, command: list[str]) -> list[str]:
    """The command in the pod's PID and mount namespaces, in the main process's working directory."""
    if command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    return ["nsenter", "--target", str(run.main_pid), "--pid", "--mount", "--wd", "--", *command]


# How long a finished container's output is read after its process ended (a process it left may hold it open).
LOG_DRAIN_S = 5.0
LOG_FOLLOW_POLL_S = 0.2


def rfc3339_nano(ns: int) -> str:
    """``ns`` since the epoch as the kubelet writes a log line's time: RFC 3339, nanoseconds, UTC."""
    return datetime.fromtimestamp(ns // 1_000_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ns % 10**9:09d}Z"


@dataclass(frozen=True)
class LogOptions:
    """The query of a ``/containerLogs`` request, as the API server passes ``PodLogOptions`` on (``LogLocation``,
    pkg/registry/core/pod/strategy.go, kubernetes v1.36.3)."""

    follow: bool = False
    timestamps: bool = False
    tail_lines: int | None = None
    since_ns: int | None = None  # sinceSeconds or sinceTime, as a time
    limit_bytes: int | None = None
    previous: bool = False


def log_request(path: str, query: str, now_ns: int | None = None) -> tuple[str, str, str, LogOptions]:
    """Namespace, pod, container and options of a ``/containerLogs/{ns}/{pod}/{container}`` request.

    Raises:
        ExecRefused: Not a logs path, or an option that does not parse (400, as the kubelet answers).
    """
    from urllib.parse import parse_qs, unquote

    parts = path.split("/")
    if len(parts) != 5 or parts[1] != "containerLogs":
        raise ExecRefused(404, f"{path}: not /containerLogs/<namespace>/<pod>/<container>")
    q = {k: v[-1] for k, v in parse_qs(query).items()}
    try:
        since = None
        if "sinceSeconds" in q:
            since = (now_ns or time.time_ns()) - int(q["sinceSeconds"]) * 10**9
        elif "sinceTime" in q:
            since = int(datetime.fromisoformat(q["sinceTime"].replace("Z", "+00:00")).timestamp() * 10**9)
        opts = LogOptions(
            follow=q.get("follow") == "true",
            timestamps=q.get("timestamps") == "true",
            tail_lines=int(q["tailLines"]) if "tailLines" in q else None,
            since_ns=since,
            limit_bytes=int(q["limitBytes"]) if "limitBytes" in q else None,
            previous=q.get("previous") == "true",
        )
    except ValueError as e:
        raise ExecRefused(400, f"bad log options {query!r}: {e}") from None
    return unquote(parts[2]), unquote(parts[3]), unquote(parts[4]), opts


def log_records(data: bytes) -> tuple[list[tuple[int, bytes, bytes]], int]:
    """The complete records at the start of ``data`` (a timed log from some offset): (epoch ns, RFC 3339 time, line
    with its newline) each, and how many bytes they took (a record still being written is left for later)."""
    out, used = [], 0
    for rec in data.splitlines(keepends=True):
        if not rec.endswith(b"\n"):
            break
        ns, stamp, line = rec.split(b" ", 2)
        out.append((int(ns), stamp, line))
        used += len(rec)
    return out, used


def select_log(records: list[tuple[int, bytes, bytes]], opts: LogOptions) -> bytes:
    """What the kubelet sends of ``records`` for ``opts``: lines since the time, the last ``tailLines`` of them,
    each with its time first when asked, cut at ``limitBytes``."""
    chosen = [r for r in records if opts.since_ns is None or r[0] >= opts.since_ns]
    if opts.tail_lines is not None:
        chosen = chosen[-opts.tail_lines :] if opts.tail_lines > 0 else []
    body = b"".join((stamp + b" " + line) if opts.timestamps else line for _, stamp, line in chosen)
    return body if opts.limit_bytes is None else body[: opts.limit_bytes]


class ExecHandler(BaseHTTPRequestHandler):
    """One exec: the WebSocket upgrade the API server passes through, the command's stdout and stderr on channels
    1 and 2, its exit status on channel 3."""

    server: ExecServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.request.do_handshake()  # here, in the request's thread: the client certificate is checked now
        self.lock = threading.Lock()  # one frame at a time from the stdout and stderr pumps
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.info("exec: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        if self.path.startswith("/containerLogs/"):
            self._logs()
            return
        try:
            ns, name, container, command = exec_request(*(self.path.split("?", 1) + [""])[:2])
            run = self.server.find(ns, name, container)
            self._upgrade()
        except ExecRefused as e:
            self._refuse(e)
            return
        self.close_connection = True
        log.info("exec into %s/%s: %s", ns, name, " ".join(command)[:200])
        self._send(STDOUT, b"")  # the streams are ready: an empty message on the lowest writable channel
        status = exec_status(self._run(exec_argv(run, command), run.env))
        self._send(ERROR, json.dumps(status, separators=(",", ":")).encode())
        self.wfile.write(ws_frame((1000).to_bytes(2, "big"), opcode=0x8))  # close: normal closure
        self.wfile.flush()

    def _logs(self) -> None:
        """A container's log as the kubelet streams it (chunked; with ``follow``, until the container ended)."""
        try:
            ns, name, container, opts = log_request(*(self.path.split("?", 1) + [""])[:2])
            run = self.server.logs_of(ns, name, container, previous=opts.previous)
        except ExecRefused as e:
            self._refuse(e)
            return
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent, offset, first = 0, 0, True
        try:
            while True:
                closed = run is None or run.log_closed.is_set()  # before the read: nothing written after is lost
                data = b""
                if run is not None and run.timed_log.exists():
                    with run.timed_log.open("rb") as f:
                        f.seek(offset)
                        data = f.read()
                records, used = log_records(data)
                offset += used
                chunk = select_log(records, opts if first else LogOptions(timestamps=opts.timestamps))
                first = False
                if opts.limit_bytes is not None:
                    chunk = chunk[: max(0, opts.limit_bytes - sent)]
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                    sent += len(chunk)
                limited = opts.limit_bytes is not None and sent >= opts.limit_bytes
                if not opts.follow or closed or limited:
                    break
                time.sleep(LOG_FOLLOW_POLL_S)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass  # the reader went away (a follow that was stopped)

    def _refuse(self, e: ExecRefused) -> None:
        body = f"{e}\n".encode()
        self.send_response(e.status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _upgrade(self) -> None:
        import base64
        import hashlib

        offered = [p.strip() for p in self.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        protocol = next((p for p in WS_PROTOCOLS if p in offered), None)
        if self.headers.get("Upgrade", "").lower() != "websocket" or protocol is None:
            raise ExecRefused(400, f"podexec serves exec over WebSocket ({', '.join(WS_PROTOCOLS)}) only, not SPDY")
        key = self.headers.get("Sec-WebSocket-Key", "")
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()  # noqa: S324 - RFC 6455
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.send_header("Sec-WebSocket-Protocol", protocol)
        self.end_headers()
        self.wfile.flush()

    def _send(self, channel: int, data: bytes) -> None:
        with self.lock:
            self.wfile.write(ws_frame(bytes([channel]) + data))
            self.wfile.flush()

    def _run(self, argv: list[str], env: dict[str, str]) -> int:
        """Run the command, each output line sent as it comes; its exit code (128 + N after signal N)."""
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=pdeathsig,
        )

        def pump(pipe: Any, channel: int) -> None:
            for chunk in iter(lambda: pipe.read1(65536), b""):
                self._send(channel, chunk)

        pumps = [threading.Thread(target=pump, args=(p, c)) for p, c in ((proc.stdout, STDOUT), (proc.stderr, STDERR))]
        for t in pumps:
            t.start()
        code = proc.wait()
        for t in pumps:
            t.join()
        return 128 - code if code < 0 else code


class ExecServer(ThreadingHTTPServer):
    """The kubelet API's exec endpoint of every node podexec runs, on one HTTPS port of 127.0.0.1. Like the
    kubelet, it requires a client certificate from the cluster's CA (``--client-ca-file``: x509 authentication
    of the API server's ``--kubelet-client-certificate``); unlike it, it asks no SubjectAccessReview of the API
    server (any client the CA signed may exec). Exec and container logs are served: no attach, port-forward or
    stats."""

    daemon_threads = True

    def __init__(self, kubelets: list[Kubelet], cert: Path, key: Path, client_ca: Path):
        super().__init__(("127.0.0.1", 0), ExecHandler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
        self.socket = ctx.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self.kubelets = kubelets

    @property
    def port(self) -> int:
        return self.server_address[1]

    def _run_of(self, ns: str, name: str) -> PodRun:
        """The run of pod ``ns/name`` on these nodes (ExecRefused 404 when there is none)."""
        # Copies: the watch threads add and drop runs meanwhile. A pod deleted and made again under its name has
        # two runs for a moment: the one still running is the pod's.
        runs = [r for k in self.kubelets for r in list(k.runs.values()) if (r.ns, r.name) == (ns, name)]
        run = min(runs, key=lambda r: r.done.is_set(), default=None)
        if run is None:
            raise ExecRefused(404, f"pod {ns}/{name} is not on this node")
        return run

    def logs_of(self, ns: str, name: str, container: str, *, previous: bool = False) -> PodRun | None:
        """The run whose log a ``/containerLogs`` request reads; None for a container of the pod podexec does not
        run (Argo's ``init`` and ``wait``: nothing is written there).

        Raises:
            ExecRefused: No such pod or container, or ``previous`` (no container restarts here).
        """
        run = self._run_of(ns, name)
        spec = run.pod["spec"]
        names = [c["name"] for c in (spec.get("initContainers") or []) + spec["containers"]]
        if container not in names:
            raise ExecRefused(400, f"container {container} is not valid for pod {name}")
        if previous:
            raise ExecRefused(400, f"previous terminated container {container} in pod {name} not found")
        return run if container == main_container(run.pod)["name"] else None

    def find(self, ns: str, name: str, container: str) -> PodRun:
        """The pod's run, its main container started and not ended.

        Raises:
            ExecRefused: No such pod on these nodes, another container, or the container is not running.
        """
        run = self._run_of(ns, name)
        main = main_container(run.pod)["name"]
        if container != main:
            raise ExecRefused(400, f"container {container} is not running: podexec runs the main container {main}")
        deadline = time.monotonic() + 10  # reported Running just before its process starts: give it a moment
        while run.main_pid is None and not run.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        if run.main_pid is None or run.done.is_set() or (run.proc is not None and run.proc.poll() is not None):
            raise ExecRefused(400, f"container {main} of {ns}/{name} is not running")
        return run


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


def serve_exec(kubelets: list[Kubelet], cert: Path, key: Path, client_ca: Path) -> ExecServer:
    """Start the exec endpoint of ``kubelets`` (one port for all) and record its port in each node to register."""
    server = ExecServer(kubelets, cert, key, client_ca)
    threading.Thread(target=server.serve_forever, name="exec", daemon=True).start()
    for k in kubelets:
        k.port = server.port
    log.info("exec endpoint on 127.0.0.1:%d", server.port)
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--node", required=True, action="append", help="a node to run (repeat for several)")
    p.add_argument("--label", action="append", default=[], help="KEY=VALUE on every node (repeatable)")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--tls-cert-file", type=Path, help="the exec endpoint's serving certificate (else none is served)")
    p.add_argument("--tls-private-key-file", type=Path)
    p.add_argument("--client-ca-file", type=Path, help="the CA that signs the clients of the exec endpoint")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")
    labels = dict(kv.split("=", 1) for kv in args.label)
    kubelets = [Kubelet(args.kubeconfig, n, args.root, labels) for n in args.node]
    if args.tls_cert_file:
        serve_exec(kubelets, args.tls_cert_file, args.tls_private_key_file, args.client_ca_file)
    for k in kubelets:
        k.register()
        k.renew_lease()
        threading.Thread(target=k.heartbeat, name=f"lease-{k.node}", daemon=True).start()
        threading.Thread(target=k.watch, name=f"watch-{k.node}", daemon=True).start()
    threading.Event().wait()  # until SIGTERM (the default action ends the process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
