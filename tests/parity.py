"""The parity job every tier is compared on, and its single-device baseline (run once per session)."""

from __future__ import annotations

import functools

from dtlab import RunConfig
from dtlab.core.results import RunResult
from dtlab.train import run

# The float32 bound of the parity tests that import it. Measured on one x86_64 CPU model (an AVX-512 AMD EPYC
# gives gaps of the same size on these jobs, but 1.4e-2 on a 4-stage pipeline job of 20 Adam steps at lr 0.01,
# which test_pipeline therefore checks in float64) over the jobs that use it: SGD <= 1.2e-7 (at most 1 float32
# ulp of the largest parameter), Adam at lr 0.01 on the mlp <= 2.4e-7 (6.4 ulps), Adam at lr 0.003 on the
# charformer 1.7e-6 to 5.6e-6 (3.5 to 11 ulps). The charformer's Adam tests lower lr to 0.003 because at 0.01
# the same jobs end 5.6e-6 to 2.0e-5 apart (Adam's lr-sized steps where a gradient is near zero): at that lr
# only float64 tells a bug from rounding, and tests/test_parity_float64.py runs every tier there within 1e-10.
TOL = 1e-5
LR = {"sgd": 0.05, "adam": 0.01}


def job(optimizer: str, **changes) -> RunConfig:
    base = dict(steps=20, optimizer=optimizer, lr=LR[optimizer], global_batch_size=64, threads_per_rank=1)
    return RunConfig(**{**base, **changes})


@functools.cache
def single(optimizer: str, model: str = "mlp", dataset: str = "digits") -> RunResult:
    return run(job(optimizer, model=model, dataset=dataset), progress=False)
