"""The task interface without JAX: resolving task.name, task options, compatibility, record files."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.trainer_harness import REPO

from jaxrec.model.compat import check_compatible
from jaxrec.model.config import ConfigError, parse_config
from jaxrec.model.records import CheckpointManifest
from trainer.decisions import task_problems

BASE = {"run_id": "t", "image": "i:1", "slice": {"accelerator": "local", "hosts": 2}, "storage": {"root": "/tmp/s"}}
CLASSIFIER = "examples.image_classifier.task:TASK"


def _cfg(**sections):
    return parse_config({**BASE, **sections})


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        ({"name": CLASSIFIER, "options": {"channels": 0}}, "task.options.channels: Input should be greater than"),
        ({"name": CLASSIFIER, "options": {"chanels": 8}}, "task.options.chanels: unknown option; valid options:"),
        ({"name": CLASSIFIER, "options": {"image_size": 9}}, "task.options: image_size: 9 is odd"),
        ({"name": "examples.nothing:TASK"}, "task.name: cannot import 'examples.nothing'"),
        ({"name": "examples.image_classifier.task:Options"}, "is ModelMetaclass, not a TaskSpec"),
        ({"name": "lm", "options": {"d_model": 8}}, "task.options: the built-in lm task reads its options from"),
    ],
)
def test_bad_task_gets_one_line_naming_the_field(task, expected):
    with pytest.raises(ConfigError) as e:
        _cfg(task=task)
    assert len(e.value.problems) == 1 and expected in e.value.problems[0], e.value.problems


def test_user_task_options_are_validated_and_filled_in():
    cfg = _cfg(task={"name": CLASSIFIER, "options": {"channels": 4}})
    assert cfg.task.options == {"image_size": 8, "num_classes": 4, "channels": 4, "noise": 0.3, "label_smoothing": 0.0}
    assert cfg.task_options().channels == 4
    with pytest.raises(ConfigError) as e:
        _cfg(task={"name": CLASSIFIER}, model={"d_model": 32})
    assert "model: the options of the built-in lm task" in e.value.problems[0]


def test_validate_config_of_a_user_task_does_not_import_jax():
    code = (
        "import sys; from jaxrec.model.config import load_config; "
        "c = load_config('configs/local-image-classifier.yaml'); c.task_options(); "
        "print('jax' in sys.modules, 'flax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_compatibility_refuses_another_task_and_unsafe_options_and_accepts_declared_safe_ones():
    a = _cfg(task={"name": CLASSIFIER}).model_dump(mode="json")
    lm = _cfg().model_dump(mode="json")
    safe = _cfg(task={"name": CLASSIFIER, "options": {"label_smoothing": 0.1}}).model_dump(mode="json")
    wider = _cfg(task={"name": CLASSIFIER, "options": {"channels": 16}}).model_dump(mode="json")
    assert check_compatible(a, safe) == []
    assert [p.render() for p in check_compatible(a, wider)] == [
        "task.options.channels: 8 -> 16 (incompatible: the task's options may shape its state; a task declares "
        "the options that are safe to change (TaskSpec.safe_options))"
    ]
    assert "task.name: 'examples.image_classifier.task:TASK' -> 'lm'" in [
        p.change.render() for p in check_compatible(a, lm)
    ]


def _manifest(**kw) -> CheckpointManifest:
    base = dict(
        step=5,
        run_id="t",
        attempt=0,
        config_hash="h",
        config={},
        code_version="c",
        dataset_version="files-aaaa",
        task_name="lm",
        task_version="1",
        process_count=2,
        mesh_shape={"data": 2},
        library_versions={},
        wall_time=0.0,
    )
    return CheckpointManifest(**{**base, **kw})


@pytest.mark.parametrize(
    ("saved", "now", "mode", "expected"),
    [
        ({}, ("lm", "1", "files-aaaa"), "exact", []),
        ({}, ("lm", "2", "files-aaaa"), "exact", ["task version: '1' -> '2'"]),
        ({}, ("image-classifier", "1", "files-aaaa"), "exact", ["task: checkpoint of task 'lm'"]),
        ({}, ("lm", "1", "files-bbbb"), "exact", ["data: dataset version 'files-aaaa' -> 'files-bbbb'"]),
        ({}, ("lm", "1", "files-bbbb"), "reshuffle", []),  # a new order over the new files
    ],
)
def test_task_problems_table(saved, now, mode, expected):
    got = task_problems(_manifest(**saved), *now, mode)
    assert len(got) == len(expected) and all(g.startswith(e) for g, e in zip(got, expected, strict=True)), got


def test_record_files_round_trip_in_order_and_fingerprint_tracks_contents(tmp_path):
    import numpy as np

    from trainer import records

    examples = [{"x": np.full((3,), i, np.float32), "y": np.asarray(i, np.int32)} for i in range(10)]
    records.write_records(examples, tmp_path / "d", num_files=3)
    files = records.list_files(str(tmp_path / "d"))
    ds = records.record_dataset(files)
    assert len(ds) == 10 and [int(ds[i]["y"]) for i in range(10)] == list(range(10))
    assert np.array_equal(ds[7]["x"], examples[7]["x"])
    before = records.fingerprint(files)
    assert before == records.fingerprint(records.list_files(str(tmp_path / "d" / "*.array_record")))
    records.write_records(examples[:9], tmp_path / "d", num_files=3)  # the files are rewritten with less
    assert records.fingerprint(records.list_files(str(tmp_path / "d"))) != before
    with pytest.raises(records.DataFilesError, match="data.files: .* matches no file"):
        records.list_files(str(tmp_path / "empty" / "*.array_record"))


def test_records_dataset_needs_files_and_only_then():
    with pytest.raises(ConfigError, match="data.files: required for dataset 'records'"):
        _cfg(data={"dataset": "records"})
    with pytest.raises(ConfigError, match="data.files: only read with dataset: records"):
        _cfg(data={"files": "/tmp/x"})


def test_gcs_record_files_are_listed_one_level_deep_copied_by_generation_and_fingerprinted(
    gcs_emulator, tmp_path, monkeypatch
):
    import time
    from pathlib import Path

    import numpy as np

    from jaxrec.adapters.store import make_gcs_client
    from trainer import records

    examples = [np.full((2,), i, np.int32) for i in range(6)]
    local = records.write_records(examples, tmp_path / "d", num_files=2)
    bucket, prefix = "test-bucket", f"listing-{int(time.time() * 1000)}"
    b = make_gcs_client().bucket(bucket)
    for p in local:
        b.blob(f"{prefix}/{p.name}").upload_from_filename(str(p))
    # An older copy one level down: a gs:// glob's '*' stops at '/', as a local glob's does (and gcloud storage's).
    b.blob(f"{prefix}/old/{local[0].name}").upload_from_filename(str(local[0]))
    monkeypatch.setenv("TRAINER_DATA_CACHE", str(tmp_path / "cache"))
    files = records.list_files(f"gs://{bucket}/{prefix}/*.array_record")
    assert [f.name for f in files] == [f"gs://{bucket}/{prefix}/{p.name}" for p in local]
    assert [f.name for f in records.list_files(f"gs://{bucket}/{prefix}/")] == [f.name for f in files]
    assert [Path(f.local_path).read_bytes() for f in files] == [p.read_bytes() for p in local]
    ds = records.record_dataset(files)
    assert [int(ds[i][0]) for i in range(len(ds))] == list(range(6))
    before = records.fingerprint(files)
    b.blob(f"{prefix}/{local[1].name}").upload_from_filename(str(local[1]))  # the same bytes, a new generation
    again = records.list_files(f"gs://{bucket}/{prefix}/*.array_record")
    assert records.fingerprint(again) != before
    assert again[1].local_path != files[1].local_path and again[0].local_path == files[0].local_path
