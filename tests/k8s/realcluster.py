"""A real Kubernetes control plane on loopback for the real-controller tier.

etcd, kube-apiserver (RBAC on), kube-controller-manager, kube-scheduler, the JobSet controller with its webhooks
registered, and KWOK in place of the kubelets, all built from Go modules by ``tools/k8s/build.sh`` and started here
as child processes. Each child is in its own process group, gets SIGKILL when the test process dies
(``PR_SET_PDEATHSIG``), listens on 127.0.0.1 only and logs to a file whose tail a failing test prints.

Timers are shortened where Kubernetes has a flag for it and the notes below say which; everything that reacts
(the Job controller's podFailurePolicy, JobSet, the scheduler, node lifecycle, taint eviction, pod GC, the garbage
collector, RBAC, admission webhooks) is the real code at the versions ``tools/k8s/go.mod`` pins.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import k8s_pki as pki_mod
import yaml

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "tools" / "k8s" / "build.sh"
STAGES = Path(__file__).with_name("kwok-stages.yaml")
ARGO_MODULE = "github.com/argoproj/argo-workflows/v4"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "jobset", "kwok")

# KWOK manages only nodes with this label; removing it is how a test loses a node (KWOK stops renewing the node's
# Lease and stops reporting its pods, as a dead kubelet would).
KWOK_LABEL = "jaxrec.test/kwok"
EXIT_CODE_ANNOTATION = "jaxrec.test/exit-code"
EXIT_REASON_ANNOTATION = "jaxrec.test/exit-reason"
NEVER_PULLS_IMAGE = "registry.invalid/never-pulls:0"
NODE_LEASE_S = 4  # KWOK renews every lease/4 s
RESTART_LIMIT_S = 120.0  # one component stopped and started again (an API server waits for etcd and its caches)
NODE_MONITOR_GRACE_S = 8  # NotReady (Unknown) after this long without a renewal
# DefaultTolerationSeconds for not-ready/unreachable (300 s by default): taint eviction marks the pods on a lost
# node this long after the taint. Shortened so that a lost-node test takes seconds.
TOLERATION_S = 3

# A component that exits without being stopped is started again, as the kubelet restarts a control-plane static pod
# (restartPolicy Always). Real components exit on purpose to be restarted: kube-scheduler logs "Scheduler cache is
# corrupted and can badly affect scheduling decisions" and exits 1 when a pod it updates or removes sits on another
# node than its cache holds, which a relist after an API server restart can bring (k8s.io/kubernetes v1.36.3,
# pkg/scheduler/backend/cache/cache.go, UpdatePod and RemovePod). The kubelet's CrashLoopBackOff waits 10 s,
# doubling to 300 s; shortened here so that a run under faults is not held by it.
KEEPER_EVERY_S = 1.0
KEEPER_BACKOFF_S = 1.0
KEEPER_BACKOFF_MAX_S = 16.0

T = TypeVar("T")
# Starts restarted components (``RealCluster.restart``); its one thread lives until the test process ends.
_STARTER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="component-starter")


class TierUnavailable(RuntimeError):
    """The control plane's binaries are not built (run tools/k8s/build.sh)."""


def pdeathsig() -> None:  # runs in the child between fork and exec: SIGKILL when the test process dies
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port free on loopback now (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hex_ip(h: str) -> str:
    raw = bytes.fromhex(h)
    # /proc/net/tcp{,6} print each 32-bit word of the address in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def netns_listeners(pid: int | str) -> set[tuple[str, int]]:
    """Every listening TCP socket of the network namespace process ``pid`` is in (``/proc/<pid>/net/tcp{,6}``,
    state 0A), whichever process holds it."""
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":
                    ip, port = cols[1].split(":")
                    found.add((_hex_ip(ip), int(port, 16)))
    return found


def find_binaries() -> Path:
    """The directory with the built binaries: ``$JAXREC_K8S_BIN``, or what build.sh's cache holds.

    Raises:
        TierUnavailable: Not built yet (the message says how to build).
    """
    env = os.environ.get("JAXREC_K8S_BIN")
    if env:
        d = Path(env)
    else:
        if shutil.which("go") is None:
            raise TierUnavailable(
                "no Go toolchain on PATH: the control plane is built from Go modules (tools/k8s/build.sh needs Go 1.26)"
            )
        out = subprocess.run([str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise TierUnavailable(
                f"the control plane is not built: run {BUILD_SCRIPT.relative_to(REPO)} "
                f"({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'no cache'})"
            )
        d = Path(out.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not os.access(d / b, os.X_OK)]
    if missing:
        raise TierUnavailable(f"{d} lacks {', '.join(missing)}: run {BUILD_SCRIPT.relative_to(REPO)}")
    return d


def module_dir(bin_dir: Path, module: str) -> Path:
    """Where the Go module cache holds ``module`` at the version the tools module pins (from build.sh's record)."""
    dirs = json.loads((bin_dir / "modules.json").read_text())
    d = Path(dirs[module])
    if not d.is_dir():
        raise TierUnavailable(f"{module} is not in the Go module cache any more ({d}): run tools/k8s/build.sh")
    return d


ADMIN_CONNECT_RETRIES = 10  # the tests' own client: refused connections tried again over about 30 s


def wait_for(what: str, check: Callable[[], T | None], timeout: float, interval: float = 0.2) -> T:
    """Poll ``check`` until it returns something other than None or False; AssertionError naming ``what`` after
    ``timeout`` seconds (with the last exception it raised, if any)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            got = check()
            if got is not None and got is not False:
                return got
        except Exception as e:  # noqa: BLE001 - not there yet; say the last reason if it never comes
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s" + (f" (last error: {last})" if last else ""))
        time.sleep(interval)


@dataclass
class Component:
    """One control-plane process and its log."""

    name: str
    argv: list[str]
    log: Path
    env: Mapping[str, str | None] | None = None  # over os.environ; a None value removes the variable
    proc: subprocess.Popen | None = None
    held: bool = False  # stopped on purpose (a test, a fault, the teardown): the keeper leaves it stopped
    exits: list[str] = field(default_factory=list)  # each exit nobody asked for, as the keeper recorded it
    down_since: float | None = None  # when the keeper saw it exited, until it starts it again

    def start(self) -> None:
        self.held, self.down_since = False, None
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=pdeathsig,
                env={k: v for k, v in {**os.environ, **(self.env or {})}.items() if v is not None},
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        self.held = True
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


@dataclass
class RealCluster:
    """The running control plane and the calls tests make on it."""

    root: Path
    bin_dir: Path
    pki: pki_mod.Pki
    server: str = ""
    components: dict[str, Component] = field(default_factory=dict)
    started_in_s: float = 0.0
    exits: list[str] = field(default_factory=list)  # every component's exits nobody asked for, in order
    _admin: Any = None
    _closing: threading.Event = field(default_factory=threading.Event)

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines; see ``_audit_policy``)."""
        return self.root / "logs" / "audit.jsonl"

    # --- clients ------------------------------------------------------------------------------------

    def api(self, token: str | None = None) -> Any:
        """A kubernetes ``ApiClient``: the admin's (client certificate) or a bearer token's, with timeouts.

        The admin's is the tests' own: a connection the API server refuses (it is restarting, a chaos fault) is
        tried again for about 30 s, as an operator's kubectl would be run again; the request never reached the
        server, so any verb is safe to repeat. A token's client answers at once (tests of what a step sees).
        """
        from kubernetes import client
        from urllib3.util.retry import Retry

        cfg = client.Configuration(host=self.server)
        cfg.ssl_ca_cert = str(self.pki.ca)
        if token is None:
            cfg.cert_file, cfg.key_file = str(self.pki.admin_cert), str(self.pki.admin_key)
            # Waits of 0, 1, 2, then 4 s each: 10 tries span 31 s (an API server restart here takes 6-15 s).
            cfg.retries = Retry(
                total=ADMIN_CONNECT_RETRIES,
                connect=ADMIN_CONNECT_RETRIES,
                read=0,
                redirect=0,
                status=0,
                other=0,
                backoff_factor=0.5,
                backoff_max=4,
            )
        else:
            cfg.api_key = {"authorization": f"Bearer {token}"}
            cfg.retries = 0
        return client.ApiClient(cfg)

    @property
    def admin(self) -> Any:
        if self._admin is None:
            self._admin = self.api()
        return self._admin

    def kubeconfig(self, path: Path, token: str | None = None) -> Path:
        """Write a kubeconfig for the admin (client certificate) or a bearer token; returns its path."""
        user: dict[str, Any] = (
            {"token": token}
            if token
            else {"client-certificate": str(self.pki.admin_cert), "client-key": str(self.pki.admin_key)}
        )
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "tier", "cluster": {"server": self.server, "certificate-authority": str(self.pki.ca)}}
            ],
            "users": [{"name": "u", "user": user}],
            "contexts": [{"name": "tier", "context": {"cluster": "tier", "user": "u"}}],
            "current-context": "tier",
        }
        path.write_text(yaml.safe_dump(doc))
        path.chmod(0o600)
        return path

    def _https(self, path: str) -> str:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca))
        ctx.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        with urllib.request.urlopen(self.server + path, context=ctx, timeout=5) as r:  # noqa: S310 - loopback
            return r.read().decode()

    # --- generic object calls -----------------------------------------------------------------------

    def apply(self, obj: Mapping[str, Any], *, dry_run: bool = False, api: Any = None) -> dict[str, Any]:
        """Create ``obj`` (or replace it when it exists) through the dynamic client; returns what the server stored."""
        from kubernetes import dynamic
        from kubernetes.client.exceptions import ApiException

        dyn = dynamic.DynamicClient(api or self.admin)
        res = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
        ns = (obj.get("metadata") or {}).get("namespace") if res.namespaced else None
        kw: dict[str, Any] = {"dry_run": "All"} if dry_run else {}
        try:
            return res.create(body=dict(obj), namespace=ns, **kw).to_dict()
        except ApiException as e:
            if e.status != 409 or dry_run:
                raise
        current = res.get(name=obj["metadata"]["name"], namespace=ns).to_dict()
        body = json.loads(json.dumps(obj))
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        return res.replace(body=body, namespace=ns).to_dict()

    def core(self, api: Any = None) -> Any:
        from kubernetes import client

        return client.CoreV1Api(api or self.admin)

    def pods(self, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        """The pods of a namespace as the API returns them (raw JSON)."""
        resp = self.core().list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
        return json.loads(resp.data)["items"]

    def jobset(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            resp = client.CustomObjectsApi(self.admin).get_namespaced_custom_object(
                "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name, _preload_content=False
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def jobs(self, namespace: str) -> list[dict[str, Any]]:
        from kubernetes import client

        resp = client.BatchV1Api(self.admin).list_namespaced_job(namespace, _preload_content=False)
        return json.loads(resp.data)["items"]

    def crd_established(self, name: str) -> bool:
        from kubernetes import client

        crd = client.ApiextensionsV1Api(self.admin).read_custom_resource_definition(name)
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    def node(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return json.loads(self.core().read_node(name, _preload_content=False).data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    # --- what tests do to the cluster -----------------------------------------------------------

    def namespace(self, prefix: str = "t") -> str:
        """A fresh namespace (deleted by the caller's fixture)."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        # The service-account controller creates "default" in each namespace; pods need it to exist.
        wait_for(
            f"ServiceAccount default in {name}",
            lambda: self.core().read_namespaced_service_account("default", name),
            30,
        )
        return name

    def delete_namespace(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            self.core().delete_namespace(name)

    def token_for(self, namespace: str, service_account: str, seconds: int = 3600) -> str:
        """A bound token of ``service_account`` (TokenRequest, as a projected token in a pod would be)."""
        from kubernetes import client

        req = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=seconds)
        )
        return self.core().create_namespaced_service_account_token(service_account, namespace, req).status.token

    def add_tpu_nodes(
        self,
        pool: str,
        count: int,
        *,
        accelerator: str,
        topology: str,
        chips: int,
        cpu: str = "224",
        memory: str = "192Gi",
        spot: bool = False,
        extra_labels: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Create ``count`` KWOK-managed nodes of one GKE TPU node pool; wait until each is Ready."""
        names = []
        for i in range(count):
            name = f"gke-{pool}-{i}"
            labels = {
                KWOK_LABEL: "managed",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "cloud.google.com/gke-nodepool": pool,
                "cloud.google.com/gke-tpu-accelerator": accelerator,
                "cloud.google.com/gke-tpu-topology": topology,
                **({"cloud.google.com/gke-spot": "true"} if spot else {}),
                **(extra_labels or {}),
            }
            resources = {"cpu": cpu, "memory": memory, "pods": "110", "google.com/tpu": str(chips)}
            taints = [{"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}]
            if spot:
                taints.append({"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"})
            self.apply(
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": name, "labels": labels, "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
                    "spec": {"taints": taints},
                    "status": {"allocatable": resources, "capacity": resources},
                }
            )
            names.append(name)
        for name in names:
            wait_for(f"node {name} Ready", lambda n=name: _ready(self.node(n)) == "True", 30)
        return names

    def delete_nodes(self, names: Iterable[str]) -> None:
        from kubernetes.client.exceptions import ApiException

        for n in names:
            with contextlib.suppress(ApiException):
                self.core().delete_node(n)

    def lose_node(self, name: str) -> None:
        """Take a node away from KWOK: its Lease is no longer renewed and its pods are no longer reported."""
        self.core().patch_node(name, {"metadata": {"labels": {KWOK_LABEL: None}}})

    def exit_pod(self, namespace: str, pod: str, code: int, reason: str | None = None) -> None:
        """Make the pod's container exit with ``code`` (and the terminated ``reason``, e.g. OOMKilled); the KWOK
        stage reports it as the kubelet would."""
        notes = {EXIT_CODE_ANNOTATION: str(code), **({EXIT_REASON_ANNOTATION: reason} if reason else {})}
        self.core().patch_namespaced_pod(pod, namespace, {"metadata": {"annotations": notes}})

    # --- lifecycle ---------------------------------------------------------------------------------

    def wait_jobset_webhooks(self, timeout: float = 60) -> None:
        """Until a JobSet can be created: the webhooks answer once the JobSet controller's server is up (a
        server-side dry run goes through them)."""
        probe = {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": "tier-probe", "namespace": "default"},
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "w",
                        "replicas": 1,
                        "template": {
                            "spec": {
                                "template": {
                                    "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}
                                }
                            }
                        },
                    }
                ]
            },
        }
        wait_for("JobSet webhooks answering (dry-run create)", lambda: self.apply(probe, dry_run=True), timeout, 0.5)

    def restart(self, name: str) -> None:
        """Start a stopped component again with the same flags (ports, certificates, data).

        The new process is started from a thread that lives as long as this process: ``PR_SET_PDEATHSIG`` sends its
        signal when the *thread* that forked the child ends, so a component restarted from a short-lived thread (a
        chaos fault's) would be killed the moment that thread returned. Stop and start both run on that one
        thread, so that two restarts of one component (two faults at once) follow each other: interleaved, the
        second's start found the first's new process on the port, exited, and left that process running untracked.
        """
        comp = self.components[name]

        def again() -> None:
            comp.stop()
            comp.start()

        _STARTER.submit(again).result(timeout=RESTART_LIMIT_S)
        if name == "jobset":
            self.wait_jobset_webhooks()

    def down_for(self, name: str, seconds: float) -> None:
        """Stop a component, keep it stopped ``seconds``, start it again with the same flags (on the starter's
        thread, as ``restart``: the keeper leaves a component stopped on purpose alone)."""
        comp = self.components[name]

        def outage() -> None:
            comp.stop()
            time.sleep(seconds)
            comp.start()

        _STARTER.submit(outage).result(timeout=RESTART_LIMIT_S + seconds)

    def keep(self) -> None:
        """Start the keeper: every ``KEEPER_EVERY_S`` a component that exited unasked (not ``held``) is recorded in
        ``exits`` and, after its back-off, started again with the same flags. It runs on the starter's thread, so it
        never sees the gap inside ``restart``'s stop and start."""

        def loop() -> None:
            while not self._closing.wait(KEEPER_EVERY_S):
                try:
                    _STARTER.submit(self._start_exited).result(timeout=RESTART_LIMIT_S)
                except Exception as e:  # noqa: BLE001 - a start that failed is tried again at the next look
                    self.exits.append(f"keeper: {type(e).__name__}: {e}")

        threading.Thread(target=loop, name="component-keeper", daemon=True).start()

    def _start_exited(self) -> None:
        now = time.monotonic()
        for c in list(self.components.values()):
            if c.held or c.proc is None or c.proc.poll() is None or self._closing.is_set():
                continue
            if c.down_since is None:
                c.down_since = now
                said = next((ln for ln in reversed(c.tail(20).splitlines()) if ln.strip()), "(no log)")
                c.exits.append(f"{c.name} exited with {c.proc.returncode} unasked; its last line: {said[:300]}")
                self.exits.append(c.exits[-1])
            if now - c.down_since >= min(KEEPER_BACKOFF_S * 2 ** (len(c.exits) - 1), KEEPER_BACKOFF_MAX_S):
                c.stop()  # nothing to stop: what goes with the process (Argo's forwarder) is closed
                c.start()

    def tails(self, lines: int = 30) -> str:
        return "\n".join(f"----- {c.name} ({c.log}) -----\n{c.tail(lines)}" for c in self.components.values())

    def check_alive(self) -> None:
        dead = [c.name for c in self.components.values() if not c.alive()]
        if dead:
            raise AssertionError(f"control-plane component(s) exited: {', '.join(dead)}\n{self.tails()}")

    def stop(self) -> None:
        self._closing.set()
        for c in reversed(list(self.components.values())):
            c.stop()


def _ready(node: Mapping[str, Any] | None) -> str | None:
    for c in ((node or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status")
    return None


def start(root: Path, bin_dir: Path, say: Callable[[str], None] = print) -> RealCluster:
    """Start the control plane under ``root``; returns when a JobSet can be created (webhooks answer)."""
    t0 = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    pki = pki_mod.generate(root / "pki")
    rc = RealCluster(root=root, bin_dir=bin_dir, pki=pki)
    try:
        _start(rc, logs)
    except BaseException:
        say(rc.tails())
        rc.stop()
        raise
    rc.started_in_s = time.monotonic() - t0
    rc.keep()
    return rc


def _start(rc: RealCluster, logs: Path) -> None:
    b, pki, root = rc.bin_dir, rc.pki, rc.root

    def comp(name: str, argv: list[str]) -> Component:
        c = Component(name, argv, logs / f"{name}.log")
        rc.components[name] = c
        c.start()
        return c

    etcd_client, etcd_peer = free_port(), free_port()
    comp(
        "etcd",
        [
            str(b / "etcd"),
            "--name=tier",
            f"--data-dir={root / 'etcd'}",
            "--unsafe-no-fsync",
            f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
            f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
            f"--initial-cluster=tier=http://127.0.0.1:{etcd_peer}",
            "--log-level=warn",
        ],
    )

    def etcd_healthy() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{etcd_client}/health", timeout=2) as r:  # noqa: S310
            return json.loads(r.read()).get("health") == "true"

    wait_for("etcd healthy", etcd_healthy, 30)

    api_port = free_port()
    rc.server = f"https://127.0.0.1:{api_port}"
    comp(
        "kube-apiserver",
        [
            str(b / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}",
            f"--tls-cert-file={pki.apiserver_cert}",
            f"--tls-private-key-file={pki.apiserver_key}",
            f"--client-ca-file={pki.ca}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--authorization-mode=Node,RBAC",
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            f"--default-not-ready-toleration-seconds={TOLERATION_S}",
            f"--default-unreachable-toleration-seconds={TOLERATION_S}",
            f"--cert-dir={root / 'apiserver-certs'}",
            # exec and the other node proxies: the kubelet's serving certificate is verified against the tier CA
            # (without this flag the API server does not verify it at all), the API server presents its own
            # client certificate, and dials the node's InternalIP (podexec's nodes report 127.0.0.1; the
            # default order tries Hostname first, a node name that nothing resolves here).
            f"--kubelet-certificate-authority={pki.ca}",
            f"--kubelet-client-certificate={pki.kubelet_client_cert}",
            f"--kubelet-client-key={pki.kubelet_client_key}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # The API server's own record of every delete and eviction (who, what, when, the answer): what the
            # chaos runs check their invariants against (``chaos.audit_deletes``).
            f"--audit-policy-file={_audit_policy(root)}",
            f"--audit-log-path={rc.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
            # Compaction every 30 s instead of 5 min: a watch resumed after an API server restart or a cut
            # stream meets 410 Gone, as a watch on a busy cluster does.
            "--etcd-compaction-interval=30s",
        ],
    )
    wait_for("kube-apiserver /readyz", lambda: rc._https("/readyz") == "ok", 90, 0.3)
    admin_kc = rc.kubeconfig(root / "admin.kubeconfig")

    # The JobSet CRD (read from the module cache, never copied) and its webhooks, pointed at the local controller.
    jobset_dir = module_dir(rc.bin_dir, "sigs.k8s.io/jobset")
    crd = yaml.safe_load((jobset_dir / "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml").read_text())
    rc.apply(crd)
    wait_for("JobSet CRD Established", lambda: rc.crd_established(crd["metadata"]["name"]), 30)
    hook_port = free_port()
    for doc in _webhooks(jobset_dir, hook_port, pki.ca.read_bytes()):
        rc.apply(doc)

    comp(
        "kube-controller-manager",
        [
            str(b / "kube-controller-manager"),
            f"--kubeconfig={admin_kc}",
            "--leader-elect=false",
            "--use-service-account-credentials=false",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--controllers=job-controller,garbage-collector-controller,node-lifecycle-controller,"
            "taint-eviction-controller,pod-garbage-collector-controller,serviceaccount-controller,"
            "serviceaccount-token-controller,namespace-controller,root-ca-certificate-publisher-controller",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca}",
            "--node-monitor-period=1s",
            f"--node-monitor-grace-period={NODE_MONITOR_GRACE_S}s",
            "--node-startup-grace-period=30s",
            "--concurrent-job-syncs=5",
        ],
    )
    comp(
        "kube-scheduler",
        [
            str(b / "kube-scheduler"),
            f"--kubeconfig={admin_kc}",
            f"--authentication-kubeconfig={admin_kc}",
            f"--authorization-kubeconfig={admin_kc}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
        ],
    )
    cfg = root / "jobset-config.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
                "kind": "Configuration",
                "leaderElection": {"leaderElect": False},
                "internalCertManagement": {"enable": False},
                "webhook": {"port": hook_port, "host": "127.0.0.1", "certDir": str(pki.webhook_dir)},
                "metrics": {"bindAddress": "0"},
                "health": {"healthProbeBindAddress": "0"},
            }
        )
    )
    comp("jobset", [str(b / "jobset"), f"--kubeconfig={admin_kc}", f"--config={cfg}", "--zap-log-level=info"])
    comp(
        "kwok",
        [
            str(b / "kwok"),
            f"--kubeconfig={admin_kc}",
            f"--config={STAGES}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-label-selector={KWOK_LABEL}=managed",
            "--node-ip=127.0.0.1",
            "--cidr=10.244.0.0/16",
            f"--node-lease-duration-seconds={NODE_LEASE_S}",
            f"--server-address=127.0.0.1:{free_port()}",
        ],
    )

    wait_for(
        "ServiceAccount default (controller-manager up)",
        lambda: rc.core().read_namespaced_service_account("default", "default"),
        60,
    )
    rc.wait_jobset_webhooks()
    rc.check_alive()


def _audit_policy(root: Path) -> Path:
    """An audit policy that records deletes and evictions (metadata only, once the answer is sent) and nothing
    else (``audit.k8s.io/v1`` Policy; rules match in order)."""
    policy = {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived", "ResponseStarted"],
        "rules": [
            {"level": "Metadata", "verbs": ["delete", "deletecollection"]},
            {"level": "Metadata", "verbs": ["create"], "resources": [{"group": "", "resources": ["pods/eviction"]}]},
            {"level": "None"},
        ],
    }
    path = root / "audit-policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


def _webhooks(jobset_dir: Path, port: int, ca_pem: bytes) -> list[dict[str, Any]]:
    """JobSet's webhook configurations with its own objectSelector patches, each service reference replaced by
    the local controller's URL (``config/components/webhook``; the kustomization applies the same patches)."""
    base = list(yaml.safe_load_all((jobset_dir / "config/components/webhook/manifests.yaml").read_text()))
    patches = {
        "MutatingWebhookConfiguration": "mutating-patch.yaml",
        "ValidatingWebhookConfiguration": "validating-patch.yaml",
    }
    out = []
    for doc in base:
        if not doc:
            continue
        for op in yaml.safe_load((jobset_dir / "config/components/webhook/patches" / patches[doc["kind"]]).read_text()):
            assert op["op"] == "replace" and op["path"].startswith("/webhooks/"), op
            doc["webhooks"][int(op["path"].rsplit("/", 1)[1])] = op["value"]
        doc["metadata"]["name"] = f"jobset-{doc['metadata']['name']}"
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(ca_pem).decode(),
            }
        out.append(doc)
    return out
