"""Local-directory integrity: per-host digests gathered into the manifest, SHA-256 pins, orbax's metadata, bounds."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import google_crc32c
import pytest
from support.ckpt_factory import tiny_config, write_checkpoint, write_run_config

from jaxrec.adapters import checkpoints, verify
from jaxrec.adapters.checkpoints import gather_files, host_files, step_files, writer_of
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import CheckpointManifest
from recovery_steps import restore_latest


@pytest.fixture
def run(tmp_path):
    cfg = tiny_config()
    store = RunStore(str(tmp_path), cfg.run_id)
    write_run_config(store, cfg)
    for s in (10, 20):
        write_checkpoint(store, cfg, s, floats=300)
    return store, cfg, Path(store.url(RunLayout.CHECKPOINTS))


def _manifest(step_dir: Path) -> CheckpointManifest:
    return CheckpointManifest.model_validate_json((step_dir / "manifest.json").read_text())


def _rewrite_manifest(store: RunStore, step: int) -> None:
    """The manifest of ``step`` as the trainer would write it over the files there now."""
    m = _manifest(Path(store.url(RunLayout.checkpoint(step))))
    store.write_record(RunLayout.checkpoint_manifest(step), m.model_copy(update={"files": step_files(store, step)}))


@pytest.mark.parametrize(
    ("path", "writer"),
    [
        ("state/ocdbt.process_3/d/abc", 3),
        ("state/ocdbt.process_12/manifest.ocdbt", 12),
        ("state/array_metadatas/process_5", 5),
        ("data/process_7-of-8.json", 7),
        ("state/d/abc", 0),
        ("state/manifest.ocdbt", 0),
        ("_CHECKPOINT_METADATA", 0),
        ("state/_METADATA", 0),
    ],
)
def test_each_file_is_summed_by_the_process_that_wrote_it(path, writer):
    assert writer_of(path) == writer


def test_local_manifest_pins_every_file_by_crc32c_and_sha256(run):
    store, _, ck = run
    m = _manifest(ck / "20")
    assert m.files and all(f.sha256 and len(f.sha256) == 64 and f.generation is None for f in m.files)
    on_disk = {str(p.relative_to(ck / "20")) for p in (ck / "20").rglob("*") if p.is_file()}
    assert {f.path for f in m.files} == on_disk - {"manifest.json", ".manifest.json.lock"}
    assert "SHA-256" in verify.integrity_basis(m, on_gcs=False)


def test_hosts_reports_are_gathered_and_a_missing_report_is_streamed_by_the_primary(run):
    store, _, ck = run
    everything = step_files(store, 20)
    own = host_files(store, 20, 0)
    assert own == everything  # one process wrote every file of this step
    assert host_files(store, 20, 1) == []
    half = {f.path: f for f in own[: len(own) // 2]}
    files, streamed = gather_files(store, 20, half)
    assert files == everything and sorted(streamed) == sorted(f.path for f in own[len(own) // 2 :])
    # A report of another size than the file has now is not taken.
    stale = {f.path: f.model_copy(update={"size": f.size + 1}) for f in own}
    assert gather_files(store, 20, stale)[0] == everything


def _crc_tailed(n: int) -> bytes:
    """``n`` bytes that end with the CRC32C of the bytes before them, as every OCDBT node and manifest file does."""
    body = os.urandom(n - 4)
    return body + struct.pack("<I", google_crc32c.value(body))


def test_a_file_with_the_same_size_and_crc32c_but_other_bytes_is_refused(run):
    store, _, ck = run
    node = ck / "20" / "state" / "manifest.ocdbt"
    before = node.read_bytes()
    forged = _crc_tailed(len(before))
    assert forged != before
    assert google_crc32c.value(forged) == google_crc32c.value(before)  # CRC32C alone cannot tell them apart
    node.write_bytes(forged)
    r = restore_latest.run(store, 1)
    assert r.selection.step == 10
    (skip,) = r.selection.skipped
    assert skip.name == "20" and "SHA-256" in skip.reason and "state/manifest.ocdbt" in skip.reason


def test_an_ocdbt_root_that_reads_a_file_the_step_lacks_is_refused(run):
    store, _, ck = run
    data = max((p for p in (ck / "20" / "state").rglob("d/*")), key=lambda p: p.stat().st_size)
    data.unlink()
    _rewrite_manifest(store, 20)  # a manifest written over what is there: closed-world checks pass
    r = restore_latest.run(store, 1)
    assert r.selection.step == 10
    assert "which the manifest does not list" in r.selection.skipped[0].reason, r.selection.skipped[0].reason


def _iterator_state(store: RunStore, step: int, positions: dict[int, int], count: int) -> None:
    d = Path(store.url(RunLayout.checkpoint(step))) / "data"
    for i, at in positions.items():
        (d / f"process_{i}-of-{count}.json").write_text(json.dumps({"next_index": at}))


@pytest.mark.parametrize(
    ("positions", "count", "expected"),
    [
        (dict.fromkeys(range(4), 20), 4, None),
        (dict.fromkeys(range(4), 7), 4, None),
        (dict.fromkeys(range(4), 21), 4, "beyond step 20"),
        (dict.fromkeys(range(3), 20), 4, "state of 3 of 4 processes"),
        ({0: 20, 1: 20}, 2, "of a 2-process gang"),
    ],
)
def test_the_data_iterator_position_must_agree_with_the_step(run, positions, count, expected):
    store, _, _ = run
    _iterator_state(store, 20, positions, count)
    _rewrite_manifest(store, 20)
    r = restore_latest.run(store, 1)
    if expected is None:
        assert r.selection.step == 20, r.selection.skipped
    else:
        assert r.selection.step == 10 and expected in r.selection.skipped[0].reason, r.selection.skipped


def test_processes_at_different_batches_are_refused(run):
    store, _, _ = run
    m = _manifest(Path(store.url(RunLayout.checkpoint(20))))
    _iterator_state(store, 20, {0: 20, 1: 19}, 2)
    store.write_record(
        RunLayout.checkpoint_manifest(20), m.model_copy(update={"files": step_files(store, 20), "process_count": 2})
    )
    problems = verify.metadata_problems(store, "20", _manifest(Path(store.url(RunLayout.checkpoint(20)))))
    assert problems and "different batches [19, 20]" in problems[0]
    for old in Path(store.url(RunLayout.checkpoint(20))).glob("data/process_*"):
        old.unlink()
    _iterator_state(store, 20, {0: 20}, 3)
    store.write_record(
        RunLayout.checkpoint_manifest(20), m.model_copy(update={"files": step_files(store, 20), "process_count": 3})
    )
    problems = verify.metadata_problems(store, "20", _manifest(Path(store.url(RunLayout.checkpoint(20)))))
    assert problems and "of 3 processes" in problems[0]


def test_a_manifest_beyond_the_bound_is_refused_and_never_written(run, monkeypatch):
    store, _, ck = run
    bound = len(_manifest(ck / "10").files)  # OCDBT's file count varies from save to save
    for i in range(bound + 1 - len(_manifest(ck / "20").files)):
        (ck / "20" / "state" / f"extra{i}").write_bytes(b"x")
    _rewrite_manifest(store, 20)  # step 20 has more files than step 10
    n = len(_manifest(ck / "20").files)
    assert n > bound
    monkeypatch.setattr(checkpoints, "MAX_MANIFEST_FILES", bound)
    monkeypatch.setattr(verify, "MAX_MANIFEST_FILES", bound)
    r = restore_latest.run(store, 1)
    assert r.selection.step == 10 and f"lists {n} files, more than the {bound}" in r.selection.skipped[0].reason
    monkeypatch.setattr(checkpoints, "MAX_MANIFEST_FILES", 1)
    m = _manifest(ck / "10").model_copy(update={"files": []})
    (ck / "10" / "manifest.json").unlink()
    with pytest.raises(checkpoints.TooManyFiles, match="OCDBT"):
        checkpoints.write_manifest(store, m)
    assert not (ck / "10" / "manifest.json").exists()


def test_verification_of_a_manifest_of_many_entries_names_each_problem_once(run):
    """At 80,000 entries (OCDBT's bound is far below: this is the in-memory part alone) a missing file, a resized
    one and one the manifest does not list are each named once, and nothing else. How the time grows with the
    entries is measured side by side by ``bench/bench_integrity.py --entries``."""
    from jaxrec.adapters.store import ObjectInfo
    from jaxrec.model.records import ManifestFile

    files = [ManifestFile(path=f"state/d/{i:08x}", size=1, crc32c="00000000") for i in range(80_000)]
    objs = [ObjectInfo(f.path, 1, 1, "00000000") for f in files]
    objs[7] = ObjectInfo(objs[7].name, 2, 1, "00000000")
    del objs[70_000]
    objs.append(ObjectInfo("state/d/extra", 1, 1, "00000000"))
    m = _manifest(Path(run[0].url(RunLayout.checkpoint(20)))).model_copy(update={"files": files})
    assert verify.file_problems(run[0], "20", m, objs) == [
        "state/d/extra is not in the manifest (an unverified file)",
        "state/d/00000007 has 2 bytes, the manifest says 1",
        f"state/d/{70_000:08x} is missing",
    ]


def test_no_manifest_is_written_for_a_step_moved_to_quarantine_before_it(run):
    """A straggler's manifest (a worker of an attempt whose gang was already counted gone) for a step restore-latest
    moved away meanwhile: nothing is written, so no manifest lands alone where the next attempt saves that step."""
    store, _, ck = run
    m = _manifest(ck / "20")
    (ck / "20" / "manifest.json").unlink()
    store.move("checkpoints/20", "quarantine/20")
    with pytest.raises(checkpoints.StepGone, match="checkpoint 20 was moved away"):
        checkpoints.write_manifest(store, m)
    assert not (ck / "20").exists()


def test_a_manifest_file_beyond_the_byte_bound_is_refused_unread(run, monkeypatch):
    store, _, ck = run
    bound = min((ck / s / "manifest.json").stat().st_size for s in ("10", "20")) - 1
    monkeypatch.setattr(verify, "MAX_MANIFEST_BYTES", bound)
    monkeypatch.setattr(verify, "read_manifest", lambda *a: pytest.fail("a manifest over the bound was read"))
    r = restore_latest.run(store, 1)
    assert r.selection.step == -1  # both steps' manifests are over the bound here
    assert {s.name for s in r.selection.skipped} == {"10", "20"}
    for s in r.selection.skipped:
        size = (ck.parent / "quarantine" / s.name / "manifest.json").stat().st_size
        assert f"manifest.json has {size} bytes, more than {bound}" in s.reason, s.reason
