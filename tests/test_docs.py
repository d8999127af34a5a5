"""The README's tables agree with the tables in code, and its first two lines are the two commands.

The metric table lives in docs/MONITORING.md, held to the code by tests/test_monitoring.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from jaxrec.model.contract import CLASS_INFO, EXIT_CODES, FAILURE_CLASSES, FailureClass

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_starts_with_the_two_commands():
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block and README.index("```bash") < 200
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    assert len(lines) == 2
    assert "workflows.local argo/local-cpu.yaml --inject kill-worker" in lines[0]
    assert lines[1].startswith(".venv/bin/python -m pytest")


def test_readme_exit_code_table_matches_the_contract():
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \| .+? \|$", README, re.M))
    for info in EXIT_CODES:
        assert str(info.code.value) in rows, info
        assert rows[str(info.code.value)] == info.meaning, (rows[str(info.code.value)], info.meaning)
    assert len(rows) == len(EXIT_CODES)


def test_readme_names_every_failure_class():
    for cls in FailureClass:
        assert f"| `{cls.value}` |" in README, cls


def test_every_failure_class_is_one_row_of_the_class_table_and_the_docs_say_its_budget():
    assert [c.cls for c in FAILURE_CLASSES] == list(dict.fromkeys(c.cls for c in FAILURE_CLASSES))
    assert set(CLASS_INFO) == set(FailureClass)
    failures = (Path(__file__).resolve().parents[1] / "docs" / "FAILURES.md").read_text()
    for doc, column in ((README, -1), (failures, -2)):
        rows = {r[0]: r for r in re.findall(r"^\| `(\w+)` \|(.*)\|$", doc, re.M)}
        for c in FAILURE_CLASSES:
            cells = [x.strip() for x in rows[c.cls.value][1].split("|")]
            assert cells[column] == str(c.budget), (c.cls, cells[column])


def test_readme_links_resolve():
    root = Path(__file__).resolve().parents[1]
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (root / target).exists(), target


def test_contracts_output_table_is_generated_from_the_declarations():
    from jaxrec.model.outputs import outputs_table_markdown

    doc = (Path(__file__).resolve().parents[1] / "docs" / "CONTRACTS.md").read_text()
    begin = doc.index("-->\n", doc.index("<!-- generated from jaxrec.model.outputs")) + len("-->\n")
    current = doc[begin : doc.index("<!-- end of generated table -->")].strip()
    assert current == outputs_table_markdown(), "docs/CONTRACTS.md step-output table is stale"


def test_your_training_guide_snippets_run(tmp_path, monkeypatch):
    import sys

    import yaml

    from jaxrec.model.config import ConfigError, parse_config

    root = Path(__file__).resolve().parents[1]
    guide = (root / "docs" / "YOUR-TRAINING.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) == 3
    for block in blocks[:2]:  # the two modules, each named by its first line
        name = block.splitlines()[0].removeprefix("# ").strip()
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(block)
    (tmp_path / "mytask" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    from mytask.spec import TASK  # noqa: PLC0415 - written just above

    exec(compile(blocks[2], "YOUR-TRAINING.md", "exec"), {"TASK": TASK})  # noqa: S102 - the guide's own check
    assert "jax" in sys.modules

    snippet = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", guide, re.S)[0])
    data = yaml.safe_load((root / "configs" / "local-image-classifier.yaml").read_text())
    cfg = parse_config({**data, **snippet})
    assert cfg.task_options().hidden == 16 and cfg.task.spec().name == "regression"
    shown = re.search(r"`(task\.options\.hidden: .*?)`", guide).group(1)
    bad = {**snippet, "task": {**snippet["task"], "options": {"hidden": 0}}}
    try:
        parse_config({**data, **bad})
    except ConfigError as e:
        assert e.problems == [shown]
    else:
        raise AssertionError("a bad option was accepted")


def test_the_scenario_tables_of_the_docs_are_the_scenario_table():
    """docs/LOCAL.md has one row per injectable fault, in the table's order, and says Failed exactly where the run
    ends Failed; the README names every one."""
    from workflows.local.inject import SCENARIO_TABLE

    local = (Path(__file__).resolve().parents[1] / "docs" / "LOCAL.md").read_text()
    section = local.split("| scenario | what happens | expected outcome |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([\w-]+)` \| .+? \| (.+) \|$", section, re.M)
    assert [name for name, _ in rows] == [s.name for s in SCENARIO_TABLE]
    for (name, outcome), s in zip(rows, SCENARIO_TABLE, strict=True):
        assert ("Failed" in outcome) == (s.ends == "Failed"), (name, outcome, s.ends)
    for s in SCENARIO_TABLE:
        assert f"`{s.name}`" in README, s.name


def test_the_runbooks_drill_table_has_one_row_per_fault_the_drill_injects():
    """docs/RUNBOOK.md's ``--inject`` table names the rows of the one fault table that act on a cluster."""
    from workflows.faults import FAULTS

    runbook = (Path(__file__).resolve().parents[1] / "docs" / "RUNBOOK.md").read_text()
    section = runbook.split("| `--inject` | what it does | expect |", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([\w-]+)` \|", section, re.M)
    assert sorted(rows) == sorted(f.name for f in FAULTS if f.on_cluster), rows


def test_the_testing_guide_has_one_row_per_area_with_its_commands():
    """docs/TESTING.md's area table is the area table of the tests (tests/support/areas.py): one row each, in the
    same order, naming the markers its commands select by."""
    from support.areas import AREAS

    doc = (Path(__file__).resolve().parents[1] / "docs" / "TESTING.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|(.*)$", doc.split("## Checking one change", 1)[1].split("\n## ", 1)[0], re.M)
    assert [a for a, _ in rows] == list(AREAS), "the area table's rows are not tests/support/areas.py's areas"
    for area, rest in rows:
        assert f'-m "{area} and not k8s"' in rest or "no fast tests" in rest, area
        assert f'-m "k8s and {area}"' in rest or "no tier tests" in rest, area
