"""Collective sweeps: time and bus bandwidth against message size, by the nccl-tests definitions.

One module serves notebook 02, ``benchmarks/collective_bandwidth.py`` and the
cost model's calibration (``costmodel.calibrate``). Times come from the
CommRecorder's own events, so what is plotted is exactly what the recorder
sees in training runs. The machine's memory-copy bandwidth, measured in the
same run, is the limit a single-machine collective is compared with.

How repeats become one time per message size, so that a shared machine's
hiccups do not reach the result (``sweep_plan``, ``outliers``, ``size_medians``):

* the repeats are **interleaved**: round after round, each round runs every
  (op, size) once in a shuffled order, so a burst of load from elsewhere
  slows a round -- one repeat of many sizes -- not every repeat of the sizes
  that happened to be running;
* a repeat's time is its **slowest rank's** (a collective is done when the
  last rank is);
* the **outlier rule** drops a repeat more than ``OUTLIER_MADS`` (3) scaled
  MADs slower than its size's median, the scaled MAD counting as at least
  ``MAD_FLOOR`` (2 %) of the median;
* a size's time is the **median** of the repeats left.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from dtlab.core.comm import bus_factor
from dtlab.core.config import shared_threads
from dtlab.instrument.recorder import active
from dtlab.launch.local import launch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
DEFAULT_SIZES = tuple(4 ** k * 1024 for k in range(0, 8))  # 1 KiB ... 16 MiB
# for an alpha-beta fit: 1 KiB ... 16 MiB a factor of 2 apart, 15 sizes on both sides of the latency-bandwidth
# crossover (a few hundred KiB for gloo on loopback), so the small ones set alpha and the large ones beta
CALIBRATION_SIZES = tuple(2 ** k * 1024 for k in range(0, 15))
# a smoke-test calibration: few sizes, but still up to 16 MiB, where the per-byte cost stands out of a loaded
# machine's noise (a sweep stopping at 4 MiB once fitted beta <= 0, which ends a calibration)
QUICK_CALIBRATION_SIZES, QUICK_CALIBRATION_REPEATS = (4096, 65536, 1 << 20, 4 << 20, 16 << 20), 5
POINT = ["op", "bytes", "group_size"]  # one sweep point: a message size of one op at one group size
OUTLIER_MADS = 3.0  # a repeat more than this many scaled MADs slower than its point's median is dropped ...
MAD_FLOOR = 0.02  # ... the scaled MAD counting as at least 2 % of the median: none within 6 % is ever dropped


def _run_op(op: str, nbytes: int, rank: int, world: int) -> None:
    numel = max(1, nbytes // 4)
    if op == "all_reduce":
        dist.all_reduce(torch.ones(numel))
    elif op == "broadcast":
        dist.broadcast(torch.ones(numel), src=0)
    elif op == "all_gather":  # nbytes is the gathered output, as in nccl-tests
        dist.all_gather_into_tensor(torch.empty(numel // world * world), torch.ones(numel // world))
    elif op == "reduce_scatter":  # nbytes is the full input
        dist.reduce_scatter_tensor(torch.empty(numel // world), torch.ones(numel // world * world))
    elif op == "send_recv":  # a ring: each rank sends to the next and receives from the previous
        ops = [dist.P2POp(dist.isend, torch.ones(numel), (rank + 1) % world),
               dist.P2POp(dist.irecv, torch.empty(numel), (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:
        raise ValueError(f"unknown op {op!r}: choose from {', '.join(OPS)}")


def sweep_plan(ops: tuple[str, ...], sizes: tuple[int, ...], repeats: int) -> list[tuple[int, str, int]]:
    """The order the sweep runs in: ``(repeat, op, nbytes)``, round after round.

    Each round runs every (op, size) once, shuffled by a generator seeded with
    the round number (every rank draws the same order, and no size always
    follows the same one).
    """
    pairs = [(op, nbytes) for op in ops for nbytes in sizes]
    return [(rep, op, nbytes) for rep in range(repeats) for op, nbytes in random.Random(rep).sample(pairs, len(pairs))]


def sweep_rank(info: Any, ops: tuple[str, ...], sizes: tuple[int, ...], repeats: int,
               threads: int = 1) -> list[dict[str, Any]]:
    """Run on every rank (``dtlab.launch(sweep_rank, n, args=...)``): a warm-up round, then ``sweep_plan``.

    ``threads``: torch's threads in this rank, as a training run sets them. More
    than the rank's share of the cores slows the collectives themselves: the
    tensor fills between them wake OpenMP workers, which keep spinning on the
    cores gloo's threads need (measured at world 2 on 2 cores with torch's
    default 2 threads per rank: 14.4-14.7 ms against 8.6-9.4 ms for 8 MiB).
    """
    rec = active()
    if rec is None:
        raise RuntimeError("sweep_rank needs the CommRecorder: launch it with record=True")
    torch.set_num_threads(threads)
    for op in ops:
        for nbytes in sizes:
            _run_op(op, nbytes, info.rank, info.world_size)  # warm-up: connections, allocations
    rows = []
    for rep, op, nbytes in sweep_plan(ops, sizes, repeats):
        dist.barrier()
        first = len(rec.events)
        _run_op(op, nbytes, info.rank, info.world_size)
        events = rec.events[first:]
        # the recorder's own clock: first start to last end of this op's events
        seconds = max(e.end or e.start for e in events) - min(e.start for e in events)
        moved = sum(e.bytes for e in events if e.op != "irecv")
        rows.append({"rank": info.rank, "op": op, "bytes": moved, "repeat": rep, "seconds": seconds,
                     "group_size": info.world_size, "threads": torch.get_num_threads()})
    return rows


def memcpy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """The machine's tensor copy bandwidth in bytes/s (read + write counted once, as nccl-tests' limit)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    best = min(_timed_copy(dst, src) for _ in range(repeats))
    return nbytes / best


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


# -- repeats: the slowest rank, the outlier rule, the median per size -------------------------------------------
def outliers(seconds: Any, k: float = OUTLIER_MADS) -> np.ndarray:
    """The outlier rule: True for the repeats more than ``k`` scaled MADs slower than their median.

    The scaled MAD (1.4826 x the median absolute deviation: the standard
    deviation, for normal noise) counts as at least ``MAD_FLOOR`` of the
    median, so near-identical repeats are all kept. One-sided: what another
    process, a page fault or the scheduler does to a collective only adds
    time, so a fast repeat is the collective's own cost and stays. At least
    half of the repeats always stay (half lie within one MAD of the median).
    """
    x = np.asarray(seconds, dtype=float)
    med = float(np.median(x))
    scale = max(1.4826 * float(np.median(np.abs(x - med))), MAD_FLOOR * abs(med))
    return x - med > k * scale


def mark_outliers(frame: pd.DataFrame, k: float = OUTLIER_MADS) -> pd.DataFrame:
    """A per-repeat sweep (columns op, bytes, group_size, repeat, seconds; rank optional) with ``outlier`` marked.

    With a rank column a repeat's time is its slowest rank's; then ``outliers``
    marks the repeats of each point (op, bytes, group_size).
    """
    if "rank" in frame.columns:
        frame = frame.groupby([*POINT, "repeat"], as_index=False)["seconds"].max()
    out = frame.loc[:, [*POINT, "repeat", "seconds"]].reset_index(drop=True)
    out["outlier"] = out.groupby(POINT)["seconds"].transform(lambda s: outliers(s.to_numpy(), k)).astype(bool)
    return out


def size_medians(frame: pd.DataFrame, k: float = OUTLIER_MADS) -> pd.DataFrame:
    """One row per point of a per-repeat sweep: the median over the repeats the outlier rule keeps.

    Columns op, bytes, group_size, seconds (that median), repeats (measured),
    dropped (left out by ``outliers``) and spread (the kept repeats' scaled
    MAD relative to their median).
    """
    marked = mark_outliers(frame, k)
    kept = marked[~marked["outlier"]].groupby(POINT)["seconds"]
    out = kept.median().rename("seconds").to_frame()
    out["repeats"] = marked.groupby(POINT).size()
    out["dropped"] = marked.groupby(POINT)["outlier"].sum().astype(int)
    out["spread"] = kept.agg(lambda s: 1.4826 * float((s - s.median()).abs().median()) / float(s.median()))
    return out.reset_index()


def per_size(frame: pd.DataFrame, k: float = OUTLIER_MADS) -> pd.DataFrame:
    """``size_medians`` of a per-repeat sweep with the bandwidths: algbw and busbw (bytes/s, nccl-tests)."""
    out = size_medians(frame, k)
    out["algbw"] = out["bytes"] / out["seconds"]
    factors = [bus_factor(op, n) for op, n in zip(out["op"], out["group_size"])]
    out["busbw"] = out["algbw"] * pd.Series(factors, index=out.index)
    return out


def sweep(world_size: int = 2, ops: tuple[str, ...] = OPS, sizes: tuple[int, ...] = DEFAULT_SIZES,
          repeats: int = 5, *, per_repeat: bool = False, threads_per_rank: int = 0, **launch_kwargs: Any) -> Any:
    """Time and bandwidth per (op, size): interleaved repeats, the slowest rank of each, outliers dropped.

    Returns a DataFrame (``per_size``): op, bytes, group_size, seconds (the
    median of the repeats the outlier rule keeps), repeats, dropped, spread,
    algbw and busbw (bytes/s). ``per_repeat=True`` returns the repeats
    instead (``mark_outliers``: op, bytes, group_size, repeat, seconds of the
    slowest rank, outlier), which ``costmodel.calibrate`` can also resample.
    ``threads_per_rank``: torch threads in each rank, 0 (the default) for the
    machine's cores divided among the ranks, as ``RunConfig`` resolves it: a
    link calibrated so prices the collectives of runs that share the cores alike.
    """
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}: choose from {', '.join(OPS)}")
    if world_size < 2:
        raise ValueError(f"world_size={world_size} is invalid: a collective needs at least 2 ranks")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is invalid: must be an integer >= 1")
    if not isinstance(threads_per_rank, int) or threads_per_rank < 0:
        raise ValueError(f"threads_per_rank={threads_per_rank!r} is invalid: must be an integer >= 0 (0 = automatic)")
    threads = threads_per_rank or shared_threads(world_size)
    per_rank = launch(sweep_rank, world_size, args=(tuple(ops), tuple(sizes), repeats, threads), progress=False,
                      **launch_kwargs)
    df = pd.DataFrame([row for rows in per_rank for row in rows])
    return mark_outliers(df) if per_repeat else per_size(df)
