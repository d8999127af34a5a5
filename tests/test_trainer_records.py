"""Record files on gs:// read by a real gang: the local copy, the fingerprint, resumed order, changed files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.trainer_harness import launch, read_report, tiny_config, write_config

from jaxrec.adapters.store import RunLayout, RunStore, make_gcs_client
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import CheckpointManifest, EventKind
from trainer import records, write_records

pytestmark = pytest.mark.slow

HOSTS = 2
TOTAL = 6
INTERVAL = 3


def _manifest(store: RunStore, step: int) -> CheckpointManifest:
    m = store.read_record(RunLayout.checkpoint_manifest(step), CheckpointManifest)
    assert m is not None, step
    return m


def _listing_fingerprint(client, bucket: str, prefix: str) -> str:
    """The dataset version of the objects under ``prefix``, from the bucket's own listing (name, size, generation)."""
    blobs = sorted(client.list_blobs(bucket, prefix=prefix + "/"), key=lambda b: b.name)
    assert blobs
    files = [records.RecordFile(f"gs://{bucket}/{b.name}", b.size, f"{b.generation}:{b.crc32c}", "") for b in blobs]
    return records.fingerprint(files)


def _cached(cache: Path) -> dict[str, int]:
    """The files the workers copied into ``TRAINER_DATA_CACHE``: name -> modification time (ns)."""
    return {p.name: p.stat().st_mtime_ns for p in (cache / "jaxrec-data").rglob("*") if p.is_file()}


def _digests(store: RunStore, attempt: int) -> set[str]:
    return {read_report(store, attempt, i)["params_digest"] for i in range(HOSTS)}


def _restored(gang) -> list[int]:
    return [e.step for e in gang.events(0) if e.event == EventKind.RESTORED]


def test_gcs_record_files_are_cached_fingerprinted_resumed_in_order_and_checked_when_changed(gcs_emulator, tmp_path):
    bucket, prefix = "test-bucket", f"records-{int(time.time() * 1000)}"
    client = make_gcs_client()

    # The dataset, written by the project's own writer from the lm task's generated examples, then uploaded.
    writer = tiny_config(str(tmp_path / "unused"), run_id="writer", hosts=HOSTS)
    (tmp_path / "writer.yaml").write_text(json.dumps(writer.model_dump(mode="json")))
    written = [Path(p) for p in write_records.run(str(tmp_path / "writer.yaml"), str(tmp_path / "out"), 3, 64)]
    for p in written:
        client.bucket(bucket).blob(f"{prefix}/{p.name}").upload_from_filename(str(p))
    version = _listing_fingerprint(client, bucket, prefix)

    cache = tmp_path / "cache"
    env = {**gcs_emulator.env, "TRAINER_DATA_CACHE": str(cache)}
    data = {"dataset": "records", "files": f"gs://{bucket}/{prefix}/*.array_record"}
    sections = {"data": data, "training": {"total_steps": TOTAL}, "checkpoint": {"interval_steps": INTERVAL}}
    cfg = tiny_config(str(tmp_path / "store"), run_id="gcs-records", hosts=HOSTS, **sections)
    store = write_config(cfg)

    # Uninterrupted: every worker reads the files through the cache; each checkpoint records the listing.
    gang = launch(cfg, 0, -1, tmp_path, extra_env=env)
    assert gang.wait(240) == [0] * HOSTS, gang.log(0)[-3000:]
    (want,) = _digests(store, 0)
    copies = _cached(cache)
    assert sorted(n.split(".array_record")[0] for n in copies) == sorted(p.stem for p in written)
    for p in written:
        (copy,) = (cache / "jaxrec-data" / bucket / prefix).glob(p.name + ".g*")
        assert copy.read_bytes() == p.read_bytes()
    assert [_manifest(store, s).dataset_version for s in (INTERVAL, TOTAL)] == [version, version]

    # Resumed from the first checkpoint: the same batches in the same order (same final parameters),
    # read from the copies already made (none fetched again).
    gang = launch(cfg, 1, INTERVAL, tmp_path, extra_env=env)
    assert gang.wait(240) == [0] * HOSTS, gang.log(0)[-3000:]
    assert _restored(gang) == [INTERVAL]
    assert _digests(store, 1) == {want}
    assert _cached(cache) == copies

    # One file more: the saved data position points into other data.
    client.bucket(bucket).blob(f"{prefix}/part-extra.array_record").upload_from_filename(str(written[0]))
    changed = _listing_fingerprint(client, bucket, prefix)
    assert changed != version

    # exact: refused, every worker exit 3, one line naming both versions, data.resume_mode and the fix.
    gang = launch(cfg, 2, TOTAL, tmp_path, extra_env=env)
    assert gang.wait(240) == [ExitCode.INCOMPATIBLE_CHECKPOINT] * HOSTS, gang.log(0)[-3000:]
    for i in range(HOSTS):
        msg = read_report(store, 2, i)["exception_message"]
        assert "\n" not in msg and version in msg and changed in msg, msg
        assert "data.resume_mode: reshuffle" in msg and "restore the files" in msg, msg
    assert store.checkpoint_steps() == [INTERVAL, TOTAL]  # nothing moved by a refused attempt

    # reshuffle (a safe config change): restores, trains on over the new files, and records their version.
    cfg = tiny_config(
        str(tmp_path / "store"),
        run_id="gcs-records",
        hosts=HOSTS,
        **{**sections, "data": {**data, "resume_mode": "reshuffle"}},
    )
    write_config(cfg)
    gang = launch(cfg, 3, INTERVAL, tmp_path, extra_env=env)
    assert gang.wait(240) == [0] * HOSTS, gang.log(0)[-3000:]
    assert _restored(gang) == [INTERVAL]
    assert all(read_report(store, 3, i)["last_step"] == TOTAL for i in range(HOSTS))
    m = _manifest(store, TOTAL)
    assert (m.attempt, m.dataset_version) == (3, changed)
    assert _manifest(store, INTERVAL).dataset_version == version
    assert _digests(store, 3) != {want}  # a new order over other data
