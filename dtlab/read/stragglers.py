"""Naming a straggler from when each rank arrives at each collective.

Step times cannot name a slow rank under DDP: every rank waits in the same
all-reduce, so every rank's step lasts as long as the slowest's. When each rank
*enters* a collective can: the k-th collective of a step is the same operation
on every rank, and the rank that enters it last is the one the others wait for.

``arrivals(result)`` lines the collectives up (one row per step, collective and
rank); ``straggler(result)`` names the rank that arrives last most often and
what it costs: per step, the longest any rank waited for the last arrival at a
collective of that step (the median over the steps after warm-up). A rank made
slow on purpose (``RunConfig.slow_rank="1:5ms"``) is named with about 5 ms.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from dtlab.core.results import RunResult

P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})


def arrivals(result: RunResult) -> pd.DataFrame:
    """Per (step, index, rank): the op and when the rank entered it, for collectives every rank made.

    ``index`` counts a rank's collectives within the step; ``wait_s`` is how long
    that rank waited for the last one to arrive (0 for the last).
    """
    ev = result.events_frame()
    world = len(result.ranks)
    columns = ["step", "index", "op", "rank", "start", "wait_s", "last"]
    if ev.empty or world < 2:
        return pd.DataFrame(columns=columns)
    ev = ev[(ev["step"] >= 0) & ~ev["op"].isin(P2P_OPS) & (ev["group_size"] == world)]
    ev = ev.sort_values(["rank", "start"], kind="stable").copy()
    ev["index"] = ev.groupby(["rank", "step"]).cumcount()
    complete = ev.groupby(["step", "index"])["rank"].transform("nunique") == world
    ev = ev[complete]
    latest = ev.groupby(["step", "index"])["start"].transform("max")
    ev["wait_s"] = latest - ev["start"]
    ev["last"] = ev["start"] == latest
    return ev[columns].reset_index(drop=True)


def straggler(result: RunResult, warmup_steps: int = 1) -> dict[str, Any]:
    """The rank the others wait for: ``rank``, ``last_share`` (the share of collectives it entered last),
    ``cost_per_step_s`` (median over steps of the longest wait for the last arrival) and ``collectives``."""
    df = arrivals(result)
    df = df[df["step"] >= df["step"].min() + warmup_steps] if not df.empty else df
    if df.empty:
        return {"rank": None, "last_share": 0.0, "cost_per_step_s": 0.0, "collectives": 0}
    last = df[df["last"]]
    counts = last["rank"].value_counts()
    total = int(df.groupby(["step", "index"]).ngroups)
    cost = df.groupby("step")["wait_s"].max().median()
    return {"rank": int(counts.index[0]), "last_share": float(counts.iloc[0] / total),
            "cost_per_step_s": float(cost), "collectives": total}


def arrival_skew(result: RunResult) -> pd.DataFrame:
    """Per step: the longest wait for the last arrival and the rank that arrived last (for a plot)."""
    df = arrivals(result)
    if df.empty:
        return pd.DataFrame(columns=["step", "skew_s", "last_rank"])
    worst = df.loc[df.groupby("step")["wait_s"].idxmax()]
    last = df[df["last"]].groupby("step")["rank"].agg(lambda s: int(s.mode().iloc[0]))
    return pd.DataFrame({"step": worst["step"].to_numpy(), "skew_s": worst["wait_s"].to_numpy(),
                         "last_rank": last.reindex(worst["step"]).to_numpy()})
