"""The trainer's pure decisions and single-process pieces: identity, checks, faults, exit codes, data, metrics."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from support.trainer_harness import lm_examples, tiny_config

from jaxrec.model.config import ConfigError
from jaxrec.model.contract import ExitCode
from jaxrec.model.metrics import METRICS
from trainer.data import DataPosition, SyntheticSequences, build_dataset, resume_position
from trainer.decisions import (
    LocalIdentity,
    TrainerExit,
    compatibility_problems,
    coordinator_to_wait_for,
    exit_code_for,
    fsdp_axis,
    local_identity,
    parse_faults,
    topology_problems,
    watchdog_limit,
)
from trainer.lifecycle import _lock_held, wait_for_chips, wait_for_listener
from trainer.telemetry import WorkerMetrics


def test_local_identity_reads_the_runner_environment():
    ident = local_identity(
        {"TRAINER_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JOB_COMPLETION_INDEX": "2", "TRAINER_NUM_PROCESSES": "4"}
    )
    assert (ident.coordinator_address, ident.process_id, ident.num_processes) == ("127.0.0.1:1234", 2, 4)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({}, ["TRAINER_COORDINATOR_ADDRESS", "JOB_COMPLETION_INDEX", "TRAINER_NUM_PROCESSES"]),
        (
            {"TRAINER_COORDINATOR_ADDRESS": "a:1", "JOB_COMPLETION_INDEX": "4", "TRAINER_NUM_PROCESSES": "4"},
            ["JOB_COMPLETION_INDEX"],
        ),
        (
            {"TRAINER_COORDINATOR_ADDRESS": "a:1", "JOB_COMPLETION_INDEX": "x", "TRAINER_NUM_PROCESSES": "4"},
            ["JOB_COMPLETION_INDEX"],
        ),
    ],
)
def test_local_identity_names_each_bad_variable(env, names):
    with pytest.raises(TrainerExit) as e:
        local_identity(env)
    assert e.value.code == ExitCode.CONFIGURATION
    for name in names:
        assert name in str(e.value)


GKE = {"TPU_WORKER_HOSTNAMES": "lm-a3-workers-0-0.lm-a3, lm-a3-workers-0-1.lm-a3", "TPU_WORKER_ID": "1"}


@pytest.mark.parametrize(
    ("env", "local", "expected"),
    [
        ({}, LocalIdentity("127.0.0.1:9", 0, 4), None),  # process 0 hosts the service
        ({}, LocalIdentity("127.0.0.1:9", 3, 4), "127.0.0.1:9"),
        (GKE, None, "lm-a3-workers-0-0.lm-a3:8482"),  # JAX's cloud-TPU coordinator port
        ({**GKE, "JAX_COORDINATOR_PORT": "9000"}, None, "lm-a3-workers-0-0.lm-a3:9000"),
        ({**GKE, "TPU_WORKER_ID": "0"}, None, None),
        ({**GKE, "MEGASCALE_COORDINATOR_ADDRESS": "s0-w0:8080"}, None, "s0-w0:8482"),
        (
            {**GKE, "TPU_WORKER_ID": "0", "MEGASCALE_COORDINATOR_ADDRESS": "s0-w0", "MEGASCALE_SLICE_ID": "1"},
            None,
            "s0-w0:8482",
        ),  # worker 0 of another slice joins slice 0's coordinator
        ({"TPU_WORKER_ID": "1"}, None, None),  # no host list: JAX detects it, nothing to wait for first
        ({**GKE, "JAX_COORDINATOR_ADDRESS": "coord:1234"}, None, "coord:1234"),  # JAX joins the explicit one
        ({**GKE, "TPU_WORKER_ID": "x"}, None, None),
    ],
)
def test_coordinator_to_wait_for(env, local, expected):
    assert coordinator_to_wait_for(env, local) == expected


def test_wait_for_listener_returns_once_the_port_listens_and_gives_up_in_time():
    import socket
    import threading
    import time

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a free port, refused until the thread below listens on it
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_late() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_late, daemon=True).start()
    try:
        waited = wait_for_listener(f"127.0.0.1:{port}", timeout_s=10)
        assert waited is not None and 0.25 <= waited < 2.0
    finally:
        server.close()
    t0 = time.monotonic()
    assert wait_for_listener(f"127.0.0.1:{port}", timeout_s=0.2) is None
    assert time.monotonic() - t0 < 1.5
    assert wait_for_listener("no-such-host.invalid:8482", timeout_s=0.1) is None


def test_topology_agrees_and_disagrees(tmp_path):
    cfg = tiny_config(str(tmp_path))
    ok = dict(process_count=4, local_devices=1, global_devices=4, platform="cpu")
    assert topology_problems(cfg, **ok) == []
    bad = topology_problems(cfg, process_count=2, local_devices=2, global_devices=4, platform="tpu")
    assert [p.split(":")[0] for p in bad] == ["slice.hosts", "slice.devices_per_host", "slice.accelerator"]


def test_a_local_gang_of_one_on_the_machines_accelerator_needs_one(tmp_path):
    """slice.local_devices 'accelerator' (a TPU VM's chip): JAX must find one, and the gang is one host."""
    cfg = tiny_config(str(tmp_path), hosts=1, slice={"local_devices": "accelerator"}, data={"global_batch_size": 4})
    one = dict(process_count=1, local_devices=1, global_devices=1)
    assert topology_problems(cfg, **one, platform="tpu") == []
    (bad,) = topology_problems(cfg, **one, platform="cpu")
    assert bad.startswith("slice.local_devices: 'accelerator', but JAX finds no accelerator"), bad
    with pytest.raises(ConfigError, match="one program at a time can hold"):
        tiny_config(str(tmp_path), hosts=2, slice={"local_devices": "accelerator"})


def test_tpu_topology_checks_chips(tmp_path):
    cfg = tiny_config(
        str(tmp_path),
        slice={"accelerator": "v5e", "topology": "4x4", "hosts": None},
        data={"global_batch_size": 16},
        storage={"durable_mount": True},
    )
    assert topology_problems(cfg, process_count=4, local_devices=4, global_devices=16, platform="tpu") == []
    bad = topology_problems(cfg, process_count=4, local_devices=4, global_devices=8, platform="tpu")
    assert any(p.startswith("slice.topology") for p in bad)


def test_faults_parse_and_reject():
    f = parse_faults("app-bug@7, kill-during-save@10")
    assert f.due("app-bug", 7) and not f.due("app-bug", 8) and f.due("kill-during-save", 10)
    assert parse_faults(None).at == {} and parse_faults("").at == {}
    with pytest.raises(TrainerExit) as e:
        parse_faults("explode@3,nan@x")
    assert e.value.code == ExitCode.CONFIGURATION and "explode@3" in str(e.value) and "nan@x" in str(e.value)


class JaxRuntimeError(RuntimeError):
    """Same name as the runtime's error type."""


@pytest.mark.parametrize(
    ("exc", "during_init", "code"),
    [
        (JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection closed by peer"), False, ExitCode.PEER_LOST),
        (JaxRuntimeError("UNAVAILABLE: Failed to send RPC to coordination service"), False, ExitCode.PEER_LOST),
        (RuntimeError("DEADLINE_EXCEEDED: Barrier timed out"), False, ExitCode.PEER_LOST),
        (ValueError("shapes do not match"), False, ExitCode.APPLICATION),
        (JaxRuntimeError("INTERNAL: unable to initialize backend"), True, ExitCode.ACCELERATOR_INIT),
        # Another program still holds the chips (libtpu 0.0.42's words): it lets them go when it ends.
        (
            JaxRuntimeError('ABORTED: Internal error when accessing libtpu multi-process lockfile. Run "$ sudo lsof'),
            True,
            ExitCode.TRANSIENT,
        ),
        (TrainerExit(ExitCode.INCOMPATIBLE_CHECKPOINT, "x"), False, ExitCode.INCOMPATIBLE_CHECKPOINT),
        (TrainerExit(ExitCode.CONFIGURATION, "x"), True, ExitCode.CONFIGURATION),
    ],
)
def test_exit_code_for(exc, during_init, code):
    assert exit_code_for(exc, during_init=during_init) == code


def test_watchdog_gives_the_first_step_compile_grace():
    assert watchdog_limit(30, 120, first_step_done=False) == 150
    assert watchdog_limit(30, 120, first_step_done=True) == 30


def test_watchdog_gives_a_wait_for_a_save_the_save_timeout():
    assert watchdog_limit(30, 120, first_step_done=True, save_timeout_s=600) == 600
    assert watchdog_limit(30, 900, first_step_done=False, save_timeout_s=600) == 930  # never below the grace


def test_compatibility_uses_the_shared_table(tmp_path):
    cfg = tiny_config(str(tmp_path))
    saved = cfg.model_dump(mode="json")
    assert compatibility_problems(saved, 4, cfg, 4) == []
    other = tiny_config(str(tmp_path), model={"d_model": 64}, data={"dataset_version": "v2"})
    problems = compatibility_problems(saved, 2, other, 4)
    fields = sorted(p.split(":")[0] for p in problems)
    assert fields == ["data.dataset_version", "model.d_model", "process_count"]
    # Safe changes (timeouts, checkpoint interval, resume mode) are compatible.
    safe = tiny_config(
        str(tmp_path),
        training={"hang_timeout_s": 99},
        checkpoint={"interval_steps": 3},
        data={"resume_mode": "reshuffle"},
    )
    assert compatibility_problems(saved, 4, safe, 4) == []


@pytest.mark.parametrize(
    ("shape", "n", "axis"),
    [((64, 32), 4, 0), ((32, 64), 4, 1), ((3, 5), 4, None), ((), 4, None), ((8, 8), 1, None), ((6, 4), 4, 1)],
)
def test_fsdp_axis(shape, n, axis):
    assert fsdp_axis(shape, n) == axis


def test_resume_positions():
    saved = DataPosition(order_seed=5, start_step=0, next_index=10)
    assert resume_position("exact", 5, -1, None) == DataPosition(5, 0, 0)
    assert resume_position("exact", 5, 10, saved) == saved
    r1, r2 = resume_position("reshuffle", 5, 10, saved), resume_position("reshuffle", 5, 20, saved)
    assert (r1.start_step, r1.next_index) == (10, 0) and r1.order_seed != r2.order_seed != 5
    assert resume_position("reshuffle", 5, 10, saved) == r1  # deterministic


def test_processes_read_disjoint_slices_that_make_up_the_global_batch(tmp_path):
    cfg = tiny_config(str(tmp_path), data={"global_batch_size": 8, "num_records": 64})
    one = build_dataset(cfg.data, lm_examples(cfg), 7, 0, 1)
    four = [build_dataset(cfg.data, lm_examples(cfg), 7, p, 4) for p in range(4)]
    for step in (0, 3, 9):  # 9 wraps into the second epoch
        whole = {tuple(r) for r in one[step]}
        parts = [{tuple(r) for r in ds[step]} for ds in four]
        assert sum(len(p) for p in parts) == 8 and set().union(*parts) == whole
    assert np.array_equal(one[3], build_dataset(cfg.data, lm_examples(cfg), 7, 0, 1)[3])
    assert not np.array_equal(one[3], build_dataset(cfg.data, lm_examples(cfg), 8, 0, 1)[3])


def test_synthetic_records_are_reproducible_progressions():
    src = SyntheticSequences(seed=1, vocab_size=64, length=17)
    a, b = src(42), src(42)
    assert a.dtype == np.int32 and a.shape == (17,) and np.array_equal(a, b)
    assert len({int(x) for x in np.diff(a.astype(np.int64)) % 64}) == 1


def test_worker_metrics_cover_the_table():
    m = WorkerMetrics("run-a", 3, 1)
    m.set("jaxrec_train_step", 12)
    text = m.exposition()
    for spec in METRICS:
        if spec.scope == "worker":
            assert f"# TYPE {spec.name} gauge" in text
    assert 'jaxrec_train_step{attempt="3",process_index="1",run_id="run-a"} 12.0' in text


def test_worker_zero_exports_when_the_run_lease_was_last_renewed_and_keeps_it_through_an_unreadable_read(tmp_path):
    from jaxrec.adapters.store import RunLayout, RunStore
    from jaxrec.model.records import RunLease
    from trainer.hooks import LeaseGauge

    store = RunStore(str(tmp_path / "store"), "run-a")
    m = WorkerMetrics("run-a", 0, 0)
    gauge = LeaseGauge(store, m, every_s=0.05)
    line = 'jaxrec_run_lease_renewed_timestamp_seconds{attempt="0",process_index="0",run_id="run-a"}'
    assert gauge.read_once() is None and f"{line} 0.0" in m.exposition()  # no lease yet: nothing read
    lease = RunLease(run_id="run-a", holder="u1", holder_name="wf", acquired_at=100.0, renewed_at=1234.0, ttl_s=600)
    store.write_record(RunLayout.LEASE, lease)
    gauge.start()
    try:
        deadline = time.monotonic() + 10
        while f"{line} 1234.0" not in m.exposition():
            assert time.monotonic() < deadline, m.exposition()
            time.sleep(0.02)
        store.write_bytes(RunLayout.LEASE, b"{not json")  # unreadable: unknown, never a new value
        time.sleep(0.2)
        assert f"{line} 1234.0" in m.exposition()
    finally:
        gauge.stop()


def test_compilation_cache_is_on_by_default_under_the_run_store(tmp_path):
    from jaxrec.adapters.store import RunStore
    from trainer.compile_cache import cache_dir

    local = tiny_config(str(tmp_path / "store"), run_id="cache-run", share_compile_cache=False)
    assert cache_dir(local, RunStore.for_config(local)) == str(
        tmp_path / "store" / "runs" / "cache-run" / "compilation-cache"
    )
    gcs = tiny_config("gs://bucket/prefix", run_id="cache-run", share_compile_cache=False)
    assert cache_dir(gcs, RunStore.for_config(gcs)) == "gs://bucket/prefix/runs/cache-run/compilation-cache"
    explicit = tiny_config(str(tmp_path / "store"), training={"compilation_cache_dir": "/elsewhere"})
    assert cache_dir(explicit, RunStore.for_config(explicit)) == "/elsewhere"
    off = tiny_config(str(tmp_path / "store"), training={"compilation_cache": False, "compilation_cache_dir": "/x"})
    assert cache_dir(off, RunStore.for_config(off)) is None


# ---- the workers' own bucket rights, checked at start ----------------------------------------------


def _gcs_error(code: int, message: str) -> dict:
    return {"error": {"code": code, "message": message, "errors": [{"message": message, "reason": "x"}]}}


@pytest.fixture
def gcs_answering(monkeypatch):
    """A local HTTP server standing in for GCS, reached through STORAGE_EMULATOR_HOST: it answers every
    request with the status and GCS error body given, and counts the requests."""
    from jaxrec.adapters.store import STORE_RETRY_DEADLINE_ENV
    from workflows.local.apiserver import JsonServer

    servers, seen = [], []

    def make(status: int, message: str) -> list[str]:
        def route(method, path, body):
            seen.append(f"{method} {path}")
            return status, _gcs_error(status, message)

        servers.append(JsonServer(route))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", servers[-1].url)
        monkeypatch.setenv(STORE_RETRY_DEADLINE_ENV, "1")
        return seen

    yield make
    for s in servers:
        s.close()


def _bucket_errors():
    import requests
    from google.api_core import exceptions as g
    from google.auth.exceptions import DefaultCredentialsError, TransportError

    return [
        (g.Forbidden("Permission 'storage.buckets.get' denied on resource"), "lacks storage.buckets.get"),
        (g.Forbidden("Forbidden"), "lacks storage.buckets.get"),  # a 403 naming no permission: the one checked
        (g.NotFound("bucket gone"), "cannot read the metadata"),
        (g.Unauthorized("no token"), "cannot read the metadata"),
        (DefaultCredentialsError("no credentials"), "Workload Identity"),
        (g.ServiceUnavailable("backend error"), None),
        (g.InternalServerError("oops"), None),
        (g.TooManyRequests("slow down"), None),
        (g.RetryError("deadline", cause=None), None),
        (requests.exceptions.ConnectionError("refused"), None),
        (requests.exceptions.Timeout("read timed out"), None),
        (TransportError("metadata server unreachable"), None),
        (ValueError("not a store error"), None),
    ]


def _case_id(x) -> str:
    return "goes-on" if x is None else type(x).__name__ if isinstance(x, Exception) else "exit-2"


@pytest.mark.parametrize(("exc", "says"), _bucket_errors(), ids=_case_id)
def test_bucket_check_exit_refused_or_absent_is_configuration_transient_is_not(exc, says):
    from trainer.decisions import bucket_check_exit

    cfg = tiny_config("gs://b-1/p", hosts=2)
    verdict = bucket_check_exit(exc, cfg, "b-1")
    if says is None:
        assert verdict is None
    else:
        assert verdict is not None and verdict.code == ExitCode.CONFIGURATION and says in str(verdict)
        assert "gs://b-1" in str(verdict) and "\n" not in str(verdict)


def _worker(root: str):
    from trainer.app import RunArgs, Worker

    cfg = tiny_config(root, hosts=2)
    return Worker(RunArgs(root, cfg.run_id, 0, -1), env={}), cfg


def test_the_sigterm_handler_takes_no_lock_the_thread_it_interrupts_may_hold(tmp_path):
    import signal
    import threading

    from trainer.telemetry import Events

    w, _ = _worker(str(tmp_path / "store"))
    w.events = Events(str(tmp_path / "events"), 0, 0)

    def interrupted_inside_an_event_line():  # the training thread, writing the commit's event as SIGTERM comes
        with w.events._lock:
            w.on_sigterm(signal.SIGTERM, None)

    t = threading.Thread(target=interrupted_inside_an_event_line, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the handler waits for a lock its own thread holds: the worker hangs until SIGKILL"
    assert w.stop_requested and w.stop_flag() >= 1 and w._sigterm.is_set()


def test_bucket_check_passes_against_the_real_emulator_and_skips_a_local_root(gcs_bucket, tmp_path):
    w, cfg = _worker(f"gs://{gcs_bucket}/bucket-check")
    w.check_bucket(cfg)  # the bucket's metadata reads: nothing to say
    w, cfg = _worker(f"gs://no-such-bucket-{os.getpid()}/p")
    with pytest.raises(TrainerExit) as e:
        w.check_bucket(cfg)  # the emulator answers 404: refused or absent is configuration
    assert e.value.code == ExitCode.CONFIGURATION and "cannot read the metadata of gs://no-such-bucket" in str(e.value)
    w, cfg = _worker(str(tmp_path / "store"))
    w.check_bucket(cfg)  # a local root has no bucket


def test_bucket_check_403_exits_2_naming_the_permission_and_the_grant(gcs_answering):
    perm = "storage.buckets.get"
    seen = gcs_answering(
        403,
        f"w@p.iam.gserviceaccount.com does not have {perm} access to the Google Cloud Storage "
        f"bucket. Permission '{perm}' denied on resource (or it may not exist).",
    )
    w, cfg = _worker("gs://run-bucket/prefix")
    with pytest.raises(TrainerExit) as e:
        w.check_bucket(cfg)
    line = str(e.value)
    assert e.value.code == ExitCode.CONFIGURATION and "\n" not in line and len(line) < 600
    assert f"{cfg.namespace}/{cfg.worker_service_account} lacks storage.buckets.get on gs://run-bucket" in line
    assert "--role=roles/storage.legacyBucketReader" in line and f"/sa/{cfg.worker_service_account}" in line
    assert seen and seen[0].startswith("GET /storage/v1/b/run-bucket")


@pytest.mark.parametrize("status", [503, 429])
def test_bucket_check_transient_answer_is_not_a_configuration_error(gcs_answering, caplog, status):
    seen = gcs_answering(status, "Backend Error")
    w, cfg = _worker("gs://run-bucket/prefix")
    w.check_bucket(cfg)  # goes on: the store's own retries decide later
    assert len(seen) >= 2  # retried within the store's deadline first
    assert "could not read the metadata of gs://run-bucket" in caplog.text and "going on" in caplog.text


def test_worker_without_bucket_metadata_rights_exits_2_before_joining_the_gang(gcs_emulator, gcs_bucket, tmp_path):
    from support.iam_proxy import IamProxy
    from support.trainer_harness import launch, read_report, write_config

    cfg = tiny_config(f"gs://{gcs_bucket}/bucket-rights-{os.getpid()}", hosts=2)
    store = write_config(cfg)
    proxy = IamProxy(gcs_emulator.url, {"storage.buckets.get"})  # every other call reaches the emulator
    try:
        gang = launch(cfg, 0, -1, tmp_path, extra_env={"STORAGE_EMULATOR_HOST": proxy.url})
        codes = gang.wait(120)
    finally:
        proxy.close()
    assert codes == [ExitCode.CONFIGURATION] * 2, [gang.log(i)[-2000:] for i in range(2)]
    for i in range(2):
        report = read_report(store, 0, i)
        assert report["exit_code"] == 2 and report["initialized_at"] is None  # left before jax.distributed
        assert "lacks storage.buckets.get" in report["exception_message"]
        lines = [ln for ln in gang.log(i).splitlines() if "exiting with 2" in ln]
        assert len(lines) == 1 and "roles/storage.legacyBucketReader" in lines[0] and "Traceback" not in gang.log(i)


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
if sys.argv[2] == "flock":
    fcntl.flock(fd, fcntl.LOCK_EX)
else:
    fcntl.lockf(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(float(sys.argv[3]))
"""


def _holder(path, kind: str, seconds: float):
    import subprocess
    import sys

    cmd = [sys.executable, "-c", HOLD_LOCK, str(path), kind, str(seconds)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.parametrize("kind", ["flock", "lockf"])
def test_chips_another_program_holds_are_waited_for_then_taken(tmp_path, kind):
    lock = tmp_path / "libtpu_lockfile"
    assert not _lock_held(str(lock))  # no lock file: nothing holds the chips
    lock.touch()
    assert not _lock_held(str(lock)) and wait_for_chips(5, str(lock)) == 0.0  # a file nobody locks: stale
    holder = _holder(lock, kind, 1.0)
    try:
        assert _lock_held(str(lock))
        waited = wait_for_chips(30, str(lock), poll_s=0.05)
        assert 0 < waited < 30 and holder.wait(5) == 0
    finally:
        holder.kill()


def test_chips_held_past_the_bound_end_the_worker_as_transient_saying_why(tmp_path):
    lock = tmp_path / "libtpu_lockfile"
    holder = _holder(lock, "flock", 60)
    try:
        with pytest.raises(TrainerExit) as e:
            wait_for_chips(0.3, str(lock), poll_s=0.05)
    finally:
        holder.kill()
        holder.wait(5)
    assert e.value.code == ExitCode.TRANSIENT
    assert "still held by another program" in str(e.value) and str(lock) in str(e.value)


def test_the_first_step_grace_is_never_shorter_than_twice_the_runs_earlier_start_up():
    from trainer.decisions import first_step_grace

    assert first_step_grace(240, []) == 240  # the first attempt: the configured grace
    assert first_step_grace(240, [100, 300]) == 600  # a compilation of 300 s already happened: 600 s
    assert first_step_grace(240, [50]) == 240  # a short one leaves the configured grace


def test_the_worker_reads_its_runs_earlier_start_ups_from_the_exit_reports(tmp_path):
    from jaxrec.adapters.store import RunLayout, RunStore
    from jaxrec.model.records import STARTUP_ATTEMPTS_READ, WorkerExitReport
    from trainer.app import earlier_first_steps

    store = RunStore(str(tmp_path), "r")

    def report(attempt: int, index: int, took: float | None) -> WorkerExitReport:
        first = None if took is None else 1000.0 + took
        return WorkerExitReport(
            run_id="r",
            attempt=attempt,
            process_index=index,
            process_count=2,
            exit_code=20,
            exit_name="PEER_LOST",
            initialized_at=1000.0,
            first_step_at=first,
        )

    store.write_record(RunLayout.worker_report(0, 0), report(0, 0, 310.0))
    store.write_record(RunLayout.worker_report(0, 1), report(0, 1, 305.0))
    store.write_record(RunLayout.worker_report(1, 0), report(1, 0, None))  # died before its first step
    store.write_bytes(RunLayout.worker_report(1, 1), b"{torn")  # unreadable: adds nothing, stops nothing
    assert earlier_first_steps(store, 0) == []
    assert sorted(earlier_first_steps(store, 2)) == [305.0, 310.0]
    assert earlier_first_steps(store, 1 + STARTUP_ATTEMPTS_READ) == []  # only the latest attempts are read


def test_a_phase_heartbeat_says_where_the_worker_is_before_its_first_step_and_never_stops_it(tmp_path, caplog):
    from types import SimpleNamespace

    from jaxrec.adapters.store import RunLayout, RunStore
    from jaxrec.model.records import WorkerHeartbeat, WorkerPhase
    from trainer.app import phase_beat

    store = RunStore(str(tmp_path), "r")
    w = SimpleNamespace(store=store, process_index=1, args=SimpleNamespace(attempt=2))
    phase_beat(w, WorkerPhase.COMPILE, 1.0)
    beat = store.read_record(RunLayout.heartbeat(2, 1), WorkerHeartbeat)
    assert beat is not None and (beat.phase, beat.step, beat.process_index) == (WorkerPhase.COMPILE, None, 1)
    refusing = SimpleNamespace(bounded=lambda _s: SimpleNamespace(write_record=lambda *a: 1 / 0))
    phase_beat(SimpleNamespace(store=refusing, process_index=1, args=w.args), WorkerPhase.RESTORE, 1.0)
    assert "could not write the restore heartbeat" in caplog.text
