"""Argo's workflow-controller as a component of the real-controller tier: out of cluster, namespaced, in a network
namespace of its own.

The controller built by ``tools/k8s/build.sh`` (argo-workflows v4.0.5, the newest version the Go module proxy
serves) opens listeners the tier cannot move to loopback: its health server on a hard-coded ``:6060``
(``cmd/workflow-controller/main.go`` in v4.0.5) and, unless disabled, metrics. So it runs under ``unshare --net``
in a network namespace whose only interface is ``lo``: whatever it binds there, on any address, is unreachable from
the host. It reaches the API server through :class:`Forwarder`, a listening socket created inside that namespace
(a socket keeps the namespace it was created in) whose connections this process relays to the API server on the
host's 127.0.0.1.

Run as Argo's own dev loop runs it (argo-workflows v4.0.5 ``tasks.yaml``, task ``controller``): env
``LEADER_ELECTION_DISABLE=true``, ``ARGO_NAMESPACE``, ``DEFAULT_REQUEUE_TIME=1s``; flags ``--namespaced
--managed-namespace`` and an ``--executor-image`` that is never pulled (no kubelet pulls images here).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from realcluster import Component, RealCluster, pdeathsig, wait_for

ARGO_FILE = "v5e-4x4.yaml"  # the Workflow of argo/ the tier submits, unchanged but for `argo submit` parameters
LOCAL_ARGO_FILE = "local-cpu.yaml"  # the smallest job of argo/ (4 CPU hosts, 60 steps): the one real trainers run
CONTROLLER = "workflow-controller"
CONFIGMAP = "workflow-controller-configmap"  # the name the controller reads (``--configmap`` default)
EXECUTOR_IMAGE = "registry.invalid/argoexec-never-pulled:v4.0.5"
CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def netns_of(pid: int | str) -> str:
    """The network namespace of a process (``net:[inode]``)."""
    return os.readlink(f"/proc/{pid}/ns/net")


def _socket_in_netns(pid: int, make: Callable[[], socket.socket], what: str) -> socket.socket:
    """The socket ``make()`` returns, made inside the network namespace of process ``pid``.

    Made by a short-lived thread that enters the namespace (``setns`` changes only the calling thread) and returns
    to its own before it ends; the socket stays in the namespace it was created in.
    """
    got: dict[str, Any] = {}

    def run() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            _setns(target)
            try:
                got["socket"] = make()
            finally:
                _setns(own)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            got["error"] = e
        finally:
            os.close(own)
            os.close(target)

    t = threading.Thread(target=run, name=f"netns-{what}")
    t.start()
    t.join(30)
    assert not t.is_alive(), f"the network namespace's {what} was not made within 30 s"
    if "error" in got:
        raise got["error"]
    return got["socket"]


def listen_in_netns(pid: int, host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket listening on ``host``:<free port> inside the network namespace of process ``pid``."""

    def make() -> socket.socket:
        s = socket.socket()
        s.bind((host, 0))
        s.listen(64)
        return s

    return _socket_in_netns(pid, make, "listener")


def connect_in_netns(pid: int, port: int) -> socket.socket:
    """A TCP connection to 127.0.0.1:``port`` inside the network namespace of process ``pid``."""
    return _socket_in_netns(pid, lambda: socket.create_connection(("127.0.0.1", port), timeout=10), "connection")


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@dataclass
class Forwarder:
    """Relays each connection accepted on ``listener`` (in another network namespace) to 127.0.0.1:``target``, or to
    what ``dial`` connects to (a listener on the host relaying into a namespace)."""

    listener: socket.socket
    target: int
    dial: Callable[[], socket.socket] | None = None
    connections: int = 0
    _closed: bool = False
    _socks: list[socket.socket] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def start(self) -> None:
        threading.Thread(target=self._accept, name="argo-forwarder", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                inner, _ = self.listener.accept()
            except OSError:
                return
            try:
                outer = self.dial() if self.dial else socket.create_connection(("127.0.0.1", self.target), timeout=10)
                outer.settimeout(None)
            except OSError:
                inner.close()
                continue
            self.connections += 1
            self._socks += [inner, outer]
            threading.Thread(target=_pump, args=(inner, outer), daemon=True).start()
            threading.Thread(target=_pump, args=(outer, inner), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for s in [self.listener, *self._socks]:
            with contextlib.suppress(OSError):
                s.close()


@dataclass
class ArgoController(Component):
    """The workflow-controller in its own network namespace, with the forwarder to the API server."""

    rc: RealCluster | None = None
    namespace: str = ""
    forwarder: Forwarder | None = None
    started_in_s: float = 0.0

    def start(self) -> None:
        self.held, self.down_since = False, None
        with self.log.open("ab") as out:
            # The shell brings lo up in the new namespace, then waits for the forwarder before exec'ing the controller.
            self.proc = subprocess.Popen(
                ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && read go && exec "$@"', "argo", *self.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=pdeathsig,
                env={**os.environ, **(self.env or {})},
            )
        host_ns = netns_of("self")
        wait_for("the controller's network namespace", lambda: netns_of(self.proc.pid) != host_ns, 10, 0.02)
        assert self.rc is not None
        self.forwarder = Forwarder(listen_in_netns(self.proc.pid), int(self.rc.server.rsplit(":", 1)[1]))
        self.forwarder.start()
        _kubeconfig(self.rc, self.kubeconfig_path, self.forwarder.port, self.namespace)
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.close()

    @property
    def kubeconfig_path(self) -> Path:
        return self.log.with_name(f"{self.name}.kubeconfig")

    def stop(self, grace: float = 5.0) -> None:
        super().stop(grace)
        if self.forwarder is not None:
            self.forwarder.close()


# `argo server`'s port. It listens on every address of its network namespace (only --port, no bind address), and
# ignores SIGTERM and SIGINT (argo-workflows v4.0.5 util/logging/init.go): it runs in a namespace of its own like the
# controller, reached through a listener on the host's loopback, and is stopped with SIGKILL.
SERVER_PORT = 2746


@dataclass
class ArgoServer(ArgoController):
    """``argo server`` (the API and the UI) in its own network namespace: the API server reached through the
    controller's kind of forwarder, and its own port through ``inbound``, a listener on the host's 127.0.0.1."""

    inbound: Forwarder | None = None

    @property
    def url(self) -> str:
        assert self.inbound is not None
        return f"http://127.0.0.1:{self.inbound.port}"

    def stop(self, grace: float = 0.5) -> None:
        super().stop(grace)  # SIGTERM is ignored: SIGKILL after the grace
        if self.inbound is not None:
            self.inbound.close()


def start_server(rc: RealCluster, namespace: str, log_dir: Path, argo_bin: Path) -> ArgoServer:
    """Start ``argo server`` for ``namespace`` (server auth mode, plain HTTP, the first-visit modals off); returns
    once its version endpoint answers on the host's loopback."""
    import urllib.request

    log_dir.mkdir(parents=True, exist_ok=True)
    name = "argo-server"
    srv = ArgoServer(
        name,
        [
            str(argo_bin),
            "server",
            f"--kubeconfig={log_dir / (name + '.kubeconfig')}",
            "--namespaced",
            f"--managed-namespace={namespace}",
            f"--namespace={namespace}",
            "--auth-mode=server",
            "--secure=false",
            f"--port={SERVER_PORT}",
        ],
        log_dir / f"{name}.log",
        env={"FEEDBACK_MODAL": "false", "FIRST_TIME_USER_MODAL": "false", "NEW_VERSION_MODAL": "false"},
        rc=rc,
        namespace=namespace,
    )
    srv.start()
    rc.components[name] = srv
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(64)
    assert srv.proc is not None
    pid = srv.proc.pid
    srv.inbound = Forwarder(host, SERVER_PORT, dial=lambda: connect_in_netns(pid, SERVER_PORT))
    srv.inbound.start()

    def answers() -> bool:
        if not srv.alive():
            raise AssertionError(f"argo server exited:\n{srv.tail()}")
        with urllib.request.urlopen(f"{srv.url}/api/v1/version", timeout=5) as r:
            return r.status == 200

    wait_for("argo server answering", answers, 60, 0.5)
    return srv


def _kubeconfig(rc: RealCluster, path: Path, port: int, namespace: str) -> None:
    """The admin kubeconfig pointed at the forwarder, with the managed namespace as the context's namespace."""
    rc.kubeconfig(path)
    doc = yaml.safe_load(path.read_text())
    doc["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{port}"
    doc["contexts"][0]["context"]["namespace"] = namespace
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)


def configmap(namespace: str) -> dict[str, Any]:
    """The controller's configmap: metrics and telemetry servers off (config keys of argo-workflows v4.0.5
    ``config/config.go``: ``metricsConfig``, ``telemetryConfig``)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIGMAP, "namespace": namespace},
        "data": {"metricsConfig": "enabled: false\n", "telemetryConfig": "enabled: false\n"},
    }


def start(rc: RealCluster, namespace: str, log_dir: Path, name: str = CONTROLLER) -> ArgoController:
    """Start the controller for ``namespace`` (the configmap applied first); returns once it runs and has
    connected to the API server through the forwarder. ``name`` names a second controller (another namespace)."""
    t0 = time.monotonic()
    rc.apply(configmap(namespace))
    log_dir.mkdir(parents=True, exist_ok=True)
    ctl = ArgoController(
        name,
        [
            str(rc.bin_dir / CONTROLLER),
            f"--kubeconfig={log_dir / (name + '.kubeconfig')}",
            "--namespaced",
            f"--managed-namespace={namespace}",
            f"--executor-image={EXECUTOR_IMAGE}",
            "--loglevel=info",
        ],
        log_dir / f"{name}.log",
        env={"LEADER_ELECTION_DISABLE": "true", "ARGO_NAMESPACE": namespace, "DEFAULT_REQUEUE_TIME": "1s"},
        rc=rc,
        namespace=namespace,
    )
    ctl.start()
    rc.components[name] = ctl

    def connected() -> bool:
        if not ctl.alive():
            raise AssertionError(f"{name} exited:\n{ctl.tail()}")
        return ctl.forwarder is not None and ctl.forwarder.connections > 0

    wait_for(f"{name} connected to the API server", connected, 60)
    ctl.started_in_s = time.monotonic() - t0
    return ctl


# --- Workflows, as `argo submit` and `argo get` see them ----------------------------------------------------------


def submit(
    rc: RealCluster,
    path: Path,
    parameters: dict[str, str],
    namespace: str | None = None,
    edit_config: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Create the Workflow of a file of argo/ unchanged but for what ``argo submit -n NS -p name=value`` changes
    (the namespace and values of declared parameters: the drill's own reading of the file); returns it as stored.
    ``edit_config`` changes the config the file carries (validate-config's raw artifact), as an operator who
    edited the config and ran ``python -m workflows.build`` would."""
    from kubernetes import client

    from workflows.drill import load_target

    target = load_target(path, [f"{k}={v}" for k, v in parameters.items()], namespace)
    if edit_config is not None:
        edit_carried_config(target.doc, edit_config)
    return client.CustomObjectsApi(rc.admin).create_namespaced_custom_object(
        "argoproj.io", "v1alpha1", target.namespace, "workflows", target.doc
    )


def edit_carried_config(doc: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> None:
    """Change the config a Workflow document carries (validate-config's raw artifact) in place."""
    raws = [
        a["raw"]
        for t in doc["spec"]["templates"]
        for a in (t.get("inputs") or {}).get("artifacts") or []
        if a.get("name") == "config" and "raw" in a
    ]
    assert len(raws) == 1, f"{len(raws)} config artifacts in the Workflow"
    cfg = yaml.safe_load(raws[0]["data"])
    edit(cfg)
    raws[0]["data"] = yaml.safe_dump(cfg, sort_keys=True)


# The shipped config waits 30 s before a retry (capacity 120 s), counted from the attempt's end: on the real
# controller a Suspend node doing nothing for most of a recovery test. The tier's runs of the shipped file
# wait this instead; the Suspend's duration still comes from classify-failure's output (test_argo asserts it).
TIER_BACKOFF = {"base_s": 2, "factor": 2, "max_s": 10}


def tier_backoff(cfg: dict[str, Any]) -> None:
    """``edit_carried_config``: every class's retry backoff ``TIER_BACKOFF``."""
    retry = cfg.setdefault("retry", {})
    retry["default_backoff"] = dict(TIER_BACKOFF)
    retry["backoff"] = {cls: dict(TIER_BACKOFF) for cls in retry.get("backoff") or {}}


def workflow(rc: RealCluster, namespace: str, name: str) -> dict[str, Any]:
    from kubernetes import client

    return client.CustomObjectsApi(rc.admin).get_namespaced_custom_object(
        "argoproj.io", "v1alpha1", namespace, "workflows", name
    )


TERMINAL = ("Succeeded", "Failed", "Error")


def wait_finished(rc: RealCluster, namespace: str, name: str, timeout: float) -> dict[str, Any]:
    """The Workflow once it has ended; the assertion names its nodes when it has not within ``timeout``."""

    def done() -> dict[str, Any] | None:
        wf = workflow(rc, namespace, name)
        return wf if (wf.get("status") or {}).get("phase") in TERMINAL else None

    try:
        return wait_for(f"Workflow {name} finished", done, timeout, 1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{summary(workflow(rc, namespace, name))}") from None


def nodes(wf: dict[str, Any], template: str | None = None) -> list[dict[str, Any]]:
    """The Workflow's nodes (of one template), oldest first."""
    found = [
        n for n in ((wf.get("status") or {}).get("nodes") or {}).values() if template in (None, n.get("templateName"))
    ]
    return sorted(found, key=lambda n: (n.get("startedAt") or "", n["id"]))


def pods_of(wf: dict[str, Any], template: str) -> list[dict[str, Any]]:
    """The Pod nodes (one per try) of a template."""
    return [n for n in nodes(wf, template) if n.get("type") == "Pod"]


def outputs(node: dict[str, Any]) -> dict[str, str]:
    return {p["name"]: p.get("value", "") for p in ((node.get("outputs") or {}).get("parameters") or [])}


def summary(wf: dict[str, Any]) -> str:
    """One line per node: what ``argo get`` shows."""
    lines = [
        f"workflow {wf['metadata']['name']}: {(wf.get('status') or {}).get('phase')} "
        f"{(wf.get('status') or {}).get('message', '')}"
    ]
    from jaxrec.model.snapshot import parse_time

    t0 = parse_time((wf.get("status") or {}).get("startedAt"))
    for n in sorted(nodes(wf), key=lambda n: n.get("startedAt") or "~"):  # in the order they ran; skipped last
        code = (n.get("outputs") or {}).get("exitCode", "")
        began, ended = parse_time(n.get("startedAt")), parse_time(n.get("finishedAt"))
        when = f"+{began - t0:.0f}s" if began is not None and t0 is not None else ""
        took = f" {ended - began:.0f}s" if ended is not None and began is not None else ""
        name, kind, phase = n.get("displayName"), n.get("type"), n.get("phase")
        lines.append(f"  {when}{took} {name} [{kind}] {phase} exit={code} {n.get('message', '')}")
    return "\n".join(lines)
