"""Real-controller tier: the run lease's cluster id and the exit handler's gang stop, as the steps' ServiceAccount."""

from __future__ import annotations

import os
import signal

import pytest
from realcluster import wait_for
from tier import HOSTS

from recovery_steps.kernel.k8s import jobset_name
from recovery_steps.kernel.records import RunLease
from recovery_steps.kernel.store import RunLayout

pytestmark = pytest.mark.k8s


def test_an_argo_stop_ends_in_an_exit_handler_that_deletes_the_live_gang(run):
    sup = run.supervise(0)
    run.workers(0)
    os.killpg(sup.pid, signal.SIGKILL)  # argo stop kills the supervisor; the gang trains on
    sup.wait(10)
    # provision-slice takes the lease under the project's RBAC: the cluster id is kube-system's uid.
    p = run.step("recovery_steps.provision_slice", "--store-root", run.cfg.storage.root, "--run-id", run.cfg.run_id,
                 "--attempt", "0", "--output-dir", str(run.tmp / "prov"), "--holder", "uid-a",
                 "--holder-name", "wf-a")  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    held = run.store.read_record(RunLayout.LEASE, RunLease)
    kube_system = run.rc.core().read_namespace("kube-system")
    assert (held.namespace, held.cluster) == (run.ns, kube_system.metadata.uid)
    assert len(run.workers(0)) == HOSTS
    p = run.step("recovery_steps.finalize", "--store-root", run.cfg.storage.root, "--run-id", run.cfg.run_id,
                 "--status", "Failed", "--holder", "uid-a")  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    line = f"finalize: run {run.cfg.run_id} ended Failed: deleted JobSet {jobset_name(run.cfg.run_id, 0)} in " \
           f"namespace {run.ns} (foreground)"  # fmt: skip
    assert line in p.stdout.splitlines(), p.stdout
    wait_for("the gang gone", lambda: run.gone(0), 60)
    assert run.store.read_record(RunLayout.LEASE, RunLease).released


def test_a_later_attempt_refuses_an_undecided_gang_and_its_exit_handler_deletes_it(run):
    """provision-slice of attempt 1 while attempt 0's gang trains with nothing deciding it (its Workflow deleted,
    and a submission that did not continue at attempt 0): refused in one line, deleted by the exit handler."""
    from recovery_steps import lease

    sup = run.supervise(0)
    run.workers(0)
    os.killpg(sup.pid, signal.SIGKILL)  # argo delete: the supervisor pod goes with its Workflow
    sup.wait(10)
    uid = run.rc.core().read_namespace("kube-system").metadata.uid
    lease.acquire(run.store, "uid-a", "wf-a", 3600, site=lease.Site(run.ns, uid))  # the deleted Workflow's lease
    p = run.step("recovery_steps.provision_slice", "--store-root", run.cfg.storage.root, "--run-id", run.cfg.run_id,
                 "--attempt", "1", "--output-dir", str(run.tmp / "prov"), "--holder", "uid-b",
                 "--holder-name", "wf-b")  # fmt: skip
    assert p.returncode == 2 and "no supervisor decided it" in p.stderr
    assert run.store.read_record(RunLayout.LEASE, RunLease).holder == "uid-b"
    assert len(run.workers(0)) == HOSTS
    p = run.step("recovery_steps.finalize", "--store-root", run.cfg.storage.root, "--run-id", run.cfg.run_id,
                 "--status", "Failed", "--holder", "uid-b")  # fmt: skip
    assert p.returncode == 0 and "deleted JobSet" in p.stdout
    wait_for("the gang gone", lambda: run.gone(0), 60)
