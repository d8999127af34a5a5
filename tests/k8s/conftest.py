"""Fixtures of the real-controller tier (``pytest -m k8s``): one real control plane per test run, one namespace and
one TPU node pool per test, the project's RBAC applied for real, control-plane log tails on every failure."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import realcluster
from realcluster import RealCluster, TierUnavailable
from tier import CPU_HOST_LABEL, CPU_HOSTS, HOSTS, PODEXEC_NODE, REPO, CpuHosts, Run, apply_rbac, tier_config

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import JobConfig

_STARTED: dict[str, RealCluster] = {}


def _required() -> bool:
    """In CI a missing control plane is a failure, never a skip."""
    return bool(os.environ.get("JAXREC_K8S_REQUIRED") or os.environ.get("CI"))


@pytest.fixture(scope="session")
def real_cluster(tmp_path_factory) -> Iterator[RealCluster]:
    """A real control plane on loopback for the whole test run; stopped (every process) when the run ends."""
    try:
        bin_dir = realcluster.find_binaries()
    except TierUnavailable as e:
        if _required():
            pytest.fail(f"real-controller tier required but unavailable: {e}", pytrace=False)
        pytest.skip(f"real-controller tier not run: {e}")
    rc = realcluster.start(tmp_path_factory.mktemp("control-plane"), bin_dir)
    _STARTED["cluster"] = rc
    try:
        yield rc
    finally:
        rc.stop()


@pytest.fixture
def namespace(real_cluster: RealCluster) -> Iterator[str]:
    """A namespace of this test's own, deleted after it."""
    ns = real_cluster.namespace()
    yield ns
    real_cluster.delete_namespace(ns)


@pytest.fixture
def tpu_nodes(real_cluster: RealCluster, namespace: str) -> Iterator[Callable[..., list[str]]]:
    """``add(count, cfg)``: KWOK nodes of one GKE TPU node pool (named after the test's namespace) matching the
    config's slice (accelerator and topology labels, chips, Spot); every node is deleted after the test."""
    from jaxrec.model.names import gke_node_selector
    from jaxrec.model.tpu import TPU_TYPES

    made: list[str] = []

    def add(count: int, cfg: JobConfig) -> list[str]:
        sel = gke_node_selector(cfg.slice)
        names = real_cluster.add_tpu_nodes(
            f"{namespace}-p{len(made)}",
            count,
            accelerator=sel["cloud.google.com/gke-tpu-accelerator"],
            topology=sel["cloud.google.com/gke-tpu-topology"],
            chips=TPU_TYPES[cfg.slice.accelerator].chips_per_vm,
            spot=cfg.slice.spot,
        )
        made.extend(names)
        return names

    try:
        yield add
    finally:
        real_cluster.delete_nodes(made)


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test(request) -> Iterator[None]:
    """A test on the CPU hosts leaves no run behind, whatever ended it (a test that raised mid-run would leave its
    gang training beside the next test's)."""
    yield
    if "cpu_hosts" not in request.fixturenames:
        return
    import trainers

    hosts: CpuHosts = request.getfixturevalue("cpu_hosts")
    rc: RealCluster = request.getfixturevalue("real_cluster")
    trainers.clean_run(rc, hosts.namespace, None)


def pytest_runtest_makereport(item, call):
    """Attach the control plane's log tails to a failing tier test's report; note each chaos run's result."""
    if item.path.name == "test_chaos.py" and item.config.getoption("--chaos-results"):
        _chaos_result(item, call)
    if call.when != "call" or call.excinfo is None or "cluster" not in _STARTED:
        return
    item.add_report_section("call", "control-plane logs", _STARTED["cluster"].tails(25))


def _chaos_result(item, call) -> None:
    """With ``--chaos-results FILE``: one JSON line per chaos run once its teardown ended, whatever ended it (the
    soak's record, ``tools/chaos_soak.py``): seed, outcome, seconds, faults by kind, invariant violations, notes."""
    import json

    import chaos

    seen = item.stash.setdefault(_CHAOS_KEY, {"seconds": 0.0, "outcome": "passed"})
    seen["seconds"] += call.duration
    if call.excinfo is not None and seen["outcome"] == "passed":
        seen["outcome"] = (
            f"{'failed' if call.when == 'call' else 'error'}: {call.excinfo.exconly().splitlines()[0][:200]}"
        )
    if call.when != "teardown":
        return
    run = chaos.RUNS.pop(item.nodeid, {})
    seed = item.callspec.params.get("seed") if hasattr(item, "callspec") else None
    line = {"test": item.originalname, "seed": seed, "outcome": seen["outcome"], "seconds": round(seen["seconds"], 1)}
    line |= {"faults": run.get("faults", {}), "violations": run.get("violations"), "notes": run.get("notes", [])}
    with open(item.config.getoption("--chaos-results"), "a") as f:
        f.write(json.dumps(line) + "\n")


_CHAOS_KEY = pytest.StashKey[dict]()


def pytest_terminal_summary(terminalreporter):
    """Say how long the control plane took to start, which components exited unasked (started again), and what the
    chaos runs threw and found."""
    import chaos

    if chaos.SUMMARY.runs:
        terminalreporter.write_line(chaos.SUMMARY.line())
    rc = _STARTED.get("cluster")
    if rc is not None:
        terminalreporter.write_line(
            f"real-controller tier: control plane ({', '.join(rc.components)}) started in {rc.started_in_s:.1f} s"
        )
        for e in rc.exits:  # started again by the keeper; said, never hidden
            terminalreporter.write_line(f"real-controller tier: {e}")


@pytest.fixture(scope="session")
def argo_crds(real_cluster: RealCluster) -> list[str]:
    """Argo's CRDs (the full ones, with schemas), read from the Go module cache and applied; their names."""
    import yaml

    d = realcluster.module_dir(real_cluster.bin_dir, realcluster.ARGO_MODULE) / "manifests/base/crds/full"
    names = []
    for f in sorted(d.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        crd = yaml.safe_load(f.read_text())
        real_cluster.apply(crd)
        names.append(crd["metadata"]["name"])
    for n in names:
        realcluster.wait_for(f"CRD {n} Established", lambda n=n: real_cluster.crd_established(n), 30)
    return names


@pytest.fixture
def run(real_cluster, namespace, tpu_nodes, tmp_path, request) -> Iterator[Run]:
    """The v5e-4x4 config in this test's namespace (supervision overrides from ``@pytest.mark.supervision``),
    its RBAC applied, a token of its steps' ServiceAccount and, unless marked ``nodes(n)``, a 4-node pool."""
    marker = request.node.get_closest_marker("supervision")
    overrides = marker.kwargs if marker else {}
    image = request.node.get_closest_marker("image")
    on_demand = request.node.get_closest_marker("on_demand")
    cfg = tier_config(tmp_path / "store", namespace, **overrides)
    if image or on_demand:
        update = {"image": image.args[0]} if image else {}
        if on_demand:  # the slice on on-demand VMs (the shipped v5e-4x4 config is Spot)
            update["slice"] = cfg.slice.model_copy(update={"spot": False})
        cfg = cfg.model_copy(update=update)
        RunStore(cfg.storage.root, cfg.run_id).write_json(
            RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()}
        )
    apply_rbac(real_cluster, cfg)
    token = real_cluster.token_for(namespace, cfg.service_account)
    nodes = request.node.get_closest_marker("nodes")
    tpu_nodes(nodes.args[0] if nodes else HOSTS, cfg)
    r = Run(real_cluster, cfg, tmp_path, real_cluster.kubeconfig(tmp_path / "steps.kubeconfig", token), token)
    try:
        yield r
    finally:
        for p in r.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


# --- Argo: the real workflow-controller and a process kubelet for its step pods (started only when a test asks) ---

from argoctl import ARGO_FILE, LOCAL_ARGO_FILE  # noqa: E402 - ARGO_FILE kept here for modules that import it


def podexec_tls(rc: RealCluster) -> list[str]:
    """podexec's exec endpoint: its serving certificate, and the CA of the API server's client certificate."""
    pki = rc.pki
    return [
        f"--tls-cert-file={pki.kubelet_cert}",
        f"--tls-private-key-file={pki.kubelet_key}",
        f"--client-ca-file={pki.ca}",
    ]


@pytest.fixture(scope="session")
def pods_gcs(real_cluster: RealCluster, gcs_emulator, tmp_path_factory) -> Iterator[Any]:
    """The GCS emulator as podexec's pods reach it: the HTTP fault proxy of the local rehearsals (5xx, 429) in
    front of toxiproxy (TCP faults) in front of the emulator, and the metadata server their credentials come from.
    All pass everything through until a chaos run throws a fault; the test process itself talks to the emulator
    directly, with no credentials."""
    import chaos
    import toxiproxy
    from support.metadata_server import MetadataServer

    from workflows.local.outage import OutageProxy

    tox = tcp = None
    upstream = gcs_emulator.url
    if os.access(real_cluster.bin_dir / "toxiproxy-server", os.X_OK):
        tox = toxiproxy.start(real_cluster.bin_dir, tmp_path_factory.mktemp("toxiproxy") / "toxiproxy.log")
        tcp = tox.proxy("gcs", upstream.removeprefix("http://"))
        upstream = f"http://{tcp.listen}"
    metadata = MetadataServer()
    proxy = OutageProxy(upstream, authorize=metadata.issued)
    # The pods' google-auth and tensorstore take their tokens from the metadata stand-in, as on GKE (a fixed token
    # for tensorstore would skip its own credential path).
    env = {**proxy.env(gcs_emulator.env), **metadata.env(), "GOOGLE_AUTH_TOKEN_FOR_TESTING": None}
    try:
        yield chaos.Gcs(proxy, tcp, metadata, env)
    finally:
        metadata.close()
        proxy.close()
        if tox is not None:
            tox.stop()


@pytest.fixture
def argo_run(real_cluster: RealCluster, argo, tpu_nodes, tmp_path) -> Iterator[Any]:
    """The shipped config's RBAC applied in its namespace, a TPU node pool for its slice, a store of the test's
    own; every Workflow, JobSet and pod of the namespace deleted afterwards."""
    from argorun import ArgoRun, clean

    from jaxrec.model.config import load_config

    cfg = load_config(REPO / "configs" / "v5e-4x4.yaml")
    apply_rbac(real_cluster, cfg)
    tpu_nodes(HOSTS, cfg)
    r = ArgoRun(real_cluster, cfg, tmp_path / "store")
    try:
        yield r
    finally:
        clean(real_cluster, cfg.namespace)


@pytest.fixture(scope="session")
def argo(real_cluster: RealCluster, argo_crds, pods_gcs, tmp_path_factory) -> Iterator[realcluster.Component]:
    """Argo's workflow-controller for the namespace the shipped Workflow names (``argoctl``: its own network
    namespace, the API server through a forwarder) and ``podexec`` on its own node for the step pods. The GCS
    emulator is up first: podexec's pods get its environment (through ``pods_gcs``), as pods on GKE reach the
    bucket through the node's metadata server."""
    import sys

    import argoctl
    import yaml

    if not os.access(real_cluster.bin_dir / argoctl.CONTROLLER, os.X_OK):
        msg = f"{real_cluster.bin_dir} lacks {argoctl.CONTROLLER}: run tools/k8s/build.sh"
        pytest.fail(msg, pytrace=False) if _required() else pytest.skip(msg)
    ns = yaml.safe_load((REPO / "argo" / ARGO_FILE).read_text())["metadata"]["namespace"]
    real_cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    root = tmp_path_factory.mktemp("argo")
    ctl = argoctl.start(real_cluster, ns, root / "logs")
    kubelet = realcluster.Component(
        "podexec",
        [
            sys.executable,
            str(Path(__file__).with_name("podexec.py")),
            f"--kubeconfig={real_cluster.root / 'admin.kubeconfig'}",
            f"--node={PODEXEC_NODE}",
            f"--root={root / 'pods'}",
            *podexec_tls(real_cluster),
        ],
        root / "logs" / "podexec.log",
        env=pods_gcs.env,
    )
    kubelet.start()
    real_cluster.components["podexec"] = kubelet
    realcluster.wait_for(
        f"node {PODEXEC_NODE} Ready", lambda: realcluster._ready(real_cluster.node(PODEXEC_NODE)) == "True", 30
    )
    _STARTED["argo"] = ctl
    try:
        yield ctl
    finally:
        kubelet.stop()
        ctl.stop()
        for name in ("podexec", argoctl.CONTROLLER):
            real_cluster.components.pop(name, None)


# --- Real trainers: the local file's gang as processes on process-kubelet nodes ---------------------------------------


@pytest.fixture(scope="session")
def cpu_hosts(real_cluster: RealCluster, argo, pods_gcs, tmp_path_factory) -> Iterator[CpuHosts]:
    """The local file's namespace with the project's RBAC, Argo's controller for it, and podexec on three more
    nodes (untainted: the gang's pods, which select no node, land on them or on the steps' node)."""
    import sys

    import argoctl
    import yaml

    from jaxrec.model.config import load_config
    from workflows.rbac import rbac_objects

    argo_podexec = real_cluster.components["podexec"]
    ns = yaml.safe_load((REPO / "argo" / LOCAL_ARGO_FILE).read_text())["metadata"]["namespace"]
    local = load_config(REPO / "configs" / LOCAL_ARGO_FILE)
    gke = load_config(REPO / "configs" / ARGO_FILE)
    # rbac.py writes objects for GKE configs only; the local file's accounts are the GKE config's, in its namespace.
    assert (local.service_account, local.worker_service_account) == (gke.service_account, gke.worker_service_account)
    for obj in rbac_objects([gke, gke.model_copy(update={"namespace": ns})]):
        real_cluster.apply(obj)
    root = tmp_path_factory.mktemp("cpu-hosts")
    name = f"{argoctl.CONTROLLER}-{ns}"
    argoctl.start(real_cluster, ns, root / "logs", name=name)
    kubelet = realcluster.Component(
        "podexec-cpu-hosts",
        [
            sys.executable,
            str(Path(__file__).with_name("podexec.py")),
            f"--kubeconfig={real_cluster.root / 'admin.kubeconfig'}",
            *(f"--node={n}" for n in CPU_HOSTS),
            f"--label={CPU_HOST_LABEL}=true",
            f"--root={root / 'pods'}",
            *podexec_tls(real_cluster),
        ],
        root / "logs" / "podexec.log",
        env=pods_gcs.env,
    )
    kubelet.start()
    real_cluster.components[kubelet.name] = kubelet
    for n in CPU_HOSTS:
        realcluster.wait_for(f"node {n} Ready", lambda n=n: realcluster._ready(real_cluster.node(n)) == "True", 30)
    try:
        steps_root = Path(next(a for a in argo_podexec.argv if a.startswith("--root=")).split("=", 1)[1])
        yield CpuHosts(ns, CPU_HOSTS, (root / "pods", steps_root))
    finally:
        kubelet.stop()
        real_cluster.components.pop(name).stop()
        real_cluster.components.pop(kubelet.name, None)
        real_cluster.delete_nodes(CPU_HOSTS)


@pytest.fixture(scope="session")
def uninterrupted(real_cluster: RealCluster, cpu_hosts: CpuHosts, gcs_emulator) -> Iterator[tuple]:
    """One run of the local file that nothing disturbs, ended (the run, its Workflow): the reference the runs that
    fail and recover are compared with."""
    yield from _undisturbed(real_cluster, cpu_hosts, gcs_emulator, None)


@pytest.fixture(scope="session")
def chaos_uninterrupted(real_cluster: RealCluster, cpu_hosts: CpuHosts, gcs_emulator) -> Iterator[tuple]:
    """The same for the chaos runs' smaller job (``trainers.chaos_shape``)."""
    import trainers

    yield from _undisturbed(real_cluster, cpu_hosts, gcs_emulator, trainers.chaos_shape)


def _undisturbed(real_cluster: RealCluster, cpu_hosts: CpuHosts, gcs_emulator, shape) -> Iterator[tuple]:
    import trainers

    r = trainers.new_run(real_cluster, cpu_hosts, gcs_emulator, shape=shape)
    try:
        ended = trainers.run_undisturbed(r)
    finally:
        # Its objects go at once (the store stays): a finished pod left on a node would make the drill refuse to
        # drain that node, as it refuses any node with pods that are not the drilled run's.
        trainers.clean_run(real_cluster, r.ns, r.run_id)
    yield ended
