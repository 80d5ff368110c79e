"""Starting ranks: dtlab's local launcher, torchrun agents, RPC workers, simulated hosts and clusters.

Every launcher keeps one contract (``dtlab.launch.contract``): it takes ``LaunchOptions``
and returns a ``LaunchResult``. The names below are imported on first use: a torchrun
agent or ``dtlab clean`` needs no forkserver (and ``import dtlab`` no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"LaunchOptions": "contract", "LaunchResult": "contract", "LaunchStopped": "contract",
            "launch": "local", "shutdown": "local"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dtlab.launch' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = ["LaunchOptions", "LaunchResult", "LaunchStopped", "launch", "shutdown"]
