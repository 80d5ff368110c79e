"""dtlab: learn and measure PyTorch distributed training from Jupyter."""

from __future__ import annotations

__version__ = "0.1.0"

from dtlab.config import RunConfig
from dtlab.env import DistInfo
from dtlab.failures import CollectiveTimeout, RankError
from dtlab.instrument import CommRecorder
from dtlab.launch import launch, report, shutdown

__all__ = [
    "CollectiveTimeout",
    "CommRecorder",
    "DistInfo",
    "RankError",
    "RunConfig",
    "__version__",
    "launch",
    "report",
    "shutdown",
]
