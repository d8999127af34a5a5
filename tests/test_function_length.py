"""No function in the product is longer than 80 lines (decorators and docstring included)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("workflows", "trainer", "recovery_steps", "examples")
LIMIT = 80


def long_functions(repo: Path, roots: tuple[str, ...], limit: int = LIMIT) -> list[str]:
    """``path:line name (n lines)`` for each function over ``limit`` lines in the Python files under ``roots``."""
    out = []
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    n = (node.end_lineno or node.lineno) - first + 1
                    if n > limit:
                        out.append(f"{path.relative_to(repo)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_product_function_is_longer_than_80_lines():
    assert long_functions(REPO, PRODUCT) == [], "split these into functions of one purpose each"


def test_the_check_finds_a_long_function_and_counts_its_decorators(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT - 2))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        f"def short():\n    return 1\n\n\n@staticmethod\n@staticmethod\ndef long():\n{body}\n\n\ndef fits():\n{body}\n"
    )
    assert long_functions(tmp_path, ("pkg",)) == [f"pkg/m.py:7 long ({LIMIT + 1} lines)"]
