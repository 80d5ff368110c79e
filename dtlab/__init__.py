"""dtlab: learn and measure PyTorch distributed training from Jupyter.

Every name below is imported on first use, so ``import dtlab`` (and the command
line's ``--help`` or a bad flag) answers before torch is loaded, and a rank
imports only what its tier needs.
"""

from __future__ import annotations

import importlib
from typing import Any

from dtlab import launch as _launch_package  # the package first, so the name `launch` below is the function
from dtlab.core.version import __version__

del launch  # noqa: F821 - the import above bound the subpackage here; dtlab.launch is the function (see _EXPORTS)
del _launch_package

# name -> (module, attribute); attribute None: the module itself.
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "CollectiveTimeout": ("dtlab.core.failures", "CollectiveTimeout"),
    "RankError": ("dtlab.core.failures", "RankError"),
    "RunConfig": ("dtlab.core.config", "RunConfig"),
    "DistInfo": ("dtlab.core.env", "DistInfo"),
    "environment_report": ("dtlab.core.env", "environment_report"),
    "report": ("dtlab.core.progress", "report"),
    "RunResult": ("dtlab.core.results", "RunResult"),
    "CommRecorder": ("dtlab.instrument.recorder", "CommRecorder"),
    "scratch_folder": ("dtlab.launch.lifeline", "scratch_folder"),
    "LaunchStopped": ("dtlab.launch.local", "LaunchStopped"),
    "launch": ("dtlab.launch.local", "launch"),
    "shutdown": ("dtlab.launch.local", "shutdown"),
    "run": ("dtlab.train.runner", "run"),
    "trace_step": ("dtlab.launch.traced", "step"),  # a step's end, in a script run by ``dtlab trace --step marker``
    "tiers": ("dtlab.tiers", None),
    "widgets": ("dtlab.app.widgets", None),  # ipywidgets is a notebook extra
    "exercises": ("dtlab.exercises", None),
    "estimate": ("dtlab.cost.estimate", "estimate"),  # pandas and fake tensors
    "predict": ("dtlab.app.predict", "predict"),
}


# The subpackages, reachable as attributes as once `import dtlab` had imported them all (dtlab.plots.gantt).
_PACKAGES = ("app", "core", "cost", "experiments", "instrument", "plots", "read", "train")


def __getattr__(name: str) -> Any:
    if name in _PACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dtlab' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = importlib.import_module(module)
    value = value if attribute is None else getattr(value, attribute)
    globals()[name] = value  # once found, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_PACKAGES})


__all__ = [
    "CollectiveTimeout",
    "CommRecorder",
    "DistInfo",
    "LaunchStopped",
    "RankError",
    "RunConfig",
    "RunResult",
    "__version__",
    "environment_report",
    "launch",
    "report",
    "run",
    "scratch_folder",
    "shutdown",
    "tiers",
    "trace_step",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext dtlab``: the ``%%ranks`` cell magic."""
    importlib.import_module("dtlab.app.ranks").load_ipython_extension(ipython)
