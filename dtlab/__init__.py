"""dtlab: learn and measure PyTorch distributed training from Jupyter."""

from __future__ import annotations

__version__ = "0.1.0"

from dtlab.config import RunConfig
from dtlab.env import DistInfo, environment_report
from dtlab.failures import CollectiveTimeout, RankError
from dtlab.instrument import CommRecorder
from dtlab.launcher import LaunchStopped, launch, report, shutdown
from dtlab.results import RunResult
from dtlab.train import run


def __getattr__(name: str):  # dtlab.widgets on first use: ipywidgets is a notebook extra
    if name == "widgets":
        import importlib

        return importlib.import_module("dtlab.widgets")
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
    "shutdown",
]
