"""Compatibility table: diff_configs, check_compatible and the rules for every config field."""

from __future__ import annotations

import pytest

from jaxrec.model.compat import (
    MISSING,
    RULES,
    Change,
    check_compatible,
    diff_configs,
    rule_for,
    table_markdown,
)
from jaxrec.model.config import load_config


@pytest.fixture
def base():
    return load_config("configs/local-cpu.yaml").model_dump(mode="json")


def _with(cfg: dict, path: str, value) -> dict:
    import copy

    out = copy.deepcopy(cfg)
    node = out
    *parents, leaf = path.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return out


def test_identical_configs_have_no_difference(base):
    assert diff_configs(base, base) == []
    assert check_compatible(base, base) == []


def test_diff_names_dotted_path_old_and_new(base):
    changes = diff_configs(base, _with(base, "model.d_model", 128))
    assert changes == [Change("model.d_model", 64, 128)]
    assert changes[0].render() == "model.d_model: 64 -> 128"


def test_diff_sees_added_and_removed_fields(base):
    new = _with(base, "retry.budgets", {**base["retry"]["budgets"], "extra": 1})
    assert Change("retry.budgets.extra", MISSING, 1) in diff_configs(base, new)
    assert Change("retry.budgets.extra", 1, MISSING) in diff_configs(new, base)


def test_int_and_equal_float_are_the_same_value_but_bool_is_not(base):
    assert diff_configs({"a": 1}, {"a": 1.0}) == []
    assert diff_configs({"a": 1}, {"a": True}) == [Change("a", 1, True)]


SAFE = [
    ("checkpoint.interval_steps", 20),
    ("checkpoint.keep", 7),
    ("checkpoint.async_save", False),
    ("retry.no_progress_attempts", 9),
    ("retry.budgets.preemption", 99),
    ("monitoring.metrics_port", 9999),
    ("image", "other:tag"),
    ("service_account", "other"),
    ("namespace", "other"),
    ("training.hang_timeout_s", 999),
    ("training.heartbeat_timeout_s", 30),
    ("training.total_steps", 10_000),
    ("training.compilation_cache_dir", "/tmp/cache"),
    ("training.sharding", "fsdp"),
    ("storage.root", "gs://other-bucket/x"),
    ("data.resume_mode", "reshuffle"),
    ("optimizer.learning_rate", 1e-4),
    ("slice.spot", True),
    ("slice.termination_grace_s", 120),
    ("slice.shutdown_window_s", 15),
]

UNSAFE = [
    ("model.d_model", 128),
    ("model.n_layers", 3),
    ("model.dtype", "bfloat16"),
    ("optimizer.name", "sgd"),
    ("data.dataset", "other"),
    ("data.dataset_version", "synthetic-v2"),
    ("data.global_batch_size", 32),
    ("data.seed", 5),
    ("slice.hosts", 2),
    ("slice.accelerator", "v5e"),
    ("slice.devices_per_host", 2),
    ("training.seed", 1),
    ("run_id", "other"),
]


@pytest.mark.parametrize(("path", "value"), SAFE)
def test_safe_changes(base, path, value):
    new = _with(base, path, value)
    assert diff_configs(base, new), "the change must be visible"
    assert check_compatible(base, new) == []


@pytest.mark.parametrize(("path", "value"), UNSAFE)
def test_unsafe_changes(base, path, value):
    problems = check_compatible(base, _with(base, path, value))
    assert [p.path for p in problems] == [path]
    assert problems[0].reason
    assert path in problems[0].render() and "incompatible" in problems[0].render()


def test_unknown_paths_are_unsafe():
    assert not rule_for("brand_new_section.field").safe
    assert [p.path for p in check_compatible({}, {"brand_new": 1})] == ["brand_new"]


def test_most_specific_rule_wins():
    assert rule_for("optimizer.learning_rate").safe
    assert not rule_for("optimizer.name").safe
    assert rule_for("data.resume_mode").safe
    assert not rule_for("data.anything_new").safe


def test_every_leaf_of_the_config_is_covered_by_an_explicit_rule(base):
    # A new config field must be placed in the table on purpose (else it silently defaults to unsafe).
    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    explicit = {r.path for r in RULES}
    uncovered = [p for p in leaves(base) if not any(p == r or p.startswith(r + ".") for r in explicit)]
    assert uncovered == []


def test_table_lists_every_rule():
    text = table_markdown()
    for r in RULES:
        assert f"`{r.path}`" in text
    assert "any other path" in text


def test_checkpoints_doc_embeds_the_current_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "CHECKPOINTS.md").read_text()
    start = doc.index("-->\n", doc.index("<!-- generated from jaxrec.model.compat")) + len("-->\n")
    end = doc.index("<!-- end of generated table -->")
    assert doc[start:end].strip() == table_markdown(), "regenerate the table in docs/CHECKPOINTS.md"
