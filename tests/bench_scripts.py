"""A benchmark script imported as a module, for tests of its functions (``benchmarks/`` is not a package)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported (its own ``import _common`` resolved there), the path left as it was."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
