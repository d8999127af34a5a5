"""restore-latest against real orbax checkpoints, damaged in every way we know, on local disk and the GCS emulator."""

from __future__ import annotations

import json
import time

import pytest
from support.ckpt_factory import tiny_config, write_checkpoint, write_run_config

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.adapters.verify import GCS_COMMIT, LOCAL_METADATA
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import AttemptRecord, Ledger
from recovery_steps import restore_latest


@pytest.fixture
def run(store_root):
    cfg = tiny_config()
    store = RunStore(store_root, cfg.run_id)
    write_run_config(store, cfg)
    return store, cfg


def _file(store: RunStore, step: int, part: str = "state/") -> str:
    """The largest stored file of a step under ``part`` (an array data file)."""
    objs = [o for o in store.list(RunLayout.checkpoint(step)) if f"/{part}" in o.name and "/d/" in o.name]
    return max(objs, key=lambda o: o.size).name


def _quarantined(store: RunStore) -> list[str]:
    return store.children(RunLayout.QUARANTINE)


def _restore(store, attempt=1):
    return restore_latest.run(store, attempt)


# ---- damage, each applied to step 20 while step 10 is good ----------------------------------------


def no_commit_marker(store, cfg):
    write_checkpoint(store, cfg, 20)
    store.delete(f"checkpoints/20/{GCS_COMMIT if store.is_gcs else LOCAL_METADATA}")


def array_file_missing(store, cfg):
    write_checkpoint(store, cfg, 20)
    store.delete(_file(store, 20))


def truncated_file(store, cfg):
    write_checkpoint(store, cfg, 20)
    name = _file(store, 20)
    store.write_bytes(name, store.read_bytes(name)[:-100])


def flipped_bytes(store, cfg):
    write_checkpoint(store, cfg, 20)
    name = _file(store, 20)
    data = bytearray(store.read_bytes(name))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(name, bytes(data))


def manifest_missing(store, cfg):
    write_checkpoint(store, cfg, 20, manifest=False)


def manifest_garbled(store, cfg):
    write_checkpoint(store, cfg, 20)
    store.write_bytes(RunLayout.checkpoint_manifest(20), b'{"step": 20, "run_id": ')


def manifest_of_another_config(store, cfg):
    other = cfg.model_dump(mode="json")
    other["model"]["d_model"] = 128
    write_checkpoint(store, cfg, 20, config=other)


def another_process_count(store, cfg):
    write_checkpoint(store, cfg, 20, process_count=2)


def written_after_attempt_closed(store, cfg):
    closed = time.time() - 60
    ledger = Ledger(run_id=cfg.run_id, attempts=[AttemptRecord(attempt=1, outcome="failed", closed_at=closed)])
    store.write_json(RunLayout.LEDGER, ledger.model_dump(mode="json"))
    write_checkpoint(store, cfg, 20, attempt=1, wall_time=closed + 30)


CASES = {
    # damage: (reason fragment, quarantined on local, quarantined on gcs)
    no_commit_marker: ("never committed|not a finished orbax save", True, False),
    array_file_missing: ("is missing", True, True),
    truncated_file: ("bytes, the manifest says", True, True),
    flipped_bytes: ("CRC32C", True, True),
    manifest_missing: ("no manifest.json", True, True),
    manifest_garbled: ("manifest.json is unreadable", True, True),
    manifest_of_another_config: ("model.d_model: 128 -> 64", True, True),
    another_process_count: ("written by 2 processes, the slice has 4", True, True),
    written_after_attempt_closed: ("after the ledger closed that attempt", True, True),
}


@pytest.mark.parametrize("damage", list(CASES), ids=lambda f: f.__name__)
def test_falls_back_to_newest_good_checkpoint(run, damage):
    import re

    store, cfg = run
    write_checkpoint(store, cfg, 10)
    damage(store, cfg)
    fragment, q_local, q_gcs = CASES[damage]

    r = _restore(store)

    assert r.code == ExitCode.OK
    assert r.selection.step == 10
    assert r.restore_path == store.url("checkpoints/10")
    [skip] = r.selection.skipped
    assert skip.step == 20
    assert re.search(fragment, skip.reason), skip.reason
    quarantined = q_gcs if store.is_gcs else q_local
    assert ("20" in _quarantined(store)) is quarantined
    assert store.exists("checkpoints/20") is not quarantined
    if quarantined:
        reason = store.read_json(RunLayout.quarantine_reason("quarantine/20"))
        assert reason["step"] == 20 and reason["reason"] == skip.reason and reason["attempt"] == 1
    record = store.read_json(RunLayout.restore_record(1))
    assert record["restore_step"] == 10
    assert record["skipped"][0]["step"] == 20


def test_leftover_temporary_and_empty_directories_are_skipped(run):
    store, cfg = run
    write_checkpoint(store, cfg, 10)
    store.write_bytes("checkpoints/30.orbax-checkpoint-tmp-1732900000/state/_METADATA", b"{}")
    if store.is_gcs:
        store.write_bytes("checkpoints/20/", b"")  # the folder placeholder some tools create
    else:
        (__import__("pathlib").Path(store.url("checkpoints")) / "20").mkdir()

    r = _restore(store)

    assert r.code == ExitCode.OK and r.selection.step == 10
    assert [(s.name, s.kind.value) for s in r.selection.skipped] == [
        ("30.orbax-checkpoint-tmp-1732900000", "temporary"),
        ("20", "empty"),
    ]
    # A temporary directory may belong to a save still in progress: it stays where orbax expects it.
    assert store.exists("checkpoints/30.orbax-checkpoint-tmp-1732900000/state/_METADATA")
    assert "30.orbax-checkpoint-tmp-1732900000" not in _quarantined(store)


def test_skips_every_newer_bad_one_in_order_and_restores_real_data(run):
    store, cfg = run
    state10 = write_checkpoint(store, cfg, 10)
    write_checkpoint(store, cfg, 20, manifest=False)
    flipped_bytes(store, cfg)  # rewrites step 20 (with a manifest) and damages it
    write_checkpoint(store, cfg, 30, process_count=8)

    r = _restore(store)

    assert r.selection.step == 10
    assert [s.step for s in r.selection.skipped] == [30, 20]
    assert sorted(_quarantined(store)) == ["20", "30"]

    import numpy as np
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(store.url(RunLayout.CHECKPOINTS)) as mgr:
        assert mgr.all_steps() == [10]
        got = mgr.restore(10, args=ocp.args.Composite(state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
    np.testing.assert_array_equal(got["state"]["params"]["w"], state10["params"]["w"])
    assert got["data"] == {"position": 160}


def test_quarantining_the_same_step_twice_keeps_both(run):
    store, cfg = run
    for attempt in (1, 2):
        write_checkpoint(store, cfg, 20, manifest=False)
        r = _restore(store, attempt)
        assert r.selection.step == -1
    names = _quarantined(store)
    assert "20" in names and any(n.startswith("20.attempt2") for n in names)


def test_no_checkpoints_is_a_fresh_start(run):
    store, _ = run
    r = _restore(store)
    assert (r.code, r.selection.step, r.selection.skipped, r.restore_path) == (ExitCode.OK, -1, [], "")


def test_only_damaged_checkpoints_is_a_fresh_start_with_reasons(run):
    store, cfg = run
    write_checkpoint(store, cfg, 10)
    array_file_missing(store, cfg)
    store.delete(_file(store, 10))
    r = _restore(store)
    assert r.code == ExitCode.OK and r.selection.step == -1
    assert [s.step for s in r.selection.skipped] == [20, 10]
    assert sorted(_quarantined(store)) == ["10", "20"]


def test_only_incompatible_checkpoints_stop_with_exit_3_and_move_nothing(run):
    store, cfg = run
    other = cfg.model_dump(mode="json")
    other["data"]["global_batch_size"] = 32
    write_checkpoint(store, cfg, 10, config=other)

    r = _restore(store)

    assert r.code == ExitCode.INCOMPATIBLE_CHECKPOINT
    assert "data.global_batch_size: 32 -> 16" in r.message
    assert store.exists("checkpoints/10") and _quarantined(store) == []


def test_cli_writes_outputs_and_exit_codes(run, tmp_path, capsys):
    store, cfg = run
    write_checkpoint(store, cfg, 10)
    manifest_missing(store, cfg)
    out = tmp_path / "out"
    argv = ["--store-root", store.root, "--run-id", cfg.run_id, "--attempt", "3", "--output-dir", str(out)]

    assert restore_latest.main(argv) == 0

    assert (out / "restore-step").read_text() == "10"
    assert (out / "restore-path").read_text() == store.url("checkpoints/10")
    skipped = json.loads((out / "skipped").read_text())
    assert [s["step"] for s in skipped] == [20] and "manifest" in skipped[0]["reason"]
    assert store.read_json(RunLayout.restore_record(3))["restore_step"] == 10


def test_cli_without_config_exits_2_without_traceback(store_root, tmp_path, capsys):
    argv = ["--store-root", store_root, "--run-id", "nothing-here", "--attempt", "0", "--output-dir", str(tmp_path)]
    assert restore_latest.main(argv) == ExitCode.CONFIGURATION
    err = capsys.readouterr().err
    assert "no config for run 'nothing-here'" in err and "validate-config" in err and "Traceback" not in err


# ---- integrity from metadata: what the manifest pins and how restore-latest checks it --------------


def test_manifest_pins_what_the_store_holds(run):
    """Each entry is the file's size and CRC32C (and its GCS generation), whoever computed them."""
    from jaxrec.adapters.checkpoints import crc32c_hex
    from jaxrec.model.records import CheckpointManifest

    store, cfg = run
    write_checkpoint(store, cfg, 10, floats=300_000)  # an array file over CRC_CHUNK: streamed in pieces locally
    manifest = store.read_record(RunLayout.checkpoint_manifest(10), CheckpointManifest)
    listed = {o.name.removeprefix("checkpoints/10/"): o for o in store.list(RunLayout.checkpoint(10))}
    assert {f.path for f in manifest.files} == set(listed) - {RunLayout.MANIFEST}
    for f in manifest.files:
        data = store.read_bytes(f"checkpoints/10/{f.path}")
        assert (f.size, f.crc32c) == (len(data), crc32c_hex(data)), f.path
        assert f.generation == (listed[f.path].generation if store.is_gcs else None)
    assert max(f.size for f in manifest.files) > (1 << 20)


def test_same_bytes_rewritten_on_gcs_are_not_the_committed_object(run):
    """A copy with the same size and CRC32C (another step's file, a rewrite) fails by its generation on GCS."""
    store, cfg = run
    write_checkpoint(store, cfg, 10)
    write_checkpoint(store, cfg, 20)
    name = _file(store, 20)
    store.write_bytes(name, store.read_bytes(name))  # same bytes, a new object
    r = _restore(store)
    if store.is_gcs:
        assert r.selection.step == 10
        [skip] = r.selection.skipped
        assert "generation" in skip.reason and "rewritten or replaced" in skip.reason
    else:
        assert r.selection.step == 20  # locally the bytes are what is checked


def test_manifest_without_generations_still_verifies_and_says_so(run, caplog):
    """A manifest written before generations were recorded verifies by size and CRC32C, and the log says so."""
    from jaxrec.model.records import CheckpointManifest

    store, cfg = run
    write_checkpoint(store, cfg, 10)
    rel = RunLayout.checkpoint_manifest(10)
    m = store.read_record(rel, CheckpointManifest)
    old = m.model_dump(mode="json", by_alias=True)
    for f in old["files"]:
        del f["generation"]
    store.write_json(rel, old)
    with caplog.at_level("INFO", logger="jaxrec.adapters.restore"):
        r = _restore(store)
    assert r.selection.step == 10 and not r.selection.skipped
    if store.is_gcs:
        assert "records no generations" in caplog.text and "no bytes read" in caplog.text
    else:
        assert "streamed" in caplog.text


def test_step_beyond_total_steps_is_refused(run):
    store, cfg = run
    write_checkpoint(store, cfg, 10)
    write_checkpoint(store, cfg, cfg.training.total_steps + 10)
    r = _restore(store)
    assert r.selection.step == 10
    [skip] = r.selection.skipped
    assert f"beyond training.total_steps {cfg.training.total_steps}" in skip.reason


def test_workers_check_of_a_restored_step_finds_what_changed_after_restore_latest(run):
    """``verify.part_problems``, what each worker runs on the step it just read: the gang finds a rewritten or
    flipped file between them (locally each process streams its share; on GCS process 0 compares one listing)."""
    from jaxrec.adapters import verify
    from jaxrec.model.records import CheckpointManifest

    store, cfg = run
    write_checkpoint(store, cfg, 10, floats=5000)
    manifest = store.read_record(RunLayout.checkpoint_manifest(10), CheckpointManifest)
    parts = 3
    shares = [verify.share_of(manifest.files, i, parts) for i in range(parts)]
    assert sorted(f.path for s in shares for f in s) == sorted(f.path for f in manifest.files)  # each file once
    loads = [sum(f.size for f in s) for s in shares]
    total, largest = sum(loads), max(f.size for f in manifest.files)
    assert max(loads) <= max(total / parts, largest) + largest, loads  # balanced by bytes (greedy bound)
    assert [verify.part_problems(store, "10", manifest, i, parts) for i in range(parts)] == [[], [], []]

    name = _file(store, 10)
    data = bytearray(store.read_bytes(name))
    if store.is_gcs:
        store.write_bytes(name, bytes(data))  # the same bytes, another object: not the one the manifest pinned
    else:
        data[len(data) // 2] ^= 0x01
        store.write_bytes(name, bytes(data))
    found = [verify.part_problems(store, "10", manifest, i, parts) for i in range(parts)]
    rel = name.split("checkpoints/10/", 1)[1]
    assert sum(1 for p in found if p) == 1, found  # one process's share (process 0's listing on GCS) finds it
    (problem,) = next(p for p in found if p)
    assert rel in problem and ("generation" in problem if store.is_gcs else "CRC32C" in problem), problem
