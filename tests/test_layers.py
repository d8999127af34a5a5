"""The layers hold: the trainer and ``jaxrec`` import no step program (what a step shares lives in ``jaxrec``); of
``jaxrec``'s two halves, the model does no I/O and imports nothing of the adapters."""

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
        if name.startswith("recovery_steps.") and not name.startswith("jaxrec")
    ]


@pytest.mark.parametrize("layer", ["trainer", "jaxrec/"])
def test_a_layer_imports_no_step_program(layer):
    found = [hit for path in sorted((REPO / layer).rglob("*.py")) for hit in _step_programs(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("layer", ["trainer", "recovery_steps", "jaxrec"])
def test_steps_and_trainer_import_nothing_of_the_generator(layer):
    """What a step or the trainer needs of the Workflow's world (the JobSet it renders) lives in ``jaxrec``."""
    found = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / layer).rglob("*.py"))
        for line, name in _imports(path)
        if name == "workflows" or name.startswith("workflows.")
    ]
    assert not found, "\n".join(found)


def test_jaxrec_imports_nothing_of_the_trainer():
    found = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / "jaxrec").rglob("*.py"))
        for line, name in _imports(path)
        if name.split(".")[0] == "trainer"
    ]
    assert not found, "\n".join(found)


# What reads or writes the world: a client library, a socket, a process, a thread pool.
IO_MODULES = (
    "jaxrec.adapters",
    "kubernetes",
    "google",
    "fsspec",
    "gcsfs",
    "requests",
    "urllib",
    "http",
    "socket",
    "subprocess",
    "psutil",
    "concurrent",
    "threading",
    "jax",
)


def _io(path: Path) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for line, name in _imports(path)
        if any(name == m or name.startswith(m + ".") for m in IO_MODULES)
    ]


def test_the_model_half_does_no_io_and_imports_nothing_of_the_adapters():
    """``jaxrec.model`` holds documents and tables: what reads or writes the world is in ``jaxrec.adapters``."""
    found = [hit for path in sorted((REPO / "jaxrec" / "model").rglob("*.py")) for hit in _io(path)]
    assert not found, "\n".join(found)


def test_the_io_check_sees_an_adapter_and_a_client_imported_inside_a_function(tmp_path, monkeypatch):
    f = tmp_path / "mod.py"
    f.write_text("import json\ndef f():\n    from jaxrec.adapters import store\n    import kubernetes.client\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert _io(f) == ["mod.py:3 imports jaxrec.adapters", "mod.py:4 imports kubernetes.client"]


def test_the_check_sees_a_step_program_imported_inside_a_function(tmp_path, monkeypatch):
    f = tmp_path / "mod.py"
    f.write_text("def f():\n    from recovery_steps import restore_latest\n    import recovery_steps.verify\n")
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    assert _step_programs(f) == [
        "mod.py:2 imports recovery_steps.restore_latest",
        "mod.py:3 imports recovery_steps.verify",
    ]


def test_the_generator_builds_from_names_not_through_the_client():
    """``workflows/`` writes manifests from ``model.names``; only what acts on a cluster (the drill, the local
    runner) uses the client (``adapters.kube``)."""
    acting = {REPO / "workflows" / "drill.py", *(REPO / "workflows" / "local").rglob("*.py")}
    found = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / "workflows").rglob("*.py"))
        if path not in acting
        for line, name in _imports(path)
        if name in ("jaxrec.adapters.kube", "kubernetes") or name.startswith("kubernetes.")
    ]
    assert not found, "\n".join(found)


def test_every_step_makes_its_kubernetes_client_through_the_one_factory():
    """``recovery_steps.step.k8s_client`` (one line and exit 2 without a config) is how a step gets its client."""
    found = []
    for path in sorted((REPO / "recovery_steps").glob("*.py")):
        if path.name == "step.py":  # the factory's home
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "jaxrec.adapters.kube":
                if any(a.name == "make_api_client" for a in node.names):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, "make_api_client outside recovery_steps.step.k8s_client: " + ", ".join(found)


def test_no_test_module_imports_another():
    """What tests share lives in ``tests/support/`` (and the tier's helpers beside it in ``tests/k8s/``)."""
    found = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / "tests").rglob("test_*.py"))
        for line, name in _imports(path)
        if name.split(".")[-1].startswith("test_")
    ]
    assert not found, "\n".join(found)
