"""The tier's own promises: every component is a real, running process listening on loopback only."""

from __future__ import annotations

import psutil
import pytest

pytestmark = pytest.mark.k8s


def test_every_component_listens_on_loopback_only(real_cluster):
    """Components in this process's network namespace listen on loopback only; a component in a network namespace
    of its own (Argo's controller, ``argoctl``) counts as unreachable when loopback is that namespace's only
    interface, whatever it binds there (psutil reads this namespace's socket tables, so it is checked apart)."""
    from argoctl import netns_of

    real_cluster.check_alive()
    listening = {}
    for name, comp in real_cluster.components.items():
        if netns_of(comp.proc.pid) != netns_of("self"):
            with open(f"/proc/{comp.proc.pid}/net/dev") as f:
                interfaces = [line.split(":")[0].strip() for line in f.read().splitlines()[2:]]
            assert interfaces == ["lo"], f"{name}'s network namespace has more than loopback: {interfaces}"
            continue
        procs = [psutil.Process(comp.proc.pid), *psutil.Process(comp.proc.pid).children(recursive=True)]
        addrs = {
            (c.laddr.ip, c.laddr.port)
            for p in procs
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
        listening[name] = addrs
        assert all(ip in ("127.0.0.1", "::1") for ip, _ in addrs), f"{name} listens beyond loopback: {addrs}"
    # Those that serve (the controller-manager and the scheduler run with --secure-port=0 and serve nothing).
    assert all(listening[n] for n in ("etcd", "kube-apiserver", "jobset", "kwok")), listening
    assert ("127.0.0.1", int(real_cluster.server.rsplit(":", 1)[1])) in listening["kube-apiserver"]


def test_the_apiserver_is_the_version_the_tools_module_pins(real_cluster):
    from kubernetes import client
    from tier import REPO

    pinned = next(
        line.split()[1]
        for line in (REPO / "tools/k8s/go.mod").read_text().splitlines()
        if line.strip().startswith("k8s.io/kubernetes ")
    )
    assert client.VersionApi(real_cluster.admin).get_code().git_version == pinned


def test_a_component_that_exits_unasked_is_started_again_and_one_stopped_on_purpose_is_not(real_cluster):
    """As the kubelet restarts a control-plane static pod: kube-scheduler killed (as when it exits on a corrupted
    cache) is recorded and running again after its back-off, with the same flags; stopped by a test or a fault, it
    stays stopped until started."""
    import os
    import signal
    import time

    from realcluster import KEEPER_BACKOFF_S, KEEPER_EVERY_S, wait_for

    comp = real_cluster.components["kube-scheduler"]
    before, exits = comp.proc.pid, len(real_cluster.exits)
    os.kill(before, signal.SIGKILL)
    wait_for("kube-scheduler started again", lambda: comp.alive() and comp.proc.pid != before, 30)
    assert comp.proc.args == comp.argv
    [said] = real_cluster.exits[exits:]
    assert said.startswith(f"kube-scheduler exited with {-signal.SIGKILL} unasked"), said
    real_cluster.exits[exits:] = []  # this test's own exit: not a finding of the tier run's summary
    comp.exits.pop()

    real_cluster.restart("kube-scheduler")  # stop and start on the starter's thread: the keeper sees no gap
    assert len(real_cluster.exits) == exits
    comp.stop()
    try:
        time.sleep(3 * KEEPER_EVERY_S + KEEPER_BACKOFF_S)
        assert not comp.alive() and len(real_cluster.exits) == exits
    finally:
        real_cluster.restart("kube-scheduler")
    assert comp.alive()
