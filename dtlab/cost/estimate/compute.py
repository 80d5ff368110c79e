"""A pipeline's stages timed bare, and this machine's copy speed: compute sides of a predicted step.

A step's arithmetic does not depend on how ranks talk, so it is timed on this
machine, with the threads a rank of the job would get: each stage at one
micro-batch, forward (with the loss on the last), backward, the optimizer over
its slice, each the median of a few repeats after a warm-up. For a job of n
ranks, n copies are timed at once in child processes (``together``), since the
ranks share the machine. (The other tiers time a rank through dtlab's own loop:
``probe``.) No distributed run is looked at: what is predicted is never what
was fitted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.core.job import build_job, make_optimizer
from dtlab.launch.together import run_together
from dtlab.tiers import pipeline

REPEATS = 15  # the median of 15: a burst of load moves fewer than half of them
WARMUP = 3


@contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _median_phases(step: Callable[[], dict[str, float]], repeats: int) -> dict[str, float]:
    for _ in range(WARMUP):
        step()
    runs = [step() for _ in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def stage_phases(cfg: RunConfig, repeats: int = REPEATS, ranks: int = 1) -> list[dict[str, float]]:
    """Per pipeline stage: forward and backward seconds of one micro-batch, the optimizer over its slice,
    and ``out_bytes``, what it sends to the next stage per micro-batch; with ``ranks`` > 1, every stage
    timed in that many processes at once, each time the slowest one's."""
    if ranks > 1:
        runs = run_together(stage_phases, [(cfg, repeats)] * ranks, f"timing {ranks} ranks' stages")
        return [{k: max(run[s][k] for run in runs) for k in runs[0][s]} for s in range(len(runs[0]))]
    model, data = build_job(cfg, torch.device("cpu"))
    stages = pipeline.split_model(model, cfg.world_size, cfg.model_depth)
    micro = cfg.global_batch_size // cfg.tier_options.microbatches
    x, y = data.train_x[:micro].clone(), data.train_y[:micro].clone()
    out = []
    with threads(cfg.resolved_threads):
        for s, stage in enumerate(stages):
            optimizer = make_optimizer(cfg, stage)
            out.append(_stage(stage, optimizer, x, y if s == len(stages) - 1 else None, repeats))
            x = stage(x).detach()
    return out


def _stage(stage: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor | None,
           repeats: int) -> dict[str, float]:
    def step() -> dict[str, float]:
        xin = x.detach().requires_grad_(x.is_floating_point())
        t0 = time.perf_counter()
        out = stage(xin)
        loss = models.loss(out, y) if y is not None else out
        t1 = time.perf_counter()
        if y is not None:
            loss.backward()
        else:
            out.backward(torch.ones_like(out))  # the gradient that comes back from the next stage
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": time.perf_counter() - t2,
                "out_bytes": float(out.numel() * out.element_size()) if y is None else 0.0}

    return _median_phases(step, repeats)


def copy_seconds_per_byte(nbytes: int = 1 << 24, repeats: int = 5) -> float:
    """This machine's memory copy time per byte (one read and one write), the median of a few copies."""
    src, dst = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / nbytes
