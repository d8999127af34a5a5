"""`python -m recovery_steps.classify_failure` end to end (the CPU slice), on a local store and the emulator.

Its gang is read through the Kubernetes API (``JAXREC_K8S_HOST``: an API whose JobSets are gone, as after the
supervisor's stop): the evidence is the supervisor's snapshot and the worker reports.
"""

from __future__ import annotations

import json

import pytest
from support.ckpt_factory import restore_record
from support.local_evidence import ended_slice

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import parse_config
from jaxrec.model.contract import FailureClass
from jaxrec.model.records import AttemptRecord, Ledger, SupervisionRecord, WorkerExitReport
from jaxrec.model.snapshot import ClusterSnapshot, JobSetEvidence
from recovery_steps import classify_failure

RUN = "cf-run"
T0 = 1_714_557_600.0
HOSTS = 4


@pytest.fixture(autouse=True)
def _cluster(monkeypatch):
    """The local cluster's API, its attempts' JobSets deleted by their supervisors' stops."""
    from support.fake_k8s import FakeCluster

    from jaxrec.adapters.kube import K8S_HOST_ENV

    cluster = FakeCluster(namespace="default")
    monkeypatch.setenv(K8S_HOST_ENV, cluster.url)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    yield cluster
    cluster.close()


def setup_run(root: str) -> RunStore:
    cfg = parse_config(
        {
            "run_id": RUN,
            "image": "trainer:local",
            "slice": {"accelerator": "local", "hosts": HOSTS},
            "storage": {"root": root},
            "retry": {"default_backoff": {"base_s": 2, "factor": 3, "max_s": 100}},
        }
    )
    store = RunStore(root, RUN)
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})
    return store


def write_attempt(
    store: RunStore,
    n: int,
    codes: list[int],
    first: int,
    *,
    restore: int,
    ckpt: int | None,
    exc: tuple[str, str] | None = None,
) -> None:
    """What restore-latest, the trainer's workers and the local supervisor leave behind for attempt n."""
    restore_record(store, n, restore)
    if ckpt is not None:
        store.write_json(RunLayout.checkpoint_manifest(ckpt), {"step": ckpt})
        store.write_bytes(f"{RunLayout.checkpoint(ckpt + 5)}/state/partial", b"x")  # no manifest: not a checkpoint
    ends = []
    for i, code in enumerate(codes):
        ended = T0 + 100 * n + (10 if i == first else 11)
        if code > 0:
            r = WorkerExitReport(
                run_id=RUN,
                attempt=n,
                process_index=i,
                process_count=HOSTS,
                exit_code=code,
                exit_name=str(code),
                last_step=ckpt,
                started_at=T0 + 100 * n,
                ended_at=ended,
                exception_type=exc[0] if exc and i == first else None,
                exception_message=exc[1] if exc and i == first else None,
            )
            store.write_json(RunLayout.worker_report(n, i), r.model_dump(mode="json"))
        ends.append((code, ended))
    # The local slice as its supervisor saw it before the stop.
    pods, job = ended_slice(f"{RUN}-a{n}", ends, T0 + 100 * n)
    jobs = [job]
    snap = ClusterSnapshot(taken_at=T0 + 100 * n + 12, jobset=JobSetEvidence(name=f"{RUN}-a{n}"), jobs=jobs, pods=pods)
    sup = SupervisionRecord(
        attempt=n,
        jobset=f"{RUN}-a{n}",
        outcome="failed",
        reason=f"worker {first} failed",
        worker=first,
        detected_at=T0 + 100 * n + 12,
        snapshot=snap,
    )
    store.write_record(RunLayout.supervision(n), sup)


def outputs(d) -> dict[str, str]:
    return {p.name: p.read_text() for p in d.iterdir()}


def cli(store_root: str, n: int, out) -> int:
    return classify_failure.main(
        [
            "--store-root",
            store_root,
            "--run-id",
            RUN,
            "--attempt",
            str(n),
            "--jobset",
            f"{RUN}-a{n}",
            "--output-dir",
            str(out),
        ]
    )


def test_sequence_of_attempts_ends_with_stop(store_root, tmp_path, capsys):
    store = setup_run(store_root)

    # Attempt 0: worker 1 SIGKILLed, neighbours lose their peer -> infrastructure, retry.
    write_attempt(store, 0, [20, -9, 20, -6], first=1, restore=-1, ckpt=10)
    assert cli(store_root, 0, tmp_path / "o0") == 0
    o = outputs(tmp_path / "o0")
    assert (o["failure-class"], o["decision"], o["backoff-seconds"], o["next-attempt"]) == (
        "infrastructure",
        "retry",
        "2",
        "1",
    )
    assert o["backoff-wait"] == "0ms"  # the attempt ended long before this classification: nothing left to wait
    assert "worker 1" in o["reason"] and "\n" not in o["reason"]
    printed = capsys.readouterr().out
    assert "attempt 0 (local): infrastructure -> retry after a 2s backoff (0.0s left of it)" in printed
    assert "checkpoint: step -1 -> 10" in printed

    # Attempt 1: an application error on every worker -> retry once (budget 1).
    write_attempt(store, 1, [42, 42, 42, 42], first=2, restore=10, ckpt=20, exc=("ValueError", "bad shape"))
    assert cli(store_root, 1, tmp_path / "o1") == 0
    o = outputs(tmp_path / "o1")
    assert (o["failure-class"], o["decision"], o["next-attempt"]) == ("application", "retry", "2")
    assert json.loads(o["attempts-by-class"]) == {c.value: 0 for c in FailureClass} | {
        "infrastructure": 1,
        "application": 1,
    }

    # Attempt 2: the same application error again -> stop, naming the budget.
    write_attempt(store, 2, [42, 143, 143, 143], first=0, restore=20, ckpt=20, exc=("ValueError", "bad shape"))
    assert cli(store_root, 2, tmp_path / "o2") == 0
    o = outputs(tmp_path / "o2")
    assert (o["failure-class"], o["decision"], o["backoff-seconds"]) == ("application", "stop", "0")
    assert o["reason"].startswith("application budget spent: 2 application failure(s), budget allows 1 retry")
    assert "ValueError: bad shape" in o["reason"]

    ledger = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert [(a.attempt, a.failure_class.value, a.decision.value) for a in ledger.attempts] == [
        (0, "infrastructure", "retry"),
        (1, "application", "retry"),
        (2, "application", "stop"),
    ]
    assert [(a.checkpoint_step_before, a.checkpoint_step_after) for a in ledger.attempts] == [
        (-1, 10),
        (10, 20),
        (20, 20),
    ]
    rec = store.read_json(RunLayout.attempt_record(2))
    assert rec["decision"] == "stop" and rec["evidence"] and rec["started_at"] == T0 + 200

    # Running classify-failure again for attempt 2 (an Argo step retry) changes nothing in the counts.
    assert cli(store_root, 2, tmp_path / "o2b") == 0
    assert outputs(tmp_path / "o2b")["attempts-by-class"] == o["attempts-by-class"]
    assert len(Ledger.model_validate(store.read_json(RunLayout.LEDGER)).attempts) == 3


def test_missing_supervision_record_still_classifies_from_reports(store_root, tmp_path, capsys):
    store = setup_run(store_root)
    r = WorkerExitReport(
        run_id=RUN,
        attempt=0,
        process_index=3,
        process_count=HOSTS,
        exit_code=21,
        exit_name="HANG",
        ended_at=T0 + 5,
        last_step=7,
    )
    store.write_json(RunLayout.worker_report(0, 3), r.model_dump(mode="json"))
    assert cli(store_root, 0, tmp_path / "o") == 0
    o = outputs(tmp_path / "o")
    assert (o["failure-class"], o["decision"]) == ("hang", "retry")
    assert "- worker 3: exit 21 HANG at 10:00:05Z; last step 7" in capsys.readouterr().out


def test_missing_config_is_a_clear_error(tmp_path, capsys):
    code = cli(str(tmp_path / "empty"), 0, tmp_path / "o")
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("classify-failure: ") and "run validate-config first" in err
    assert "Traceback" not in err


def test_store_write_failure_exits_nonzero_with_message(tmp_path, capsys):
    root = str(tmp_path / "store")
    store = setup_run(root)
    write_attempt(store, 0, [143, 143, 143, 143], first=0, restore=-1, ckpt=None)
    (tmp_path / "store" / "runs" / RUN / RunLayout.attempt_record(0)).mkdir()  # the record cannot be written
    code = cli(root, 0, tmp_path / "o")
    err = capsys.readouterr().err
    assert code == 1
    assert "classify-failure: run store" in err and "unreachable" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bad", ["{not json", json.dumps({"run_id": RUN, "attempts": [{"attempt": "x"}]})])
def test_unreadable_ledger_is_reported(tmp_path, capsys, bad):
    root = str(tmp_path / "store")
    store = setup_run(root)
    write_attempt(store, 0, [143, 143, 143, 143], first=0, restore=-1, ckpt=None)
    store.write_bytes(RunLayout.LEDGER, bad.encode())
    assert cli(root, 0, tmp_path / "o") == 1
    assert "unreadable ledger" in capsys.readouterr().err


def test_provision_failure_after_its_retries_is_classified_as_capacity(store_root, tmp_path, capsys):
    from recovery_steps.provision_slice import record_outcome

    store = setup_run(store_root)
    restore_record(store, 0, -1)
    record_outcome(store_root, RUN, 0, 75, "2 of 4 TPU nodes Ready in pool tpu-pool")
    assert cli(store_root, 0, tmp_path / "o") == 0
    out = outputs(tmp_path / "o")
    assert out["failure-class"] == "capacity", out
    assert out["decision"] == "retry"
    # A provision try that later succeeded leaves no capacity verdict behind.
    record_outcome(store_root, RUN, 1, 0, "slice ready")
    write_attempt(store, 1, [42, 42, 42, 42], 0, restore=-1, ckpt=None, exc=("ValueError", "bad shape"))
    assert cli(store_root, 1, tmp_path / "o1") == 0
    assert outputs(tmp_path / "o1")["failure-class"] == "application"


def test_a_restore_latest_that_spent_its_retries_is_classified_as_a_transient_infrastructure_failure(
    store_root, tmp_path
):
    from recovery_steps.provision_slice import record_outcome

    setup_run(store_root)
    record_outcome(store_root, RUN, 0, 0, "slice ready")  # provision-slice succeeded; restore-latest never decided
    assert cli(store_root, 0, tmp_path / "o") == 0
    out = outputs(tmp_path / "o")
    assert out["failure-class"] == "infrastructure" and out["decision"] == "retry", out
    assert "69" in out["reason"] or "transient" in out["reason"].lower(), out


def _gang(*, jobset_conditions=(), job_conditions=(), supervision=None):
    from jaxrec.model.snapshot import JobEvidence, JobSetEvidence
    from recovery_steps.evidence import Evidence

    js = JobSetEvidence(name=f"{RUN}-a3", conditions=list(jobset_conditions))
    jobs = [JobEvidence(name=f"{RUN}-a3-workers-0", conditions=list(job_conditions))]
    return Evidence(backend="gke", attempt=3, jobset=js, jobs=jobs, supervision=supervision)


def test_a_gang_is_orphaned_only_while_neither_its_jobset_nor_a_job_of_it_has_failed():
    from jaxrec.model.snapshot import Condition
    from recovery_steps.classify_failure import orphaned_gang

    assert "its supervisor was lost" in orphaned_gang(_gang())
    # FailureTarget: the Job controller decided the Job fails; the JobSet reacts only once the Job is Failed.
    target = Condition(type="FailureTarget", reason="PodFailurePolicy", message="exit code 42 matching FailJob rule")
    assert orphaned_gang(_gang(job_conditions=[target])) is None
    assert orphaned_gang(_gang(job_conditions=[target.model_copy(update={"status": "False"})])) is not None
    assert orphaned_gang(_gang(jobset_conditions=[Condition(type="Failed", reason="FailedJobs")])) is None


def test_a_cluster_backend_without_a_kubernetes_config_decides_nothing(tmp_path, monkeypatch, capsys):
    """No client, no reading the gang: the attempt is not closed on the worker reports alone (configuration, 2)."""
    root = str(tmp_path / "store")
    cfg = parse_config(
        {
            "run_id": RUN,
            "namespace": "training",
            "image": "gcr.io/p/trainer:1",
            "slice": {"accelerator": "v5e", "topology": "4x4"},
            "storage": {"root": root, "durable_mount": True},
        }
    )
    store = RunStore(root, RUN)
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("JAXREC_K8S_HOST")
    assert cli(root, 3, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "no Kubernetes API" in err and "classify-failure reads the attempt's gang in the cluster" in err, err
    assert store.read_record(RunLayout.LEDGER, Ledger) is None


def test_a_replayed_classify_failure_stops_its_workflow_before_it_closes_anything(
    store_root, tmp_path, capsys, monkeypatch
):
    """argo retry of a stopped Workflow: Argo runs classify-failure of the stopped attempt after the exit handler
    closed it and released the lease; it stops the Workflow and says to resubmit, the ledger as the stop left it."""
    from support.fake_k8s import FakeCluster

    from jaxrec.adapters.kube import make_api_client
    from recovery_steps import lease
    from recovery_steps.step import load_run_config

    store = setup_run(store_root)
    lease.acquire(store, lease.Claimant("uid-a", "wf-a"), 3600)
    lease.release(store, "uid-a")
    before = store.read_record(RunLayout.LEDGER, Ledger)
    kube = FakeCluster(namespace=load_run_config(store_root, RUN, check_ledger=False).namespace)
    kube.put("workflows", {"metadata": {"name": "wf-a"}, "spec": {}})
    monkeypatch.setattr(classify_failure, "_api_client", lambda: make_api_client(kube.url))
    try:
        args = ["--store-root", store_root, "--run-id", RUN, "--attempt", "0", "--jobset", f"{RUN}-a0"]
        code = classify_failure.main(
            [*args, "--output-dir", str(tmp_path / "o"), "--workflow", "wf-a", "--holder", "uid-a"]
        )
    finally:
        kube.close()
    assert code == 2
    assert "this Workflow had already ended (argo retry replays it" in capsys.readouterr().err
    assert kube.objects["workflows"]["wf-a"]["spec"] == {"shutdown": "Stop"}
    assert store.read_record(RunLayout.LEDGER, Ledger) == before


def test_the_gang_restarted_in_place_is_closed_at_its_newest_attempt(store_root, tmp_path, capsys):
    """Attempt 0's gang was restarted in place as attempt 1 (the supervisor closed 0 at level 0, its order names
    1): classify-failure, given the gang's attempt and JobSet, closes attempt 1, and the next attempt is 2."""
    from jaxrec.model.records import AgentAction, RestartOrder

    store = setup_run(store_root)
    write_attempt(store, 0, [42, 143, 143, 143], first=0, restore=-1, ckpt=10)
    write_attempt(store, 1, [20, -9, 20, 20], first=1, restore=10, ckpt=10)
    closed = AttemptRecord(attempt=0, outcome="failed", failure_class="application", level=0)
    store.write_record(RunLayout.LEDGER, Ledger(run_id=RUN, attempts=[closed]))
    store.write_record(RunLayout.restart_order(0), RestartOrder(action=AgentAction.EXIT, attempt=1, restore_step=10))
    assert cli(store_root, 0, tmp_path / "o") == 0
    o = outputs(tmp_path / "o")
    assert (o["failure-class"], o["next-attempt"]) == ("infrastructure", "2")
    ledger = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert [(a.attempt, a.failure_class.value, a.level) for a in ledger.attempts] == [
        (0, "application", 0),
        (1, "infrastructure", None),
    ]
    assert ledger.attempts[1].jobset == f"{RUN}-a0"  # the gang's JobSet, created for attempt 0


def test_a_trainer_killed_in_its_running_pod_is_classified_from_its_agent_once_the_gang_is_gone(
    store_root, tmp_path, capsys
):
    """Attempt 1 ran in attempt 0's pods (level 0); its supervisor saw worker 1's trainer SIGKILLed, found the
    restarts in place spent and deleted the gang while its pods still ran. No report, no pod left in the API: the
    agent of worker 1 is what says the trainer was SIGKILLed, and the attempt is infrastructure, not unknown."""
    from jaxrec.model.records import AgentAction, AgentState, AgentStateKind, RestartOrder
    from jaxrec.model.snapshot import PodEvidence

    store = setup_run(store_root)
    write_attempt(store, 0, [20, -9, 20, 20], first=1, restore=-1, ckpt=10)
    restore_record(store, 1, 10)
    closed = AttemptRecord(attempt=0, outcome="failed", failure_class="infrastructure", level=0)
    store.write_record(RunLayout.LEDGER, Ledger(run_id=RUN, attempts=[closed]))
    store.write_record(RunLayout.restart_order(0), RestartOrder(action=AgentAction.EXIT, attempt=1))
    gang = f"{RUN}-a0"
    pods = [
        PodEvidence(name=f"{gang}-workers-0-{i}", worker_index=i, node=f"local-{i}", phase="Running")
        for i in range(HOSTS)
    ]
    snap = ClusterSnapshot(taken_at=T0 + 112, jobset=JobSetEvidence(name=gang), pods=pods)
    why = "worker 1's trainer exited (exit code 137, SIGKILL); its pod runs on"
    sup = SupervisionRecord(
        attempt=1, jobset=gang, outcome="failed", reason=why, worker=1, detected_at=T0 + 112, snapshot=snap
    )
    store.write_record(RunLayout.supervision(1), sup)
    for i in range(HOSTS):
        ended = AgentState(process_index=i, state=AgentStateKind.EXITED, attempt=1, exit_code=137, at=T0 + 111)
        running = AgentState(process_index=i, state=AgentStateKind.RUNNING, attempt=1, at=T0 + 105)
        store.write_record(RunLayout.agent_state(0, i), ended if i == 1 else running)
    assert cli(store_root, 0, tmp_path / "o") == 0
    o = outputs(tmp_path / "o")
    assert (o["failure-class"], o["next-attempt"]) == ("infrastructure", "2"), o
    ledger = Ledger.model_validate(store.read_json(RunLayout.LEDGER))
    assert ledger.attempts[1].failure_class == "infrastructure"
    assert "worker 1" in ledger.attempts[1].reason and "137" in ledger.attempts[1].reason, ledger.attempts[1].reason
