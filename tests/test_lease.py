"""The run lease: one live workflow per run id; a second submission fails in one line and deletes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_http import JsonServer
from test_provision_slice import FakeKube, _node, _store_config

from recovery_steps import finalize, lease, provision_slice, validate_config
from recovery_steps.kernel.k8s import make_api_client
from recovery_steps.kernel.records import Ledger, RunLease
from recovery_steps.kernel.store import RunLayout, RunStore
from workflows.local.engine import WorkflowRun

REPO = Path(__file__).resolve().parents[1]


def _lease(holder="uid-a", renewed=1000.0, ttl=600.0, released=False):
    return RunLease(run_id="r", holder=holder, holder_name=f"wf-{holder}", acquired_at=900.0, renewed_at=renewed,
                    ttl_s=ttl, released=released)  # fmt: skip


@pytest.mark.parametrize(
    "current, holder, at, alive, ok",
    [
        (None, "uid-b", 1000, None, True),
        (_lease(), "uid-a", 1100, None, True),  # renewal by the holder
        (_lease(), "uid-b", 1100, None, False),  # held and live
        (_lease(), "uid-b", 1600, None, True),  # expired at renewed + ttl
        (_lease(released=True), "uid-b", 1100, None, True),
        (_lease(), "uid-b", 1100, False, True),  # the holder's Workflow is gone
        (_lease(), "uid-b", 1100, True, False),
    ],
)
def test_decide_table(current, holder, at, alive, ok):
    assert lease.decide(current, holder, at, alive).ok is ok


def test_a_refusal_is_one_line_naming_the_holder_and_the_way_out():
    reason = lease.decide(_lease(), "uid-b", 1100).reason
    assert (
        "\n" not in reason and "wf-uid-a" in reason and "argo stop wf-uid-a" in reason and "expires in 500 s" in reason
    )


def test_two_holders_cannot_both_win_and_release_frees_it(store_root):
    store = RunStore(store_root, "r")
    clock = iter([1000.0, 1001.0, 1002.0, 1003.0]).__next__
    lease.acquire(store, "uid-a", "wf-a", 600, clock=clock)
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(store, "uid-b", "wf-b", 600, clock=clock)
    assert not lease.release(store, "uid-b")  # never another's lease
    assert lease.release(store, "uid-a")
    assert lease.acquire(store, "uid-b", "wf-b", 600, clock=clock).holder == "uid-b"
    assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-b"


def _validate(cfg_file, root, out, holder):
    return validate_config.main(["--config", str(cfg_file), "--store-root", root, "--output-dir", str(out),
                                 "--holder", holder, "--holder-name", f"wf-{holder}"])  # fmt: skip


def test_a_second_submission_of_a_local_run_fails_at_validate_config(tmp_path, capsys):
    cfg_file = REPO / "configs" / "local-cpu.yaml"
    root = str(tmp_path / "store")
    assert _validate(cfg_file, root, tmp_path / "o1", "uid-a") == 0
    capsys.readouterr()
    assert _validate(cfg_file, root, tmp_path / "o2", "uid-b") == 2
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert line.startswith("configuration: run 'local-cpu' is held by workflow wf-uid-a")
    assert not (tmp_path / "o2" / "first-attempt").exists()
    # The loser's exit handler leaves the run's ledger alone; the holder's releases the lease.
    store = RunStore(root, "local-cpu")
    assert finalize.main(["--store-root", root, "--run-id", "local-cpu", "--status", "Failed",
                          "--holder", "uid-b"]) == 0  # fmt: skip
    assert store.read_record(RunLayout.LEDGER, Ledger) is None
    assert finalize.main(["--store-root", root, "--run-id", "local-cpu", "--status", "Succeeded",
                          "--holder", "uid-a"]) == 0  # fmt: skip
    assert store.read_record(RunLayout.LEASE, RunLease).released
    assert _validate(cfg_file, root, tmp_path / "o3", "uid-b") == 0


def test_local_workflow_runs_have_distinct_uids():
    wf = {"spec": {"entrypoint": "x", "templates": []}, "metadata": {"name": "same"}}
    a, b = WorkflowRun(wf, executor=None), WorkflowRun(wf, executor=None)
    assert a.name == b.name and a.uid != b.uid
    assert a._global_names()["workflow.uid"] == a.uid


class _Argo:
    """The Argo Workflow object the lease's holder check reads (argoproj.io/v1alpha1)."""

    def __init__(self, workflows: dict[str, dict]):
        self.workflows = workflows
        self.http = JsonServer(self._route)

    def _route(self, method, raw, body):
        name = raw.split("?")[0].rsplit("/", 1)[-1]
        if "/apis/argoproj.io/v1alpha1/namespaces/training/workflows/" in raw and name in self.workflows:
            return 200, self.workflows[name]
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                     "message": f'workflows.argoproj.io "{name}" not found'}  # fmt: skip


def test_workflow_alive_reads_the_holders_workflow_object():
    running = {"metadata": {"name": "wf-uid-a", "uid": "uid-a"}, "status": {"phase": "Running"}}
    argo = _Argo({"wf-uid-a": running})
    try:
        alive = lease.workflow_alive(make_api_client(argo.http.url), "training")
        assert alive(_lease()) is True
        argo.workflows["wf-uid-a"] = {**running, "status": {"phase": "Failed"}}
        assert alive(_lease()) is False
        argo.workflows["wf-uid-a"] = {**running, "metadata": {"name": "wf-uid-a", "uid": "other"}}
        assert alive(_lease()) is False  # resubmitted under the same name: another object
        del argo.workflows["wf-uid-a"]
        assert alive(_lease()) is False
    finally:
        argo.http.close()


class _KubeWithWorkflow(FakeKube):
    """provision-slice's API paths plus the lease holder's Workflow object (Running)."""

    def get(self, path, q):
        if path == "/apis/argoproj.io/v1alpha1/namespaces/training/workflows/wf-a" and self.holder_running:
            return 200, {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                         "metadata": {"name": "wf-a", "uid": "uid-a"}, "status": {"phase": "Running"}}  # fmt: skip
        return super().get(path, q)


@pytest.mark.parametrize("holder_running", [True, False], ids=["holder-running", "holder-deleted"])
def test_provision_slice_of_a_second_submission_deletes_no_live_gang(tmp_path, capsys, holder_running):
    root = str(tmp_path / "store")
    run_id = _store_config(root, "v5e-4x4.yaml")
    store = RunStore(root, run_id)
    lease.acquire(store, "uid-a", "wf-a", 3600)
    kube = _KubeWithWorkflow(jobsets=["lm-v5e-4x4-a0"], nodes=[_node(f"n{i}") for i in range(4)])
    kube.holder_running = holder_running
    try:
        code = provision_slice.main(["--store-root", root, "--run-id", run_id, "--attempt", "1",
                                     "--output-dir", str(tmp_path / "o"), "--k8s-host", kube.url,
                                     "--holder", "uid-b", "--holder-name", "wf-b"])  # fmt: skip
    finally:
        kube.close()
    deletes = [r for r in kube.requests if r[0] == "DELETE"]
    if holder_running:
        assert code == 2 and "held by workflow wf-a" in capsys.readouterr().err
        assert not deletes and kube.jobsets == ["lm-v5e-4x4-a0"]
    else:
        # The holder's Workflow was deleted (its exit handler never ran): the run is taken over.
        assert code == 0 and len(deletes) == 1
        assert store.read_record(RunLayout.LEASE, RunLease).holder == "uid-b"
