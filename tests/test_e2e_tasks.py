"""Recovery for tasks other than the built-in one: a flax NNX image classifier, and the lm task on record files."""

from __future__ import annotations

import pytest
from support.local_job import reference_digest, shrunken_workflow, steps_lost_bound

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import FailureClass
from jaxrec.model.records import CheckpointManifest
from workflows import local

pytestmark = pytest.mark.slow


def _killed(wf, root: str, reference: str):
    lines: list[str] = []
    res = local.run(
        wf,
        local.LocalRunOptions(
            inject=["kill-worker"], run_id="killed", store_root=root, reference_digest=reference, metrics_port=0
        ),
        say=lines.append,
    )
    out = "\n".join(lines)
    assert res.status == "Succeeded", out
    assert res.params_match is True, out  # same final parameters as the uninterrupted run
    assert res.incidents and res.incidents[0].failure_class == FailureClass.INFRASTRUCTURE, out
    store = RunStore(root, "killed")
    # A kill before the interval's asynchronous save committed loses that interval too.
    for inc in res.incidents:
        assert inc.steps_lost is not None and inc.steps_lost <= steps_lost_bound(store, inc), inc
    return store


def _last_manifest(store: RunStore) -> CheckpointManifest:
    step = max(store.checkpoint_steps())
    m = store.read_record(RunLayout.checkpoint_manifest(step), CheckpointManifest)
    assert m is not None
    return m


def test_image_classifier_recovers_from_a_killed_worker_with_the_same_params(classifier_job):
    (wf, root), reference = classifier_job  # shared with test_e2e_local's preempt and corruption cases
    store = _killed(wf, root, reference)
    m = _last_manifest(store)
    assert (m.task_name, m.task_version, m.dataset_version) == ("image-classifier", "1", "quadrant-images-v1")
    assert len(m.task_options_hash) == 64
    assert any(f.path.startswith("state/") for f in m.files)


def test_lm_on_record_files_recovers_from_a_killed_worker_with_the_same_params(tmp_path):
    from trainer import records, write_records

    cfg_path = tmp_path / "writer.yaml"
    wf = shrunken_workflow(tmp_path, "writer", store_root=str(tmp_path / "store"))
    cfg_path.write_text((tmp_path / "writer.yaml").read_text())
    files = write_records.run(str(cfg_path), str(tmp_path / "records"), num_files=3, num_records=300)
    assert len(files) == 3
    wf = shrunken_workflow(
        tmp_path,
        "on-files",
        store_root=str(tmp_path / "store"),
        hosts=2,
        data_section={"dataset": "records", "files": str(tmp_path / "records")},
    )
    store = _killed(wf, str(tmp_path / "store"), reference_digest(wf, str(tmp_path / "store")))
    m = _last_manifest(store)
    assert m.dataset_version == records.fingerprint(records.list_files(str(tmp_path / "records")))
    assert m.task_name == "lm"
