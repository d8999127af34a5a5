"""The trainer as real multi-process JAX gangs on the CPU: train, kill, resume, preempt, crash mid-save."""

from __future__ import annotations

import re
import signal
import time

import pytest
from support.trainer_harness import launch, loopback, read_report, tiny_classifier_config, tiny_config, write_config

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import CheckpointManifest, EventKind, PreemptionSave
from trainer.decisions import save_budget

pytestmark = pytest.mark.slow

N = 4
TOTAL = 20
CONTRACT = {int(c) for c in ExitCode}


def committed_steps(store: RunStore) -> list[int]:
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(store.url(RunLayout.CHECKPOINTS), options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        return sorted(mgr.all_steps())
    finally:
        mgr.close()


def manifest(store: RunStore, step: int) -> CheckpointManifest | None:
    raw = store.read_json(RunLayout.checkpoint_manifest(step))
    return None if raw is None else CheckpointManifest.model_validate(raw)


def digests(store: RunStore, attempt: int, n: int = N) -> set[str]:
    return {read_report(store, attempt, i)["params_digest"] for i in range(n)}


def _uninterrupted(work, cfg):
    store = write_config(cfg)
    n = cfg.slice.num_hosts
    gang = launch(cfg, 0, -1, work)
    codes = gang.wait(240)
    assert codes == [0] * n, gang.tails()
    (digest,) = digests(store, 0, n)  # every process ends with the same parameters
    # Every process counts a step as committed only once process 0 has written its manifest.
    commits = [e for i in range(n) for e in gang.events(i) if e.event == EventKind.SAVE_COMMITTED]
    assert len(commits) == n * len(committed_steps(store)), commits
    for e in commits:
        m = manifest(store, e.step)
        assert m is not None and e.t >= m.wall_time, (e, m and m.wall_time)
    return cfg, store, digest


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-process run of TOTAL steps: its store and final params digest."""
    work = tmp_path_factory.mktemp("reference")
    return _uninterrupted(work, tiny_config(str(work / "store"), run_id="reference"))


@pytest.fixture(scope="module")
def lm_reference(tmp_path_factory):
    """The same on 2 processes: the gang the kill and preemption tests compare with (a gang of two fails, stops
    and resumes as one of four does, at half the start-up)."""
    work = tmp_path_factory.mktemp("lm-reference")
    return _uninterrupted(work, tiny_config(str(work / "store"), run_id="reference", hosts=2))


def _lm_config(root: str, run_id: str, **sections):
    return tiny_config(root, run_id=run_id, hosts=2, **sections)


@pytest.fixture(scope="module")
def classifier_reference(tmp_path_factory):
    """The same for the example image classifier (flax NNX, batch-norm statistics as extra state), 2 processes."""
    work = tmp_path_factory.mktemp("classifier-reference")
    return _uninterrupted(work, tiny_classifier_config(str(work / "store"), run_id="reference"))


TASKS = {"lm": (_lm_config, "lm_reference"), "image-classifier": (tiny_classifier_config, "classifier_reference")}


@pytest.fixture(params=sorted(TASKS))
def task(request):
    """Each task's config maker and uninterrupted reference run (2 processes each)."""
    make, reference_fixture = TASKS[request.param]
    return make, request.getfixturevalue(reference_fixture)


def test_gang_trains_checkpoints_and_exits_zero(reference):
    cfg, store, _ = reference
    assert committed_steps(store) == [5, 10, 15, 20]
    for step in (5, 10, 15, 20):
        m = manifest(store, step)
        assert m is not None and m.step == step
        assert m.config_hash == cfg.config_hash() and m.process_count == N and m.mesh_shape == {"data": N}
        assert {f.path.split("/")[0] for f in m.files} >= {"state", "data"}
        assert m.save_seconds is not None and m.save_seconds >= 0
    for i in range(N):
        r = read_report(store, 0, i)
        assert (r["exit_code"], r["exit_name"], r["last_step"], r["last_checkpoint_step"]) == (0, "OK", TOTAL, TOTAL)
        assert r["compile_seconds"] > 0 and r["first_step_at"] >= r["restored_at"] >= r["initialized_at"]
        assert r["peak_rss_mib"] < 1024


def state_digests(store: RunStore, attempt: int, n: int) -> list[str]:
    return [read_report(store, attempt, i)["state_digest"] for i in range(n)]


def test_sigkill_of_one_worker_then_resume_is_bit_identical(task, tmp_path):
    make, (_, ref_store, want) = task
    cfg = make(str(tmp_path / "store"), run_id="killed", training={"step_delay_s": 0.05})
    store = write_config(cfg)
    n = cfg.slice.num_hosts
    victim = n // 2
    survivors = [i for i in range(n) if i != victim]
    gang = launch(cfg, 0, -1, tmp_path)
    gang.wait_for(0, EventKind.SAVE_COMMITTED, 10)
    gang.wait_for(victim, EventKind.STEP, 12)
    # A local gang listens on loopback alone (its coordinator, its metrics), never on every interface.
    listening = gang.listening()
    assert listening and all(loopback(ip) for ip, _ in listening), listening
    killed_at = gang.signal(victim, signal.SIGKILL)
    codes = gang.wait(30)
    ends = [e.t for i in survivors for e in gang.events(i) if e.event == EventKind.EXIT]
    assert codes[victim] == -signal.SIGKILL
    assert all(codes[i] in CONTRACT - {0} for i in survivors), codes
    assert len(ends) == len(survivors) and max(ends) - killed_at < 15, (ends, killed_at)
    for i in survivors:
        assert read_report(store, 0, i)["exit_code"] == codes[i]

    restore = max(s for s in committed_steps(store) if manifest(store, s) is not None)
    assert 10 <= restore < TOTAL
    # The next gang as worker pods on a cluster: the kubelet's KUBERNETES_SERVICE_HOST, and no token (the workers'
    # account mounts none), so nothing in the trainer may load the in-cluster config.
    in_pod = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    gang = launch(cfg, 1, restore, tmp_path, extra_env=in_pod)
    assert gang.wait(240) == [0] * n, gang.tails()
    assert [e.step for e in gang.events(1) if e.event == EventKind.RESTORED] == [restore]
    # Where the start-up went, part by part, from the runtime ready to the state restored.
    r = read_report(store, 1, 0)
    parts = r["restore_parts"]
    assert set(parts) == {
        "task, data and manifest opened",
        "model built",
        "compile started",
        "newer steps set aside",
        "checkpointer opened",
        "checkpoint read",
        "bytes read checked",
        "state ready on the devices",
    }, parts
    assert all(v >= 0 for v in parts.values()) and sum(parts.values()) <= r["restored_at"] - r["initialized_at"] + 0.01
    assert digests(store, 1, n) == {want}
    # The whole state, optimizer state included, shard by shard: as the uninterrupted run's.
    assert state_digests(store, 1, n) == state_digests(ref_store, 0, n) and None not in state_digests(store, 1, n)


def test_sigkill_during_async_save_leaves_no_committed_step(tmp_path):
    cfg = tiny_config(str(tmp_path / "store"), run_id="torn-save", hosts=2, training={"total_steps": 12})
    store = write_config(cfg)
    gang = launch(cfg, 0, -1, tmp_path, fault="kill-during-save@10")
    codes = gang.wait(180)
    assert codes[0] == -signal.SIGKILL
    assert all(c in CONTRACT - {0} for c in codes[1:]), codes
    assert 10 not in committed_steps(store)
    assert manifest(store, 10) is None
    assert manifest(store, 5) is not None and 5 in committed_steps(store)


def test_sigterm_saves_the_agreed_step_and_next_attempt_resumes_there(task, tmp_path):
    make, (_, _, want) = task
    grace = 10  # the window (unset) is the grace: a budget of 9 s, far more than a local save takes
    cfg = make(
        str(tmp_path / "store"),
        run_id="preempted",
        training={"step_delay_s": 0.05},
        slice={"termination_grace_s": grace},
    )
    store = write_config(cfg)
    n = cfg.slice.num_hosts
    gang = launch(cfg, 0, -1, tmp_path)
    gang.wait_for(0, EventKind.SAVE_COMMITTED, 5)  # its measured duration is the estimate the stop decides by
    gang.wait_for(1, EventKind.STEP, 6)
    # Process 0 decides from the save time it measured: wait until it has seen the step-5 commit.
    gang.wait_for(0, EventKind.SAVE_COMMITTED, 5)
    sent_at_step = gang.last_step(1)
    for i in range(1, n, 2):  # SIGTERM, then SIGKILL after the grace, as the kubelet does, to the odd workers
        gang.preempt([i], grace)  # the others never get it: they stop through the agreement
        time.sleep(0.1)
    codes = gang.wait(120)
    assert codes == [ExitCode.PREEMPTED] * n, gang.tails()
    stops = {read_report(store, 0, i)["last_step"] for i in range(n)}
    assert len(stops) == 1
    (stop,) = stops
    assert sent_at_step <= stop < TOTAL
    assert manifest(store, stop) is not None and stop in committed_steps(store)
    assert all(read_report(store, 0, i)["last_checkpoint_step"] == stop for i in range(n))
    # Process 0 (which got no SIGTERM) decided from the age of worker 1's SIGTERM; every process followed.
    plans = {
        (r["preemption_save"], r["preemption_reason"], r["preemption_budget_s"], r["preemption_estimate_s"])
        for r in (read_report(store, 0, i) for i in range(n))
    }
    assert len(plans) == 1, plans
    ((saved, reason, budget, estimate),) = plans
    # "the save fits" or, with an interval save still in flight, "the save in flight and one more fit".
    assert saved == PreemptionSave.SAVED and budget == save_budget(grace) and re.search(r"fits?: .* <= ", reason)
    assert estimate is not None and estimate > 0  # the step-5 save's own measured duration

    gang = launch(cfg, 1, stop, tmp_path)
    assert gang.wait(240) == [0] * n, gang.tails()
    restored = [e for e in gang.events(0) if e.event == EventKind.RESTORED]
    assert restored[0].step == stop
    assert digests(store, 1, n) == {want}  # no step lost or repeated


def test_sigterm_with_a_window_too_short_for_the_save_exits_at_once_without_saving(tmp_path):
    from recovery_steps import restore_latest

    # The pod's grace is long, but the node gives 1 s: a budget of 0 s, shorter than any measured save.
    grace = 10
    cfg = tiny_config(
        str(tmp_path / "store"),
        run_id="preempt-skip",
        hosts=2,
        # 40 steps 0.1 s apart: the SIGTERMs land about step 10, seconds before the last step even on a loaded
        # machine (with 20 steps 0.05 s apart the gang could reach its end first and exit 0).
        training={"step_delay_s": 0.1, "total_steps": 40},
        slice={"termination_grace_s": grace, "shutdown_window_s": 1},
    )
    store = write_config(cfg)
    gang = launch(cfg, 0, -1, tmp_path)
    gang.wait_for(0, EventKind.SAVE_COMMITTED, 5, timeout=240)  # compilation is slow on a loaded machine
    gang.wait_for(0, EventKind.SAVE_STARTED, 10)  # the step-10 save is (most likely) in flight: it is abandoned too
    n = cfg.slice.num_hosts
    gang.preempt(list(range(n)), grace)
    codes = gang.wait(120)
    assert codes == [ExitCode.PREEMPTED] * n, gang.tails()
    reports = [read_report(store, 0, i) for i in range(n)]
    (stop,) = {r["last_step"] for r in reports}
    for r in reports:
        assert r["preemption_save"] == PreemptionSave.SKIPPED, r
        assert r["preemption_budget_s"] == 0.0 and r["preemption_estimate_s"] > 0, r
        assert "no budget left" in r["preemption_reason"]
        started = gang.events(r["process_index"])
        assert not any(e.event == EventKind.SAVE_STARTED and e.step == stop for e in started)
    # No save of the agreed step was started: every committed step is an interval save from before the stop.
    assert stop not in committed_steps(store) and manifest(store, stop) is None
    assert all(s < stop and s % 5 == 0 for s in committed_steps(store)), (stop, committed_steps(store))
    # What the next attempt restores is a verified step, never a half-written one.
    chosen = restore_latest.run(store, 1).selection.step
    assert 5 <= chosen < stop and manifest(store, chosen) is not None and chosen in committed_steps(store)


def test_gang_on_the_gcs_emulator(gcs_emulator, tmp_path):
    root = f"gs://test-bucket/trainer-{int(time.time() * 1000)}"
    cfg = tiny_config(root, run_id="on-gcs", hosts=2, training={"total_steps": 6}, checkpoint={"interval_steps": 3})
    store = write_config(cfg)
    gang = launch(cfg, 0, -1, tmp_path, extra_env=gcs_emulator.env)
    assert gang.wait(180) == [0, 0], gang.tails()
    assert committed_steps(store) == [3, 6]
    assert manifest(store, 6).process_count == 2


def test_incompatible_restore_exits_3(reference, tmp_path):
    ref_cfg, ref_store, _ = reference
    cfg = tiny_config(ref_cfg.storage.root, run_id="reference", hosts=2, model={"d_model": 64})
    # A second config in the same run: the saved checkpoints were written with d_model 32 by 4 processes.
    store = RunStore(ref_cfg.storage.root, "reference")
    saved = store.read_json(RunLayout.CONFIG)
    write_config(cfg)
    try:
        gang = launch(cfg, 9, 20, tmp_path)
        assert gang.wait(120) == [ExitCode.INCOMPATIBLE_CHECKPOINT] * 2
        msg = read_report(store, 9, 0)["exception_message"]
        assert "model.d_model" in msg and "slice.hosts" in msg
    finally:
        store.write_json(RunLayout.CONFIG, saved)
    assert committed_steps(ref_store) == [5, 10, 15, 20]  # nothing moved or deleted


def test_process_count_mismatch_exits_2(tmp_path):
    cfg = tiny_config(str(tmp_path / "store"), run_id="mismatch", hosts=4)
    store = write_config(cfg)
    # Four workers are started but told the gang has two: 2 and 3 have no valid index, 0 and 1 form a
    # 2-process gang where the config expects 4.
    gang = launch(cfg, 0, -1, tmp_path, extra_env={"TRAINER_NUM_PROCESSES": "2"})
    assert gang.wait(120) == [ExitCode.CONFIGURATION] * N
    assert "slice.hosts" in read_report(store, 0, 0)["exception_message"]
    assert "JOB_COMPLETION_INDEX" in read_report(store, 0, 3)["exception_message"]


def test_a_gang_of_one_joins_no_coordinator_and_trains_checkpoints_and_exits_zero(tmp_path):
    """One host is a gang of one: no coordination service, no port bound (a TPU VM may allow no socket), and its
    checkpoints committed with their manifests as a gang's are."""
    cfg = tiny_config(str(tmp_path / "store"), run_id="one", hosts=1, training={"total_steps": 10})
    store = write_config(cfg)
    gang = launch(cfg, 0, -1, tmp_path)
    gang.wait_for(0, EventKind.STEP, 3)
    assert gang.listening() == set()
    assert gang.wait(120) == [0], gang.log(0)[-2000:]
    assert "a gang of one process: no coordinator joined" in gang.log(0)
    steps = committed_steps(store)
    assert steps and all(manifest(store, s) is not None for s in steps), steps
    assert read_report(store, 0, 0)["last_step"] == 10  # steps count from 1


@pytest.mark.parametrize(("at", "phase"), [(0, "in its start-up"), (3, "in native code while training")])
def test_a_native_crash_leaves_its_stacks_in_the_termination_message_and_is_classified_by_where_it_was(
    tmp_path, at, phase
):
    """A SIGSEGV writes no exit report: faulthandler's C handler leaves every thread's stack in the termination
    message, and classify-failure reads from it whether the worker was starting or training."""
    from jaxrec.model.names import TERMINATION_LOG_ENV
    from jaxrec.model.snapshot import ContainerState, NodeEvidence, PodEvidence
    from recovery_steps.classify import classify
    from recovery_steps.evidence import Evidence

    cfg = tiny_config(str(tmp_path / "store"), run_id=f"segv{at}", hosts=1, training={"total_steps": 6})
    store = write_config(cfg)
    trace = tmp_path / "termination-log"
    gang = launch(cfg, 0, -1, tmp_path, fault=f"native-crash@{at}", extra_env={TERMINATION_LOG_ENV: str(trace)})
    assert gang.wait(120) == [-signal.SIGSEGV]
    assert store.read_bytes(RunLayout.worker_report(0, 0)) is None  # no Python ran to write one
    text = trace.read_text()
    assert text.startswith("Fatal Python error: Segmentation fault"), text[:300]
    ended = ContainerState(name="trainer", state="terminated", exit_code=139, reason="Error", message=text)
    pod = PodEvidence(name="w-0", worker_index=0, node="local-0", phase="Failed", containers=[ended])
    node = NodeEvidence(name="local-0", ready=True, ready_reason="KubeletReady")
    v = classify(Evidence(backend="local", attempt=0, pods=[pod], nodes=[node]))
    assert v.failure_class == "infrastructure" and f"killed by SIGSEGV {phase}" in v.reason, v.reason


def test_injected_nan_exits_42(tmp_path):
    cfg = tiny_config(str(tmp_path / "store"), run_id="nan", hosts=2, training={"total_steps": 6})
    store = write_config(cfg)
    gang = launch(cfg, 0, -1, tmp_path, fault="nan@3")
    assert gang.wait(120) == [ExitCode.APPLICATION] * 2
    assert "non-finite loss" in read_report(store, 0, 1)["exception_message"]


def test_injected_hang_exits_21_by_the_watchdog(tmp_path):
    cfg = tiny_config(str(tmp_path / "store"), run_id="hang", hosts=2, training={"total_steps": 6, "hang_timeout_s": 3})
    store = write_config(cfg)
    gang = launch(cfg, 0, -1, tmp_path, fault="hang@3")
    codes = gang.wait(120)
    # Every process hangs; the first watchdog to fire exits 21, and a process whose own watchdog comes a few
    # milliseconds later may first see its peer gone (exit 20): both are the contract's answers.
    assert ExitCode.HANG in codes and set(codes) <= {ExitCode.HANG, ExitCode.PEER_LOST}, codes
    r = read_report(store, 0, codes.index(ExitCode.HANG))
    assert r["last_step"] == 2 and "no step completed" in r["exception_message"]


def test_every_process_of_a_restarted_gang_reads_the_compilation_cache(tmp_path):
    cfg = tiny_config(
        str(tmp_path / "store"),
        run_id="cache",
        hosts=2,
        share_compile_cache=False,
        training={"total_steps": 3, "compile_grace_s": 600},
        checkpoint={"interval_steps": 3},
    )
    store = write_config(cfg)
    for attempt in (0, 1):  # the same programs twice, the cache in its default place
        gang = launch(cfg, attempt, -1, tmp_path)
        assert gang.wait(240) == [0, 0], gang.tails()
    assert store.children(RunLayout.COMPILATION_CACHE)
    cold = [read_report(store, 0, i) for i in range(2)]
    warm = [read_report(store, 1, i) for i in range(2)]
    assert cold[0]["compile_cache_hits"] == 0 and cold[1]["compile_cache_requests"] > 0
    for r in warm:
        # Every program is a gang-wide one (no eager op on a process's own device, whose key would differ
        # per process and which only process 0 writes): every request hits.
        assert r["compile_cache_hits"] == r["compile_cache_requests"] >= 2, r
    assert warm[1]["compile_cache_hits"] > cold[1]["compile_cache_hits"]
