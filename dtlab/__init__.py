"""dtlab: learn and measure PyTorch distributed training from Jupyter."""

from __future__ import annotations

import importlib
from typing import Any

from dtlab import tiers  # registers every tier: RunConfig checks jobs against the registry
from dtlab.core.config import RunConfig
from dtlab.core.env import DistInfo, environment_report
from dtlab.core.failures import CollectiveTimeout, RankError
from dtlab.core.progress import report
from dtlab.core.results import RunResult
from dtlab.core.version import __version__
from dtlab.instrument.recorder import CommRecorder
from dtlab.launch.lifeline import scratch_folder
from dtlab.launch.local import LaunchStopped, launch, shutdown
from dtlab.train import run


def __getattr__(name: str) -> Any:  # dtlab.widgets on first use: ipywidgets is a notebook extra
    if name == "widgets":
        return importlib.import_module("dtlab.app.widgets")
    if name == "exercises":
        return importlib.import_module("dtlab.exercises")
    if name == "estimate":  # pandas and fake tensors: loaded when asked for
        return importlib.import_module("dtlab.cost.estimate").estimate
    if name == "predict":
        return importlib.import_module("dtlab.app.predict").predict
    raise AttributeError(f"module 'dtlab' has no attribute {name!r}")


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
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext dtlab``: the ``%%ranks`` cell magic."""
    importlib.import_module("dtlab.app.ranks").load_ipython_extension(ipython)
