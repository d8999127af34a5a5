"""Real-controller tier: the run lease's cluster id and the exit handler's gang stop, as the steps' ServiceAccount."""

from __future__ import annotations

import os
import signal

import pytest
from realcluster import wait_for
from tier import HOSTS

from jaxrec.adapters.store import RunLayout
from jaxrec.model.names import jobset_name
from jaxrec.model.records import RunLease

pytestmark = pytest.mark.k8s


def _validated(run, uid: str, first_attempt: int) -> None:
    """The lease as the Workflow's validate-config leaves it: taken (naming this cluster; an earlier holder's
    Workflow is gone), confirmed once pinned."""
    from recovery_steps import lease

    cluster = run.rc.core().read_namespace("kube-system").metadata.uid
    name = f"wf-{uid.removeprefix('uid-')}"
    lease.acquire(run.store, lease.Claimant(uid, name, lease.Site(run.ns, cluster)), 3600, is_alive=lambda _: False)
    lease.confirm(run.store, uid, first_attempt)


def test_an_argo_stop_ends_in_an_exit_handler_that_deletes_the_live_gang(run):
    _validated(run, "uid-a", 0)
    sup = run.supervise(0)
    run.workers(0)
    os.killpg(sup.pid, signal.SIGKILL)  # argo stop kills the supervisor; the gang trains on
    sup.wait(10)
    # provision-slice renews the lease under the project's RBAC (the cluster id is kube-system's uid), keeping
    # what validate-config confirmed.
    p = run.step(
        "recovery_steps.provision_slice",
        "--store-root",
        run.cfg.storage.root,
        "--run-id",
        run.cfg.run_id,
        "--attempt",
        "0",
        "--output-dir",
        str(run.tmp / "prov"),
        "--holder",
        "uid-a",
        "--holder-name",
        "wf-a",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    held = run.store.read_record(RunLayout.LEASE, RunLease)
    kube_system = run.rc.core().read_namespace("kube-system")
    assert (held.namespace, held.cluster, held.first_attempt) == (run.ns, kube_system.metadata.uid, 0)
    assert len(run.workers(0)) == HOSTS
    p = run.step(
        "recovery_steps.finalize",
        "--store-root",
        run.cfg.storage.root,
        "--run-id",
        run.cfg.run_id,
        "--status",
        "Failed",
        "--holder",
        "uid-a",
    )
    assert p.returncode == 0, p.stdout + p.stderr
    line = (
        f"finalize: run {run.cfg.run_id} ended Failed: deleted JobSet {jobset_name(run.cfg.run_id, 0)} in "
        f"namespace {run.ns} (foreground)"
    )
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
    # the deleted Workflow's lease
    lease.acquire(run.store, lease.Claimant("uid-a", "wf-a", lease.Site(run.ns, uid)), 3600)
    _validated(run, "uid-b", 1)  # the new submission's validate-config (wf-a is gone: it takes the run over)
    p = run.step(
        "recovery_steps.provision_slice",
        "--store-root",
        run.cfg.storage.root,
        "--run-id",
        run.cfg.run_id,
        "--attempt",
        "1",
        "--output-dir",
        str(run.tmp / "prov"),
        "--holder",
        "uid-b",
        "--holder-name",
        "wf-b",
    )
    assert p.returncode == 2 and "no supervisor decided it" in p.stderr
    assert run.store.read_record(RunLayout.LEASE, RunLease).holder == "uid-b"
    assert len(run.workers(0)) == HOSTS
    p = run.step(
        "recovery_steps.finalize",
        "--store-root",
        run.cfg.storage.root,
        "--run-id",
        run.cfg.run_id,
        "--status",
        "Failed",
        "--holder",
        "uid-b",
    )
    assert p.returncode == 0 and "deleted JobSet" in p.stdout
    wait_for("the gang gone", lambda: run.gone(0), 60)
