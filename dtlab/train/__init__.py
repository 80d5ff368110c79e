"""Training: the strategy-free loop each rank runs, and ``run(cfg)``, which launches it."""

from dtlab.core.job import build_job, optimizer_factory
from dtlab.train.loop import train
from dtlab.train.runner import preflight, run

__all__ = ["build_job", "optimizer_factory", "preflight", "run", "train"]
