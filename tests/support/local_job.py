"""A shrunken local job (2 hosts, tiny model, 20 steps, a checkpoint every 5) compiled like configs/.

Two processes form one job as four do (one coordinator, a gang that fails together); the README job and the
trainer's own tests run four. Two halve each attempt's start-up on a 2-core machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from jaxrec.adapters.store import RunStore
from jaxrec.model.config import load_config
from jaxrec.model.records import EventKind
from workflows.build import render_workflow
from workflows.report import load_events

REPO = Path(__file__).resolve().parents[2]
TOTAL = 20
INTERVAL = 5
HOSTS = 2


def shrunken_workflow(
    d: Path,
    run_id: str,
    *,
    store_root: str | None = None,
    config: str = "local-cpu.yaml",
    data_section: dict[str, Any] | None = None,
    retry_section: dict[str, Any] | None = None,
    local_tier: dict[str, Any] | None = None,
    hosts: int = HOSTS,
    **training: Any,
) -> Path:
    """Write the shrunken config and its compiled Workflow under ``d``; return the Workflow's path.

    Args:
        d: Folder for the config and the Workflow.
        run_id: The config's run id.
        store_root: The config's storage root (default: the local config's).
        config: The config in ``configs/`` to shrink (its task is kept).
        data_section: Overrides of the ``data`` section (e.g. record files).
        retry_section: Overrides of the ``retry`` section.
        local_tier: The ``checkpoint.local`` section (the host-local and peer tiers; off when None).
        hosts: Worker processes of the local slice.
        **training: Overrides of the ``training`` section (e.g. ``step_delay_s``).
    """
    data = yaml.safe_load((REPO / "configs" / config).read_text())
    data["run_id"] = run_id
    data["slice"]["hosts"] = hosts
    if store_root is not None:
        data["storage"]["root"] = store_root
    if "model" in data:  # the built-in lm task's options
        data["model"].update(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=16)
    data["data"].update(data_section or {})
    # JAX's coordination heartbeat: 10 s, not 3. Two of these jobs start side by side on two cores, and a worker
    # starved of the CPU for 3 s in its start-up (the coordinator's host among them) aborted on its own heartbeat
    # RPC's DEADLINE_EXCEEDED, a failure no scenario asked for. A killed peer is still seen at once (its collective's
    # connection resets) and a frozen one by the supervisor's no-progress deadline below.
    data["training"].update(total_steps=TOTAL, heartbeat_timeout_s=10, hang_timeout_s=20, compile_grace_s=90)
    data["training"].update(training)
    if os.environ.get("JAXREC_TEST_COMPILE_CACHE"):  # the session's shared cache (tests/conftest.py)
        data["training"].setdefault("compilation_cache_dir", os.environ["JAXREC_TEST_COMPILE_CACHE"])
    # The supervisor's no-progress deadline: steps here take milliseconds, heartbeats come every second.
    if "supervision" in data:  # configs with local supervision deadlines (heartbeats every second)
        data["supervision"]["hang_timeout_s"] = 8
    data["checkpoint"].update(interval_steps=INTERVAL, keep=3)
    if local_tier is not None:
        data["checkpoint"]["local"] = local_tier
    data["retry"].update(default_backoff={"base_s": 0, "factor": 1, "max_s": 0}, no_progress_attempts=3)
    data["retry"].update(retry_section or {})
    cfg = d / f"{run_id}.yaml"
    cfg.write_text(yaml.safe_dump(data))
    wf = d / f"{run_id}-workflow.yaml"
    wf.write_text(render_workflow(load_config(cfg), str(cfg)))
    return wf


def reference_digest(wf: Path, root: str) -> str:
    """Run ``wf`` uninterrupted as run ``reference`` under ``root``; the final parameters' digest."""
    from workflows import local

    ref = local.run(
        wf,
        local.LocalRunOptions(run_id="reference", store_root=root, metrics_port=None, report=False),
        say=lambda _: None,
    )
    assert ref.status == "Succeeded" and ref.params_digest
    return ref.params_digest


def committed_before(store: RunStore, attempt: int, t: float) -> int:
    """The newest step attempt ``attempt`` had committed, manifest included, before ``t`` (0: none).

    Process 0 writes the manifest that completes a step's transaction, so its commit event is the one that counts.
    """
    steps = [
        e.step or 0
        for e in load_events(store)
        if e.event == EventKind.SAVE_COMMITTED and e.attempt == attempt and e.t < t and e.process_index == 0
    ]
    return max(steps, default=0)


def steps_lost_bound(store: RunStore, inc: Any, max_lost: int = INTERVAL) -> int:
    """The most steps incident ``inc`` may lose: ``max_lost``, or more where the failure came before the
    asynchronous save of the interval had committed (then: the steps since the newest step committed before it).
    """
    if inc.pre_failure_step is None:
        return max_lost
    failed = inc.injected_at or inc.detected_at
    return max(max_lost, inc.pre_failure_step - committed_before(store, inc.attempt, failed))
