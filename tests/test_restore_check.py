"""Bytes are checked where they are read: a byte flipped after restore-latest passed is found by the workers."""

from __future__ import annotations

import hashlib
import shutil

import pytest
from support.trainer_harness import launch, read_report, tiny_config, write_config

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import CheckpointManifest, EventKind, QuarantineReason, RestoreRecord
from recovery_steps import restore_latest

pytestmark = pytest.mark.slow

N = 2


def _digests(store: RunStore, attempt: int) -> set[str]:
    return {read_report(store, attempt, i)["params_digest"] for i in range(N)}


def test_a_byte_flipped_after_restore_latest_is_found_by_the_workers_and_the_attempt_falls_back(tmp_path):
    # A generous compile grace: the first compile of a loaded shared machine can take minutes.
    cfg = tiny_config(str(tmp_path / "store"), run_id="flipped", hosts=N, training={"compile_grace_s": 600})
    store = write_config(cfg)
    gang = launch(cfg, 0, -1, tmp_path / "ref")
    assert gang.wait(300) == [0] * N, gang.log(0)[-3000:]
    (want,) = _digests(store, 0)  # the uninterrupted run's parameters
    # Each process streamed the files it wrote (process 1: its iterator state and array metadata) and process 0
    # gathered them: it streamed none of another's files itself, and every entry pins the bytes on disk.
    assert "no process reported" not in gang.log(0), gang.log(0)[-2000:]
    run = tmp_path / "store" / "runs" / cfg.run_id
    m = CheckpointManifest.model_validate_json((run / "checkpoints" / "20" / "manifest.json").read_text())
    assert "data/process_1-of-2.json" in {f.path for f in m.files}
    for f in m.files:
        assert f.sha256 == hashlib.sha256((run / "checkpoints" / "20" / f.path).read_bytes()).hexdigest(), f.path

    # The run as it stood after step 10 was saved: steps 15 and 20 never happened.
    for s in (15, 20):
        shutil.rmtree(run / "checkpoints" / str(s))
    decided = restore_latest.run(store, 1)
    assert decided.selection.step == 10 and decided.selection.skipped == []

    # After restore-latest passed step 10 and before the workers read it: one byte of array data flips.
    values = max((run / "checkpoints" / "10" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    data = bytearray(values.read_bytes())
    data[len(data) // 2] ^= 0x01
    values.write_bytes(bytes(data))

    gang = launch(cfg, 1, 10, tmp_path / "resume")
    assert gang.wait(300) == [0] * N, gang.log(0)[-3000:]
    for i in range(N):
        assert [e.restore_step for e in gang.events(i) if e.event == EventKind.RESTORED] == [5]
        assert read_report(store, 1, i)["restore_step"] == 5
    assert _digests(store, 1) == {want}  # trained on from step 5 to the same parameters
    reason = store.read_record(RunLayout.quarantine_reason("quarantine/10"), QuarantineReason)
    assert reason is not None and reason.attempt == 1 and "found by the workers while restoring" in reason.reason
    assert str(values.relative_to(run / "checkpoints" / "10")) in reason.reason
    record = store.read_record(RunLayout.restore_record(1), RestoreRecord)
    assert record.restore_step == 5 and "quarantine/10" in record.quarantined
    assert [s.step for s in record.skipped] == [10]
