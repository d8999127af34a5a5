"""validate-config: every bad config gets a one-line-per-problem message; runs are pinned to their config."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.ckpt_factory import write_checkpoint

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import load_config
from jaxrec.model.contract import ExitCode
from recovery_steps import validate_config

CONFIGS = sorted(Path("configs").glob("*.yaml"))


def _load(name: str) -> dict:
    return yaml.safe_load(Path(f"configs/{name}.yaml").read_text())


def _set(d: dict, path: str, value) -> dict:
    out = copy.deepcopy(d)
    node = out
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return out


_DELETE = object()


def _cli(tmp_path: Path, text: str, *extra: str, capsys) -> tuple[int, str, str]:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(text)
    code = validate_config.main(["--config", str(cfg), "--output-dir", str(tmp_path / "out"), *extra])
    out, err = capsys.readouterr()
    return code, out, err


BAD = {
    "unknown-accelerator": (
        "v5e-4x4",
        "slice.accelerator",
        "v9z",
        ["slice.accelerator", "'v9z'", "v5e", "v6e", "local"],
    ),
    "topology-not-valid-for-type": ("v5e-4x4", "slice.topology", "4x4x4", ["slice.topology", "'4x4x4'", "4x8", "8x8"]),
    "topology-of-another-generation": (
        "v5e-4x4",
        "slice.topology",
        "2x2x1",
        ["slice.topology", "'2x2x1'", "single-host: 1x1, 2x2, 2x4", "multi-host: 4x4"],
    ),
    "hosts-contradict-topology": ("v5e-4x4", "slice.hosts", 8, ["slice.hosts", "8", "4x4", "set hosts: 4"]),
    "negative-budget": (
        "local-cpu",
        "retry.budgets.preemption",
        -1,
        ["retry.budgets.preemption", "-1", ">= 0|greater than or equal to 0"],
    ),
    "gs-root-not-a-bucket": (
        "local-cpu",
        "storage.root",
        "gs://Not_A/bucket",
        ["storage.root", "gs://Not_A/bucket", "gs://BUCKET"],
    ),
    "unknown-key": (
        "local-cpu",
        "training.hang_timeout",
        5,
        ["training.hang_timeout", "unknown key", "hang_timeout_s"],
    ),
    "missing-required": ("local-cpu", "image", _DELETE, ["image", "required field is missing"]),
    "window-longer-than-grace": (
        "v5e-4x4",
        "slice.shutdown_window_s",
        60,
        ["slice.shutdown_window_s", "60", "exceeds slice.termination_grace_s 30", "at most 30"],
    ),
    "grace-not-positive": (
        "local-cpu",
        "slice.termination_grace_s",
        0,
        ["slice.termination_grace_s", "greater than or equal to 1", "got 0"],
    ),
    "grace-not-an-integer": (
        "local-cpu",
        "slice.termination_grace_s",
        "thirty",
        ["slice.termination_grace_s", "integer", "'thirty'"],
    ),
    "bad-enum": ("local-cpu", "data.resume_mode", "rewind", ["data.resume_mode", "'rewind'", "'exact'", "'reshuffle'"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_exits_2_with_field_value_and_options(tmp_path, capsys, case):
    import re

    base, path, value, expected = BAD[case]
    code, _, err = _cli(tmp_path, yaml.safe_dump(_set(_load(base), path, value)), capsys=capsys)
    assert code == ExitCode.CONFIGURATION
    assert "Traceback" not in err
    for fragment in expected:
        assert re.search(fragment, err), f"{fragment!r} not in:\n{err}"
    assert not (tmp_path / "out").exists()


def test_yaml_syntax_error_in_a_real_process(tmp_path):
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("run_id: x\nslice: {accelerator: local, hosts: 4\nimage: y\n")
    p = subprocess.run(
        [sys.executable, "-m", "recovery_steps.validate_config", "--config", str(cfg), "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == ExitCode.CONFIGURATION
    assert "YAML syntax error at line" in p.stderr and "broken.yaml" in p.stderr
    assert "Traceback" not in p.stderr


def test_unreadable_file_exits_2(tmp_path, capsys):
    code = validate_config.main(["--config", str(tmp_path / "nope.yaml"), "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == ExitCode.CONFIGURATION and "cannot read the file" in err and "Traceback" not in err


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_is_valid(path, tmp_path, capsys):
    out = tmp_path / "out"
    code = validate_config.main(
        ["--config", str(path), "--store-root", str(tmp_path / "store"), "--output-dir", str(out)]
    )
    assert code == 0, capsys.readouterr().err
    cfg = load_config(path)
    assert (out / "run-id").read_text() == cfg.run_id
    assert (out / "store-root").read_text() == str(tmp_path / "store")
    assert (out / "config-hash").read_text() == cfg.config_hash()
    assert (out / "hosts").read_text() == str(cfg.slice.num_hosts)


# ---- the run store: pinning, changes, checkpoints --------------------------------------------------


def _write_cfg(tmp_path: Path, data: dict, name: str = "job.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def _validate(cfg_path: Path, store_root: str, out: Path, *extra: str) -> int:
    return validate_config.main(
        ["--config", str(cfg_path), "--store-root", store_root, "--output-dir", str(out), *extra]
    )


def test_new_run_pins_config_and_rerun_is_idempotent(store_root, tmp_path, capsys):
    data = _load("local-cpu")
    path = _write_cfg(tmp_path, data)
    assert _validate(path, store_root, tmp_path / "o1") == 0
    store = RunStore(store_root, data["run_id"])
    doc = store.read_json(RunLayout.CONFIG)
    assert doc["hash"] == load_config(path).config_hash()
    assert doc["config"]["slice"]["hosts"] == 4
    assert _validate(path, store_root, tmp_path / "o2") == 0
    assert (tmp_path / "o2" / "config-hash").read_text() == doc["hash"]


def test_the_workflows_run_id_parameter_names_the_pinned_run(tmp_path, capsys):
    """``argo submit -p run-id=X``: every step and worker uses run X, so validate-config pins the config as X's."""
    data = _load("local-cpu")
    path = _write_cfg(tmp_path, data)
    root = str(tmp_path / "store")
    assert _validate(path, root, tmp_path / "o", "--run-id", "drill-7") == 0
    doc = RunStore(root, "drill-7").read_json(RunLayout.CONFIG)
    assert doc["config"]["run_id"] == "drill-7" and (tmp_path / "o" / "run-id").read_text() == "drill-7"
    assert not RunStore(root, data["run_id"]).exists(RunLayout.CONFIG)


def test_changed_config_is_refused_field_by_field(store_root, tmp_path, capsys):
    data = _load("local-cpu")
    assert _validate(_write_cfg(tmp_path, data), store_root, tmp_path / "o") == 0
    changed = _set(_set(data, "model.d_model", 128), "training.hang_timeout_s", 99)
    path = _write_cfg(tmp_path, changed, "changed.yaml")
    capsys.readouterr()

    code = _validate(path, store_root, tmp_path / "o2", "--accept-safe-changes")

    err = capsys.readouterr().err
    assert code == ExitCode.CONFIGURATION
    assert "model.d_model: 64 -> 128" in err and "training.hang_timeout_s: 30 -> 99" in err
    assert "incompatible" in err and "Traceback" not in err
    assert RunStore(store_root, data["run_id"]).read_json(RunLayout.CONFIG)["config"]["model"]["d_model"] == 64


def test_safe_changes_need_the_flag_and_keep_the_previous_config(store_root, tmp_path, capsys):
    data = _load("local-cpu")
    first = _write_cfg(tmp_path, data)
    assert _validate(first, store_root, tmp_path / "o") == 0
    old_hash = load_config(first).config_hash()
    path = _write_cfg(tmp_path, _set(data, "checkpoint.interval_steps", 5), "changed.yaml")
    capsys.readouterr()

    assert _validate(path, store_root, tmp_path / "o2") == ExitCode.CONFIGURATION
    err = capsys.readouterr().err
    assert "checkpoint.interval_steps: 10 -> 5" in err and "--accept-safe-changes" in err
    # The workflow always passes the flag with its parameter's value ("false" unless submitted with true).
    assert _validate(path, store_root, tmp_path / "o2", "--accept-safe-changes", "false") == ExitCode.CONFIGURATION

    assert _validate(path, store_root, tmp_path / "o3", "--accept-safe-changes", "true") == 0
    store = RunStore(store_root, data["run_id"])
    assert store.read_json(RunLayout.CONFIG)["hash"] == load_config(path).config_hash()
    assert store.read_json(validate_config.previous_config_path(old_hash))["hash"] == old_hash


def test_latest_checkpoint_incompatible_exits_3(store_root, tmp_path, capsys):
    data = _load("local-cpu")
    path = _write_cfg(tmp_path, data)
    cfg = load_config(path)
    store = RunStore(store_root, cfg.run_id)
    # The run's config.json is gone (or was never written) but a checkpoint of two hosts is there.
    write_checkpoint(store, cfg, 10, process_count=2)

    code = _validate(path, store_root, tmp_path / "o")

    err = capsys.readouterr().err
    assert code == ExitCode.INCOMPATIBLE_CHECKPOINT
    assert "step 10" in err and "written by 2 processes, the slice has 4" in err
    assert store.read_json(RunLayout.CONFIG) is None


def test_latest_compatible_checkpoint_passes(store_root, tmp_path, capsys):
    data = _load("local-cpu")
    path = _write_cfg(tmp_path, data)
    cfg = load_config(path)
    write_checkpoint(RunStore(store_root, cfg.run_id), cfg, 10)
    assert _validate(path, store_root, tmp_path / "o") == 0


def test_resubmitted_run_continues_the_attempt_numbering(store_root, tmp_path, capsys):
    data = _load("local-cpu")
    path = _write_cfg(tmp_path, data)
    assert _validate(path, store_root, tmp_path / "o1") == 0
    assert (tmp_path / "o1" / "first-attempt").read_text() == "0"
    store = RunStore(store_root, data["run_id"])
    # A first workflow ran attempts 0 and 1 (1 was cut short before it was closed in the ledger).
    store.write_json(RunLayout.LEDGER, {"run_id": data["run_id"], "attempts": [{"attempt": 0, "outcome": "failed"}]})
    store.write_json(RunLayout.worker_report(1, 0), {"attempt": 1})
    assert _validate(path, store_root, tmp_path / "o2") == 0
    assert (tmp_path / "o2" / "first-attempt").read_text() == "2"


def test_accept_flag_rejects_a_non_boolean(tmp_path, capsys):
    path = _write_cfg(tmp_path, _load("local-cpu"))
    with pytest.raises(SystemExit) as e:
        _validate(path, str(tmp_path / "s"), tmp_path / "o", "--accept-safe-changes", "maybe")
    assert e.value.code == 2
    assert "'maybe' is not a boolean" in capsys.readouterr().err


# ---- run ids and the worker pod names JobSet admits ------------------------------------------------


def test_run_id_too_long_for_the_pod_names_is_refused_in_one_line_before_the_store(tmp_path, capsys):
    data = _set(_load("v5e-4x4"), "run_id", "r" * 39)  # attempt 99999 on 4 hosts leaves room for 38
    path = _write_cfg(tmp_path, data)
    store = tmp_path / "store"

    code = _validate(path, str(store), tmp_path / "o")

    lines = capsys.readouterr().err.splitlines()
    assert code == ExitCode.CONFIGURATION and len(lines) == 1, lines
    assert "run_id: " in lines[0] and "at most 38 characters" in lines[0] and "retry.max_attempts" in lines[0]
    assert not store.exists() and not (tmp_path / "o").exists()
    assert _validate(_write_cfg(tmp_path, _set(data, "run_id", "r" * 38), "ok.yaml"), str(store), tmp_path / "o") == 0


def test_resubmission_whose_attempts_pass_the_pod_name_limit_is_refused(store_root, tmp_path, capsys):
    # 40 characters fit attempts up to 999 on 4 hosts: max_attempts 1000 stops the run before attempt 1000.
    data = _set(_set(_load("local-cpu"), "run_id", "r" * 40), "retry.max_attempts", 1000)
    path = _write_cfg(tmp_path, data)
    assert _validate(path, store_root, tmp_path / "o1") == 0
    store = RunStore(store_root, data["run_id"])
    # The run stopped at its cap after attempt 999; a resubmission would start attempt 1000.
    store.write_json(RunLayout.LEDGER, {"run_id": data["run_id"], "attempts": [{"attempt": 999, "outcome": "failed"}]})
    capsys.readouterr()

    code = _validate(path, store_root, tmp_path / "o2")

    lines = capsys.readouterr().err.splitlines()
    assert code == ExitCode.CONFIGURATION and len(lines) == 1, lines
    assert "at attempt 1000" in lines[0] and "at most 39 characters" in lines[0]
    assert not (tmp_path / "o2").exists()
