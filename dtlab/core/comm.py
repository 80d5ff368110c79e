"""Recorded communication: the event layout, bandwidth definitions, and tables and traces of events.

The recorders (``dtlab.instrument``) produce events in this layout; results,
analysis and plots read them. Bandwidths follow nccl-tests' definitions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The columns of an event row (``dtlab.instrument.events.Event.row``); ``group`` is the process group's name.
FIELDS = ("rank", "seq", "op", "bytes", "dtype", "group_size", "group", "peer", "start", "end", "wait_s", "async",
          "tag", "step")

# Collectives whose nccl-tests bus-bandwidth factor is 2(n-1)/n, (n-1)/n or 1.
_BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth (1 for broadcast, p2p...)."""
    if n <= 1:
        return 0.0 if op in _BUS_FACTORS else 1.0
    return _BUS_FACTORS.get(op, lambda _n: 1.0)(n)


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: the message size over the time."""
    return nbytes / seconds if seconds > 0 else float("nan")


def busbw(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes/s, by the nccl-tests definitions."""
    return algbw(nbytes, seconds) * bus_factor(op, n)


def events_frame(rows: list[dict[str, Any]]) -> Any:
    """Events as a DataFrame with duration and bandwidth columns (bytes/s)."""
    import pandas as pd

    # e.g. the RPC recorder's caller, an all-to-all's split sizes (only its rows have them)
    extra = list(dict.fromkeys(k for row in rows for k in row if k not in FIELDS))
    df = pd.DataFrame(rows, columns=list(FIELDS) + extra)
    df["duration_s"] = df["end"] - df["start"]
    dur = df["duration_s"].where(df["duration_s"] > 0)
    df["algbw"] = df["bytes"] / dur
    factors = [bus_factor(op, int(n)) for op, n in zip(df["op"], df["group_size"])]
    df["busbw"] = df["algbw"] * pd.Series(factors, index=df.index, dtype=float)
    return df


def chrome_trace(events: list[dict[str, Any]], phases: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """Chrome trace JSON (opens in Perfetto or chrome://tracing): one process per rank."""
    if not events and not phases:
        return {"traceEvents": []}
    t0 = min([e["start"] for e in events] + [p["start"] for p in phases])
    out = []
    for p in phases:
        out.append({"name": p["phase"], "cat": "compute", "ph": "X", "pid": int(p["rank"]), "tid": "compute",
                    "ts": (p["start"] - t0) * 1e6, "dur": (p["end"] - p["start"]) * 1e6,
                    "args": {"step": p["step"]}})
    for e in events:
        out.append({"name": e["op"], "cat": "comm", "ph": "X", "pid": int(e["rank"]), "tid": "comm",
                    "ts": (e["start"] - t0) * 1e6, "dur": max(0.0, e["end"] - e["start"]) * 1e6,
                    "args": {k: e[k] for k in ("bytes", "dtype", "group_size", "peer", "wait_s", "tag", "step",
                                               "input_splits", "output_splits") if k in e}})
    for rank in sorted({int(x["pid"]) for x in out}):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}
