"""Collective sweeps: time and bus bandwidth against message size, by the nccl-tests definitions.

One module serves notebook 09 and ``benchmarks/collective_bandwidth.py``. Times
come from the CommRecorder's own events, so what is plotted is exactly what the
recorder sees in training runs. The machine's memory-copy bandwidth, measured in
the same run, is the limit a single-machine collective is compared with.
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from dtlab.core.comm import BYTES, END, OP, START, bus_factor
from dtlab.instrument.recorder import active
from dtlab.launch.local import launch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
DEFAULT_SIZES = tuple(4 ** k * 1024 for k in range(0, 8))  # 1 KiB ... 16 MiB


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


def sweep_rank(info: Any, ops: tuple[str, ...], sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """Run on every rank (``dtlab.launch(sweep_rank, n, args=...)``): each op, size and repeat once."""
    rec = active()
    if rec is None:
        raise RuntimeError("sweep_rank needs the CommRecorder: launch it with record=True")
    rows = []
    for op in ops:
        for nbytes in sizes:
            _run_op(op, nbytes, info.rank, info.world_size)  # warm-up: connections, allocations
            for rep in range(repeats):
                dist.barrier()
                first = len(rec.events)
                _run_op(op, nbytes, info.rank, info.world_size)
                events = rec.events[first:]
                # the recorder's own clock: first start to last end of this op's events
                seconds = max(e[END] or e[START] for e in events) - min(e[START] for e in events)
                moved = sum(e[BYTES] for e in events if e[OP] != "irecv")
                rows.append({"rank": info.rank, "op": op, "bytes": moved, "repeat": rep, "seconds": seconds,
                             "group_size": info.world_size})
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


def sweep(world_size: int = 2, ops: tuple[str, ...] = OPS, sizes: tuple[int, ...] = DEFAULT_SIZES,
          repeats: int = 5, **launch_kwargs: Any) -> Any:
    """Median time and bandwidth per (op, size), the slowest rank of each repeat counting.

    Returns a DataFrame: op, bytes, seconds, algbw and busbw (bytes/s), group_size.
    """
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}: choose from {', '.join(OPS)}")
    if world_size < 2:
        raise ValueError(f"world_size={world_size} is invalid: a collective needs at least 2 ranks")
    per_rank = launch(sweep_rank, world_size, args=(tuple(ops), tuple(sizes), repeats), progress=False,
                      **launch_kwargs)
    df = pd.DataFrame([row for rows in per_rank for row in rows])
    slowest = df.groupby(["op", "bytes", "repeat", "group_size"], as_index=False)["seconds"].max()
    out = slowest.groupby(["op", "bytes", "group_size"], as_index=False)["seconds"].median()
    out["algbw"] = out["bytes"] / out["seconds"]
    factors = [bus_factor(op, n) for op, n in zip(out["op"], out["group_size"])]
    out["busbw"] = out["algbw"] * pd.Series(factors, index=out.index)
    return out
