"""This machine's roofline, measured: GEMM throughput against shape, streaming bandwidth, eager PyTorch's fixed costs.

A *placement* is how a job's ranks sit on the cores: ``threads`` torch threads per process, ``copies``
processes at once (a ddp job of 2 ranks on 2 cores is 1 thread x 2 copies; ``single`` on both cores
is 2 threads x 1 copy). Copies share the cores, caches and memory bandwidth, so each placement is
measured as it runs: ``copies`` spawned processes started together behind a barrier
(``estimate.together``), the slower copy's time kept for each row; one copy runs in this process.

Each process measures, at its ``threads``:

* ``gemm``: ``torch.mm`` of fp32 (m x k) @ (k x n) over a grid of shapes (every combination of
  ``DIMS``), each the median of several timed batches of calls after a warm-up;
* ``stream``: a triad ``a = b + 2c`` (``torch.add(..., out=)``: 2 FLOPs per 12 bytes) and a copy at
  a few array sizes;
* ``dispatch``: a 1 x 1 ``torch.mm``, what calling a GEMM from Python costs before any arithmetic;
* ``loop``: dtlab's own training loop (the single tier, in this process) on tiny MLPs (width 4,
  batch 4, depths 1-8, SGD and Adam): every op there takes its fixed cost, not its roofline
  time, so each phase's median against its op count (``ops.job_ops``) gives eager PyTorch's
  cost per op and per step here (``cpu.fit_overhead``). Not one of the jobs predicted later.

``measure`` returns one DataFrame (``COLUMNS``); ``cpu.fit`` turns it into a ``Device`` per placement.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch

from dtlab.core.config import RunConfig
from dtlab.core.env import DistInfo
from dtlab.cost.roofline.cpu import BANDWIDTH_MIB
from dtlab.cost.roofline.ops import PHASES, by_phase, job_ops
from dtlab.launch.together import run_together
from dtlab.train.loop import train

__all__ = ["COLUMNS", "DIMS", "QUICK_DIMS", "STREAM_MIB", "default_placements", "measure", "measure_here"]

DIMS = (8, 32, 64, 128, 256, 512, 1024, 2048)  # every (m, n, k) of these: 512 shapes, 1 kFLOP to 17 GFLOP
QUICK_DIMS = (16, 128, 1024)
STREAM_MIB = (0.25, 1, 4, 16, 64)
QUICK_STREAM_MIB = (1, BANDWIDTH_MIB)
BUDGET_S, QUICK_BUDGET_S = 0.006, 0.003  # timed seconds per row and pass (at least 3 batches of calls)
# Another process on a core this one uses slows a row down, never speeds it up (on a shared 2-core machine a
# parallel op waits up to a scheduler slice, ~8 ms, for its second thread): every row is measured in two passes,
# some seconds apart, and the faster kept
PASSES, QUICK_PASSES = 2, 1
LOOP_DEPTHS, QUICK_LOOP_DEPTHS = (1, 2, 4, 8), (1, 4)
LOOP_STEPS, QUICK_LOOP_STEPS = 40, 15
COLUMNS = ("threads", "copies", "kind", "m", "n", "k", "array_mib", "optimizer", "depth", "phase", "ops",
           "flops", "bytes", "seconds")


def default_placements(cores: int | None = None) -> list[tuple[int, int]]:
    """(threads, copies) dtlab's ranks use on ``cores``: every divisor t of the cores alone (t x 1) and
    filling the cores (t x cores/t); on 2 cores: 1 x 1, 1 x 2 and 2 x 1."""
    c = int(cores or os.cpu_count() or 1)
    out = {(1, 1)}
    for t in range(1, c + 1):
        if c % t == 0:
            out |= {(t, 1), (t, c // t)}
    return sorted(out)


def _seconds(call: Callable[[], Any], budget_s: float) -> float:
    """Median seconds per call over batches of calls (a batch at least ~1 ms, so a timer's tick is small)."""
    call()
    t0 = time.perf_counter()
    call()
    once = max(time.perf_counter() - t0, 1e-7)
    per_batch = max(1, int(1e-3 / once))
    batches = max(3, min(15, int(budget_s / (once * per_batch))))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            call()
        times.append((time.perf_counter() - t0) / per_batch)
    return statistics.median(times)


def _gemms(dims: Sequence[int], budget_s: float) -> list[dict[str, Any]]:
    rows = []
    for m, n, k in itertools.product(dims, repeat=3):
        a, b = torch.randn(m, k), torch.randn(k, n)
        rows.append({"kind": "gemm", "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k,
                     "bytes": 4.0 * (m * k + k * n + m * n), "seconds": _seconds(lambda a=a, b=b: torch.mm(a, b),
                                                                                 budget_s)})
    return rows


def _streams(sizes_mib: Sequence[float], budget_s: float) -> list[dict[str, Any]]:
    rows = []
    for mib in sizes_mib:
        n = int(mib * 2**20 / 4)
        a, b, c = torch.empty(n), torch.randn(n), torch.randn(n)
        triad = _seconds(lambda a=a, b=b, c=c: torch.add(b, c, alpha=2.0, out=a), budget_s)
        copy = _seconds(lambda a=a, b=b: a.copy_(b), budget_s)
        rows += [{"kind": "triad", "array_mib": mib, "flops": 2.0 * n, "bytes": 12.0 * n, "seconds": triad},
                 {"kind": "copy", "array_mib": mib, "flops": 0.0, "bytes": 8.0 * n, "seconds": copy}]
    return rows


def _loop(depths: Sequence[int], steps: int, threads: int) -> list[dict[str, Any]]:
    """dtlab's loop on tiny MLPs, in this process: each phase's median seconds and its op count."""
    info = DistInfo(0, 0, 1, 1, "gloo", torch.device("cpu"))
    rows = []
    for optimizer, depth in itertools.product(("sgd", "adam"), depths):
        cfg = RunConfig(model="mlp", model_size=4, model_depth=depth, global_batch_size=4, dataset_size=256,
                        steps=steps, optimizer=optimizer, threads_per_rank=threads)
        steady = train(info, cfg).steps[steps // 3:]
        counts = {p: sum(op.count for op in ops) for p, ops in by_phase(job_ops(cfg)).items()}
        for phase in (*PHASES, "total"):
            rows.append({"kind": "loop", "optimizer": optimizer, "depth": depth, "phase": phase,
                         "ops": sum(counts.values()) if phase == "total" else counts.get(phase, 0),
                         "seconds": statistics.median(s[phase] for s in steady)})
    return rows


def _pass(threads: int, quick: bool) -> list[dict[str, Any]]:
    budget = QUICK_BUDGET_S if quick else BUDGET_S
    one = torch.ones(1, 1)
    rows = [{"kind": "dispatch", "seconds": _seconds(lambda: torch.mm(one, one), budget)}]
    rows += _streams(QUICK_STREAM_MIB if quick else STREAM_MIB, budget)
    rows += _gemms(QUICK_DIMS if quick else DIMS, budget)
    return rows + _loop(QUICK_LOOP_DEPTHS if quick else LOOP_DEPTHS, QUICK_LOOP_STEPS if quick else LOOP_STEPS,
                        threads)


def measure_here(threads: int, quick: bool = False) -> list[dict[str, Any]]:
    """Every row at ``threads`` torch threads, in this process (``threads`` restored after): the faster of
    ``PASSES`` passes (one when ``quick``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        passes = [_pass(threads, quick) for _ in range(QUICK_PASSES if quick else PASSES)]
    finally:
        torch.set_num_threads(before)
    return [{**row, "seconds": min(p[i]["seconds"] for p in passes)} for i, row in enumerate(passes[0])]


def _placement(threads: int, copies: int, quick: bool) -> list[dict[str, Any]]:
    if copies == 1:
        runs = [measure_here(threads, quick)]
    else:
        runs = run_together(measure_here, [(threads, quick)] * copies,
                            f"the roofline at {threads} thread(s) x {copies} copies")
    # the copies measured the same rows in the same order: keep the slower copy's time of each
    return [{**row, "seconds": max(run[i]["seconds"] for run in runs), "threads": threads, "copies": copies}
            for i, row in enumerate(runs[0])]


def measure(placements: Sequence[tuple[int, int]] | None = None, quick: bool = False,
            log: Callable[[str], None] = lambda line: None) -> pd.DataFrame:
    """Every row for each (threads, copies) placement (default: ``default_placements()``); ``quick``: fewer
    shapes, sizes and steps (a few seconds per placement, for tests). One DataFrame, ``COLUMNS``."""
    chosen = list(placements or default_placements())
    for threads, copies in chosen:
        if not (isinstance(threads, int) and isinstance(copies, int) and threads >= 1 and copies >= 1):
            raise ValueError(f"placement ({threads!r}, {copies!r}) is invalid: threads and copies are integers >= 1")
    rows = []
    for threads, copies in chosen:
        t0 = time.perf_counter()
        rows += _placement(threads, copies, quick)
        log(f"roofline: {threads} thread(s) x {copies} cop{'y' if copies == 1 else 'ies'} measured in "
            f"{time.perf_counter() - t0:.1f} s")
    return pd.DataFrame(rows).reindex(columns=list(COLUMNS))
