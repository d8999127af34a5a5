"""End to end: ``workflows.local --gcs-emulator`` runs the whole job against a gs:// run store."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.local_job import HOSTS, shrunken_workflow

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import FailureClass
from workflows import local, report

pytestmark = pytest.mark.slow


def test_kill_worker_against_the_emulator_restores_from_gs_and_reports(tmp_path, monkeypatch):
    wf = shrunken_workflow(tmp_path, "gcs-e2e")
    monkeypatch.chdir(tmp_path)  # the runner's local files (.local-runs/...) go under tmp_path
    lines: list[str] = []
    res = local.run(
        wf,
        local.LocalRunOptions(inject=["kill-worker@12"], gcs_emulator=True, run_id="gcs-e2e", metrics_port=None),
        say=lines.append,
    )
    out = "\n".join(lines)
    assert res.status == "Succeeded", out
    assert res.store_url.startswith("gs://local-runs/"), res.store_url
    # The injected kill is the first incident; a loaded machine may add a later one (still recovered).
    inc = res.incidents[0]
    assert inc.failure_class == FailureClass.INFRASTRUCTURE
    # Asynchronous commits to gs:// may still be in flight at the kill: step 10 or, failing that, 5.
    assert inc.restored_step in (5, 10) and inc.steps_lost == inc.pre_failure_step - inc.restored_step, inc
    assert f"restore-step={inc.restored_step}" in out and "restore-path=gs://local-runs/" in out, out
    # The report ran on the gs:// run while the emulator was up: incident row and a timeline in the bucket.
    assert any(p.startswith("gs://local-runs/") and p.endswith("timeline.png") for p in res.report_paths), out
    assert re.search(r"^\s+0  kill-worker  infrastructure", out, re.M), out

    # The emulator is gone now; the copy of the run serves later reports.
    copy = Path(res.local_copy)
    store = RunStore(str(copy.parent.parent), "gcs-e2e")
    final = len(res.incidents)
    restore = store.read_json(RunLayout.restore_record(final))
    assert restore and str(restore.get("restore_path", restore.get("restore-path", ""))).startswith("gs://"), restore
    for i in range(HOSTS):
        rep = store.read_json(RunLayout.worker_report(final, i))
        assert rep["exit_code"] == 0 and rep["restore_step"] >= inc.restored_step and rep["last_step"] == 20, rep
    assert store.exists(RunLayout.checkpoint_manifest(20))
    later: list[str] = []
    paths = report.run(str(copy), say=later.append)
    assert Path(paths[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("kill-worker" in line and "infrastructure" in line for line in later), later
