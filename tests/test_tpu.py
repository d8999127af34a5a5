"""On a TPU: a gang of one killed mid-run and during a save resumes bit-exactly on the chip.

Marked ``tpu``: skipped, with the reason, where JAX finds no TPU (CI has none). Run on a TPU machine with
``pytest -m tpu tests/test_tpu.py``. Each run opens the chip (one program at a time may hold it).
"""

from __future__ import annotations

import importlib.util
import signal

import pytest
from support.trainer_harness import jax_platform, launch, read_report, tiny_config, write_config

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import EventKind

pytestmark = [pytest.mark.tpu, pytest.mark.slow]

TOTAL, INTERVAL = 60, 20
# configs/local-tpu.yaml's model; a pause after each step so that a kill lands mid-run, not after the end.
MODEL = {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024, "seq_len": 128}


def tpu_absent() -> str | None:
    """Why there is no TPU to test on here (None: there is one)."""
    if importlib.util.find_spec("libtpu") is None:
        return "no TPU here: libtpu is not installed (run on a TPU machine: pytest -m tpu tests/test_tpu.py)"
    rc, platform = jax_platform()
    if rc != 0 or platform != "tpu":
        return f"JAX finds no TPU here (platform {platform or '?'}, exit {rc})"
    return None


@pytest.fixture(scope="module")
def chip(tmp_path_factory):
    """The compilation cache the module's runs share; skips where there is no TPU."""
    reason = tpu_absent()
    if reason:
        pytest.skip(reason)
    return str(tmp_path_factory.mktemp("xla-cache"))


def _config(work, run_id: str, cache: str):
    return tiny_config(str(work / "store"), run_id=run_id, hosts=1, share_compile_cache=False,
                       slice={"local_devices": "accelerator"}, model=MODEL,
                       data={"global_batch_size": 32, "num_records": 1024},
                       training={"total_steps": TOTAL, "step_delay_s": 0.05, "compile_grace_s": 600,
                                 "compilation_cache_dir": cache},
                       checkpoint={"interval_steps": INTERVAL, "keep": 10})  # fmt: skip


def _losses(attempt_events) -> dict[int, float]:
    return {e.step: e.loss for e in attempt_events if e.event == EventKind.STEP}


def _finished(store: RunStore, attempt: int) -> dict:
    report = read_report(store, attempt, 0)
    assert report is not None and report["exit_code"] == 0, report
    assert report["params_digest"] and report["state_digest"], report
    return report


@pytest.fixture(scope="module")
def reference(chip, tmp_path_factory):
    """An uninterrupted run on the chip: its exit report and its loss at every step."""
    work = tmp_path_factory.mktemp("tpu-reference")
    cfg = _config(work, "tpu-reference", chip)
    store = write_config(cfg)
    gang = launch(cfg, 0, -1, work)
    assert gang.wait(600) == [0], gang.log(0)[-3000:]
    return _finished(store, 0), _losses(gang.events(0))


def _latest_complete(store: RunStore) -> int:
    steps = [s for s in range(INTERVAL, TOTAL + 1, INTERVAL) if store.exists(RunLayout.checkpoint_manifest(s))]
    assert steps, "no complete checkpoint"
    return max(steps)


@pytest.mark.parametrize("kill", ["mid-run", "during-save"])
def test_a_killed_worker_resumes_bit_exactly_on_the_chip(chip, reference, kill, tmp_path):
    ref_report, ref_losses = reference
    cfg = _config(tmp_path, f"tpu-{kill}", chip)
    store = write_config(cfg)
    if kill == "mid-run":
        gang = launch(cfg, 0, -1, tmp_path)
        gang.wait_for(0, EventKind.SAVE_COMMITTED, INTERVAL, timeout=600)
        gang.wait_for(0, EventKind.STEP, INTERVAL + 10, timeout=120)
        gang.signal(0, signal.SIGKILL)
    else:  # SIGKILL once the save of step 2 * INTERVAL has its writes in flight, before they commit
        gang = launch(cfg, 0, -1, tmp_path, fault=f"kill-during-save@{2 * INTERVAL}")
    assert gang.wait(600) == [-signal.SIGKILL], gang.log(0)[-3000:]
    restore = _latest_complete(store)
    assert restore == INTERVAL or kill == "mid-run", restore  # the torn save of step 40 is not complete
    assert restore < TOTAL

    gang = launch(cfg, 1, restore, tmp_path)
    assert gang.wait(600) == [0], gang.log(0)[-3000:]
    report = _finished(store, 1)
    assert [e.step for e in gang.events(0) if e.event == EventKind.RESTORED] == [restore]
    # Parameters, optimizer state (the whole state, step, RNG and data position too) and the loss curve after
    # the restore: identical to the uninterrupted run's.
    assert report["params_digest"] == ref_report["params_digest"]
    assert report["state_digest"] == ref_report["state_digest"]
    losses = _losses(gang.events(0))
    assert sorted(losses) == list(range(restore + 1, TOTAL + 1))
    assert losses == {s: ref_losses[s] for s in losses}
