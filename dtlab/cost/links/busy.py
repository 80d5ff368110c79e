"""What a collective costs inside a step beyond what the link's sweep says: ``busy_s``.

A sweep times collectives back to back on otherwise idle cores. In a training step the ranks compute
between collectives, and each collective is a meeting point: it waits for the later rank (whose
compute jittered), and the backend's transport threads must be woken and scheduled on cores the
ranks keep busy. On this 2-core machine a 64 KiB all-reduce between ~5 ms of matrix products cost
0 to 3.8 ms more than the same products plus the all-reduce's price (gloo, world 2), depending on
the run and the machine's load: calibrate it in the session it is used in.

A small gloo collective here is also bimodal: it takes about 0.5 ms, or 2-3 ms more when a rank's
sleeping thread has to be woken (in one 7-repeat sweep, 2026-12-04, 14-71 % of the calls per size up to
1 MiB were slow). A sweep's fit drops the slow calls as outliers and prices the fast mode; a step that
makes ten collectives pays the mean. So each mode's time in a round is the mean of its iterations, and
``with_busy`` takes the excess over the link's *price* of the same all-reduce: price + excess is then
what that all-reduce costs in a busy step, the wake-ups included.

``calibrate_busy`` measures that excess on a synthetic job, never on a training run: each rank
alternates a fixed amount of compute with one all-reduce (``both``), and the same job also times the
compute alone and the all-reduce alone, in shuffled rounds. The excess per collective is
``both - compute - collective`` per round (each the slowest rank's mean iteration; ``collective`` the
all-reduce timed alone, or a price given in its place), and the result is the median over rounds.
``LinkModel.busy_s`` and ``LinkSet.busy_s`` carry
it; ``dtlab.cost.estimate`` adds it once per collective the training thread blocks on. The excess
grows with the work before the meeting, so ``with_busy`` measures it after 5 ms and after 0.5 ms
(``busy_short_s``), and ``busy_at`` gives it for the work in between, as FSDP's close collectives pay it.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dtlab.core.config import shared_threads
from dtlab.cost.links.alpha_beta import LinkModel
from dtlab.cost.links.linkset import LinkSet
from dtlab.launch.local import launch

__all__ = ["BUSY_COMPUTE_S", "BUSY_MODES", "BUSY_NBYTES", "BUSY_ROUNDS", "BUSY_SHORT_COMPUTE_S", "busy_at",
           "busy_excess", "busy_rank", "calibrate_busy", "with_busy"]

BUSY_MODES = ("compute", "collective", "both")
_MATRIX = 256  # one product of two 256 x 256 matrices: about 0.4 ms on one core here
# Six calls each on this machine (2026-12-04, world 2): 7 rounds gave 0.20-3.25 ms, 25 rounds 0.65-1.87 ms
# (twelve calls), 50 rounds 0.77-1.74 ms. 25 rounds, about 8 s, keeps most of what more rounds would buy.
BUSY_ROUNDS = 25
# The compute between collectives that busy_s and busy_short_s are measured after. A rank's lead grows with
# the work before the meeting: here, 25 rounds each (2026-12-04, four calls), 0.5 ms gave 0.04-0.63 ms,
# 1.6 ms 0.22-1.14 ms and 5 ms 0.64-1.60 ms.
BUSY_COMPUTE_S, BUSY_SHORT_COMPUTE_S = 5e-3, 0.5e-3
BUSY_NBYTES = 64 * 1024  # the synthetic job's all-reduce: a price for it must be of this size


def _compute_kernels(target_s: float) -> int:
    """How many matrix products take about ``target_s`` on this rank (rank 0's count is used by all)."""
    a = torch.randn(_MATRIX, _MATRIX)
    for _ in range(3):
        a @ a
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    return max(1, round(target_s / ((time.perf_counter() - t0) / 10)))


def busy_rank(info: Any, nbytes: int, compute_s: float, rounds: int, iterations: int,
              threads: int) -> list[dict[str, Any]]:
    """Run on every rank (``dtlab.launch(busy_rank, n, args=...)``): each round times every mode's
    ``iterations`` in a shuffled order; a row per (round, mode) with this rank's mean iteration."""
    torch.set_num_threads(threads)  # as a training rank: more threads than cores would time the oversubscription
    kernels = torch.tensor([_compute_kernels(compute_s)])
    dist.broadcast(kernels, src=0)  # every rank does the same work
    a, t = torch.randn(_MATRIX, _MATRIX), torch.ones(max(1, nbytes // 4))

    def compute() -> None:
        for _ in range(int(kernels)):
            a @ a

    def collective() -> None:
        dist.all_reduce(t)

    def both() -> None:
        compute()
        collective()

    modes: dict[str, Callable[[], None]] = {"compute": compute, "collective": collective, "both": both}
    for fn in modes.values():  # warm-up: connections, allocations
        fn()
    rows = []
    for rnd in range(rounds):
        for mode in random.Random(rnd).sample(BUSY_MODES, len(BUSY_MODES)):
            dist.barrier()
            times = []
            for _ in range(iterations):
                t0 = time.perf_counter()
                modes[mode]()
                times.append(time.perf_counter() - t0)
            # the mean: a step pays every slow wake-up of its collectives, which a median would leave out
            rows.append({"rank": info.rank, "round": rnd, "mode": mode, "seconds": statistics.fmean(times)})
    return rows


def busy_excess(rows: Sequence[dict[str, Any]], collective_s: float | None = None) -> float:
    """Seconds per collective beyond compute + collective timed apart: per round, each mode's slowest rank,
    ``both - compute - collective``; the median over rounds. Over the ``collective`` timed alone it is never
    below zero. ``collective_s`` (a link's price for the all-reduce) stands in for the timed ``collective``
    when given, and then the excess may be negative: where the fit overprices the all-reduce, price + excess
    is still what it costs in the step."""
    slowest: dict[tuple[int, str], float] = {}
    for row in rows:
        key = (row["round"], row["mode"])
        slowest[key] = max(slowest.get(key, 0.0), row["seconds"])
    rounds = sorted({rnd for rnd, _ in slowest})
    missing = [(rnd, m) for rnd in rounds for m in BUSY_MODES if (rnd, m) not in slowest]
    if not rounds or missing:
        raise ValueError(f"busy_excess: every round needs the modes {BUSY_MODES}; missing {missing or 'all'}")
    excess = statistics.median(slowest[r, "both"] - slowest[r, "compute"]
                               - (slowest[r, "collective"] if collective_s is None else collective_s) for r in rounds)
    return max(0.0, excess) if collective_s is None else excess


def calibrate_busy(world_size: int = 2, *, nbytes: int = BUSY_NBYTES, compute_s: float = BUSY_COMPUTE_S,
                   rounds: int = BUSY_ROUNDS, iterations: int = 20, threads: int | None = None,
                   price_s: float | None = None, **launch_kwargs: Any) -> float:
    """Seconds a collective costs in a busy step beyond the same collective timed alone (``busy_excess`` of a
    synthetic job at ``world_size``: ``compute_s`` of matrix products, then a ``nbytes`` all-reduce), with
    ``threads`` torch threads per rank (default: the cores shared out, as ``RunConfig`` does); with
    ``price_s`` (a link's price for that all-reduce), the excess over the price instead, which may be
    negative (``busy_excess``). About 8 s at the default ``rounds``."""
    if world_size < 2:
        raise ValueError(f"world_size={world_size} is invalid: a collective needs at least 2 ranks")
    threads = threads or shared_threads(world_size)
    for name, value in (("rounds", rounds), ("iterations", iterations), ("nbytes", nbytes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
    if not compute_s > 0:
        raise ValueError(f"compute_s={compute_s!r} is invalid: must be > 0 seconds")
    launch_kwargs.setdefault("record", False)  # as an unrecorded training run: no wrapper around the all-reduce
    per_rank = launch(busy_rank, world_size, args=(nbytes, compute_s, rounds, iterations, threads), progress=False,
                      **launch_kwargs)
    return busy_excess([row for rows in per_rank for row in rows], collective_s=price_s)


def with_busy(link: LinkModel | LinkSet, world_size: int = 2, *, nbytes: int = BUSY_NBYTES,
              **kwargs: Any) -> LinkModel | LinkSet:
    """``link`` with both busy figures: ``busy_s`` after ``BUSY_COMPUTE_S`` of compute, ``busy_short_s`` after
    ``BUSY_SHORT_COMPUTE_S`` (``calibrate_busy`` twice; its keywords apply). Each is the excess over the
    link's own price for the synthetic all-reduce, so that price + excess is what the all-reduce costs in a
    busy step, its slow wake-ups included: the fit prices the fast mode (see the module's doc). Where the
    fit overprices it (an all_reduce alpha of 1223 us, fit RMS 100 %, was seen), the excess comes out
    negative and takes the overshoot back, instead of being cut at zero."""
    price = link.predict("all_reduce", nbytes, world_size)
    return dataclasses.replace(
        link, busy_s=calibrate_busy(world_size, nbytes=nbytes, compute_s=BUSY_COMPUTE_S, price_s=price, **kwargs),
        busy_short_s=calibrate_busy(world_size, nbytes=nbytes, compute_s=BUSY_SHORT_COMPUTE_S, price_s=price,
                                    **kwargs))


def busy_at(link: LinkModel | LinkSet, compute_s: float) -> float:
    """A collective's busy excess after ``compute_s`` of work since the last one: straight between
    ``busy_short_s`` (at ``BUSY_SHORT_COMPUTE_S``) and ``busy_s`` (at ``BUSY_COMPUTE_S``), held at either end;
    ``busy_s`` wherever ``busy_short_s`` was not measured (NaN)."""
    long_s, short_s = float(link.busy_s), float(link.busy_short_s)
    if math.isnan(short_s):
        return long_s
    at = min(max(compute_s, BUSY_SHORT_COMPUTE_S), BUSY_COMPUTE_S)
    return short_s + (long_s - short_s) * (at - BUSY_SHORT_COMPUTE_S) / (BUSY_COMPUTE_S - BUSY_SHORT_COMPUTE_S)
