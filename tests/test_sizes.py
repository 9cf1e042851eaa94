"""The library's size limits (docs/architecture.md): no module over 600 lines, no class over
300 lines, no function over 80 lines. Read with ast, like the layer contract is read with
import-linter, so a reader can hold each unit in their head."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

MODULE_LINES = 600
CLASS_LINES = 300
FUNCTION_LINES = 80


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def oversized(root: Path) -> list[str]:
    """Each unit over its limit, as ``path:line kind name (lines)``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        where = path.relative_to(root.parent)
        lines = len(source.splitlines())
        if lines > MODULE_LINES:
            found.append(f"{where} module ({lines} lines)")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and _span(node) > CLASS_LINES:
                found.append(f"{where}:{node.lineno} class {node.name} ({_span(node)} lines)")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _span(node) > FUNCTION_LINES:
                    found.append(f"{where}:{node.lineno} def {node.name} ({_span(node)} lines)")
    return found


def test_no_module_class_or_function_is_over_its_limit():
    assert oversized(REPO / "cachegen") == []


def test_the_check_names_an_oversized_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    (package / "long.py").write_text(f"def long_one():\n{body}\n")
    assert oversized(package) == [f"pkg/long.py:1 def long_one ({FUNCTION_LINES + 1} lines)"]
