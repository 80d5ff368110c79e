"""dtlab's own imports sit at module level, where lint-imports sees them and an import cycle fails at once; no
module grows past 400 lines.

A function-level ``import dtlab...`` / ``from dtlab...`` (or a relative import) would hide an import from the
contracts, or dodge a cycle instead of untying it: there is none. (A heavy third-party import may be deferred.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import dtlab

PACKAGE = Path(dtlab.__file__).parent
MAX_LINES = 400


def _is_dtlab(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "dtlab"
    return any(alias.name.split(".")[0] == "dtlab" for alias in node.names)


def function_imports(source: str) -> list[int]:
    """Line numbers of dtlab imports inside a function."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import | ast.ImportFrom) and _is_dtlab(node):
                found.append(node.lineno)
    return sorted(set(found))  # a nested function is walked from each enclosing one


def test_the_checker_flags_function_level_dtlab_imports_only():
    source = ("def f():\n    from dtlab.core import env\n\n"
              "def g():\n    # deferred: import cycle\n    from dtlab.core import env\n\n"
              "def h():\n    import json\n    from . import sibling\n\n"
              "from dtlab.core import config\n")
    assert function_imports(source) == [2, 6, 10]


def test_dtlab_imports_dtlab_at_module_level_only():
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line}"
                 for path in sorted(PACKAGE.rglob("*.py"))
                 for line in function_imports(path.read_text(encoding="utf-8"))]
    assert not offenders, f"move these imports to module level (untie the cycle they dodge): {offenders}"


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"split these modules by job: {long}"
