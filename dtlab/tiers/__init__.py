"""The tiers: one module per tier, each a small diff of its predecessor.

A tier module holds ``Options`` (a frozen dataclass of its knobs), ``validate(cfg)``
(pure: raises ValueError naming the field), its ``Strategy`` (the hooks the
training loop calls) and ``SPEC``, the ``TierSpec`` that declares them. A tier's
module is imported when its tier is first asked for (``get``), or as
``dtlab.tiers.NAME``: importing this package imports no tier, so a rank that runs
``ddp`` never loads DTensor or the pipelining schedules.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from dtlab.core import registry
from dtlab.core.registry import TierSpec

TIERS: tuple[str, ...] = registry.COURSE


def get(name: str) -> TierSpec:
    """The tier called ``name`` (ValueError listing the tiers otherwise)."""
    return registry.get(name)


def __getattr__(name: str) -> ModuleType:  # dtlab.tiers.fsdp and the like, imported on first use
    if name.startswith("_"):
        raise AttributeError(f"module 'dtlab.tiers' has no attribute {name!r}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'dtlab.tiers' has no attribute {name!r}") from None


__all__ = ["TIERS", "get"]
