"""End to end: a run-store outage during restore-latest and classify-failure is retried in place, outside budgets."""

from __future__ import annotations

import pytest
from support.local_job import shrunken_workflow

from jaxrec.model.contract import ExitCode
from workflows import local

pytestmark = pytest.mark.slow


def test_store_outage_in_restore_and_classify_leaves_the_run_succeeded(tmp_path, monkeypatch):
    # Retries in place a second apart: the outages, not the backoff, are what the run waits out.
    wf = shrunken_workflow(tmp_path, "outage-e2e", retry_section={"transient_backoff_s": 1})
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    res = local.run(
        wf,
        local.LocalRunOptions(
            inject=["kill-worker@12"],
            gcs_emulator=True,
            run_id="outage-e2e",
            metrics_port=None,
            store_outages=["restore-latest=2", "classify-failure=2"],
            report=False,
        ),
        say=lines.append,
    )
    out = "\n".join(lines)
    assert res.status == "Succeeded", out
    assert "store outage: 2s from the first store request of" in out
    # Each outage made a try of the step exit transient (69); a retry in place succeeded.
    for template in ("restore-latest", "classify-failure"):
        mine = [ln for ln in lines if f" {template}" in ln]
        assert any("Failed" in ln and f"exit code {int(ExitCode.TRANSIENT)}" in ln for ln in mine), out
        assert any(f"{template} (retry" in ln and "Succeeded" in ln for ln in mine), out
    # One failure, one class: the outage did not add an attempt or count against a budget.
    failed = [a for a in res.ledger.attempts if a.outcome == "failed"]
    assert len(failed) == len(res.incidents) and failed[0].failure_class.value == "infrastructure", res.ledger
    assert res.ledger.final_status == "Succeeded"
