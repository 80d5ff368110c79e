"""Errors in a widget callback go to the panel's log: ipywidgets would drop them silently."""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["guarded"]


def guarded(log: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with any exception's traceback appended to ``log`` (an ``ipywidgets.Output``) instead of raised."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:
            log.append_stderr(traceback.format_exc())
            return None

    return wrapped
