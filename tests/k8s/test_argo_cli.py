"""The real ``argo`` CLI (argo-workflows v4.0.5, built by ``tools/k8s/build.sh`` into the tier's bin directory)
driving the shipped Workflow as ``README.md`` tells users to: ``argo submit argo/<job>.yaml -p ...``, ``argo list``,
``argo get``, ``argo logs``, ``argo wait``, against the real workflow-controller and API server; the step pods run
their real programs (``podexec``, which also serves their logs as the kubelet does).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from argoctl import ARGO_FILE
from realcluster import RealCluster
from tier import REPO

pytestmark = pytest.mark.k8s

CLI_TIMEOUT_S = 60


def argo_cli(rc: RealCluster, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``argo ARGS`` as the cluster's admin."""
    cli = rc.bin_dir / "argo"
    if not os.access(cli, os.X_OK):
        from conftest import _required

        msg = f"{rc.bin_dir} lacks the argo CLI: run tools/k8s/build.sh"
        pytest.fail(msg, pytrace=False) if _required() else pytest.skip(msg)
    cmd = [str(cli), f"--kubeconfig={rc.root / 'admin.kubeconfig'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_the_cli_is_the_tiers_argo_version(real_cluster):
    out = argo_cli(real_cluster, "version", "--short")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "argo: v4.0.5", out.stdout


def test_a_run_that_gives_up_as_a_user_follows_it_with_the_cli(argo_run):
    """README scenario ``app-bug`` through the CLI: submitted from the file, listed, waited for; ``argo get`` shows
    each attempt's failed train-segment with its one-line reason and the give-up; ``argo logs`` has the failed
    supervisor's log with the time of each line."""
    rc, ns = argo_run.rc, argo_run.ns
    sub = argo_cli(rc, "submit", f"argo/{ARGO_FILE}", "-n", ns, "-p", f"store-root={argo_run.store_root}", "-o", "name")
    assert sub.returncode == 0, sub.stderr
    argo_run.name = sub.stdout.strip().rsplit("/", 1)[-1]
    listed = argo_cli(rc, "list", "-n", ns)
    assert listed.returncode == 0 and argo_run.name in listed.stdout, listed
    for attempt in (0, 1):
        pods = argo_run.workers(attempt)
        rc.exit_pod(ns, pods[1]["metadata"]["name"], 42)
    t0 = time.monotonic()
    waited = argo_cli(rc, "wait", argo_run.name, "-n", ns, timeout=240)
    assert time.monotonic() - t0 < 240 and argo_run.name in waited.stdout and "Failed" in waited.stdout, waited

    got = argo_cli(rc, "get", argo_run.name, "-n", ns, "--no-color")  # plain text: it goes to a pipe
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    assert any(line.startswith("Status:") and "Failed" in line for line in lines), got.stdout
    failed_segments = [line for line in lines if "train-segment(0)" in line]
    assert len(failed_segments) == 2, got.stdout
    # The node message is the step's one-line reason (its termination message), not a log tail.
    assert all("worker 1 failed (exit code 42" in line for line in failed_segments), got.stdout
    assert any("give-up" in line and "✖" in line for line in lines), got.stdout

    logs = argo_cli(rc, "logs", argo_run.name, "-n", ns, "--timestamps")
    assert logs.returncode == 0, logs.stderr
    assert "worker 1 failed (exit code 42" in logs.stdout, logs.stdout[-3000:]
