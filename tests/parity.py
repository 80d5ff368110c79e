"""The parity job every tier is compared on, and its single-device baseline (run once per session)."""

from __future__ import annotations

import functools

from dtlab import RunConfig
from dtlab.core.results import RunResult
from dtlab.train import run

TOL = 1e-5
LR = {"sgd": 0.05, "adam": 0.01}


def job(optimizer: str, **changes) -> RunConfig:
    base = dict(steps=20, optimizer=optimizer, lr=LR[optimizer], global_batch_size=64, threads_per_rank=1)
    return RunConfig(**{**base, **changes})


@functools.cache
def single(optimizer: str, model: str = "mlp", dataset: str = "digits") -> RunResult:
    return run(job(optimizer, model=model, dataset=dataset), progress=False)
