"""dtlab's own imports sit at module level, where lint-imports sees them and an import cycle fails at once.

A function-level ``import dtlab...`` / ``from dtlab...`` (or a relative import) is allowed only with the
marker ``# deferred: <why>`` on its line or the line above, e.g. an import cycle it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dtlab

MARKER = "# deferred:"
PACKAGE = Path(dtlab.__file__).parent


def _is_dtlab(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "dtlab"
    return any(alias.name.split(".")[0] == "dtlab" for alias in node.names)


def unmarked_function_imports(source: str) -> list[int]:
    """Line numbers of function-level dtlab imports that carry no ``# deferred:`` marker."""
    lines = source.splitlines()
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import | ast.ImportFrom) and _is_dtlab(node):
                near = lines[max(0, node.lineno - 2):node.end_lineno or node.lineno]
                if not any(MARKER in line for line in near):
                    found.append(node.lineno)
    return sorted(set(found))  # a nested function is walked from each enclosing one


def test_the_checker_flags_an_unmarked_import_and_accepts_a_marked_one():
    source = ("def f():\n    from dtlab.core import env\n\n"
              "def g():\n    # deferred: import cycle\n    from dtlab.core import env\n\n"
              "def h():\n    import json\n    from . import sibling  # deferred: a child process\n")
    assert unmarked_function_imports(source) == [2]


def test_dtlab_imports_dtlab_at_module_level_unless_marked_deferred():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for line in unmarked_function_imports(path.read_text(encoding="utf-8"))]
    assert not offenders, f"move these imports to module level, or mark them '{MARKER} <why>': {offenders}"
