"""The layers hold: the trainer and the kernel import no step program (what a step shares lives in the kernel)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports (at any depth, function-level imports included), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "recovery_steps":  # from recovery_steps import restore_latest
                out += [(node.lineno, f"recovery_steps.{a.name}") for a in node.names]
    return out


def _step_programs(path: Path) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for line, name in _imports(path)
        if name.startswith("recovery_steps.") and not name.startswith("recovery_steps.kernel")
    ]


@pytest.mark.parametrize("layer", ["trainer", "recovery_steps/kernel"])
def test_a_layer_imports_no_step_program(layer):
    found = [hit for path in sorted((REPO / layer).rglob("*.py")) for hit in _step_programs(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("layer", ["trainer", "recovery_steps"])
def test_steps_and_trainer_import_nothing_of_the_generator(layer):
    """What a step or the trainer needs of the Workflow's world (the JobSet it renders) lives in the kernel."""
    found = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / layer).rglob("*.py"))
        for line, name in _imports(path)
        if name == "workflows" or name.startswith("workflows.")
    ]
    assert not found, "\n".join(found)


def test_the_check_sees_a_step_program_imported_inside_a_function(tmp_path, monkeypatch):
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from recovery_steps import restore_latest\n    import recovery_steps.verify\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert _step_programs(f) == [
        "mod.py:2 imports recovery_steps.restore_latest",
        "mod.py:3 imports recovery_steps.verify",
    ]


def test_the_generator_builds_from_names_not_through_the_client():
    """``workflows/`` writes manifests from ``kernel.names``; only what acts on a cluster (the drill, the local
    runner) uses the client (``kernel.kube``)."""
    acting = {REPO / "workflows" / "drill.py", *(REPO / "workflows" / "local").rglob("*.py")}
    found = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / "workflows").rglob("*.py"))
        if path not in acting
        for line, name in _imports(path)
        if name in ("recovery_steps.kernel.kube", "kubernetes") or name.startswith("kubernetes.")
    ]
    assert not found, "\n".join(found)


def test_every_step_makes_its_kubernetes_client_through_the_one_factory():
    """``kernel.step.k8s_client`` (one line and exit 2 without a config) is how a step gets its client."""
    found = []
    for path in sorted((REPO / "recovery_steps").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "recovery_steps.kernel.kube":
                if any(a.name == "make_api_client" for a in node.names):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, "make_api_client outside kernel.step.k8s_client: " + ", ".join(found)


def test_no_test_module_imports_another():
    """What tests share lives in ``tests/support/`` (and the tier's helpers beside it in ``tests/k8s/``)."""
    found = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / "tests").rglob("test_*.py"))
        for line, name in _imports(path)
        if name.split(".")[-1].startswith("test_")
    ]
    assert not found, "\n".join(found)
