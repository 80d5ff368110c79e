"""How a data set of one's own is named in results and in errors.

Apart from ``dtlab.core.own_data`` (which loads and checks the tensors) because
``RunConfig`` names a data set without importing torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["invalid", "label"]


def label(spec: str | Callable[..., Any]) -> str:
    """How errors and results name the data set: the import path, or the callable's name."""
    if isinstance(spec, str):
        return spec
    target = getattr(spec, "func", spec)  # functools.partial: name the function
    return getattr(target, "__qualname__", type(target).__name__)


def invalid(spec: str | Callable[..., Any], what: str) -> ValueError:
    """The one-line error for this data set: ``RunConfig.dataset=... is invalid: what``."""
    if isinstance(spec, str):
        shown = repr(spec)
    else:
        kind = "function" if inspect.isfunction(getattr(spec, "func", spec)) else "callable"
        shown = f"<{kind} {label(spec)}>"
    return ValueError(f"RunConfig.dataset={shown} is invalid: {what}")
