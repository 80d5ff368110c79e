"""Derived tables from RunResults: overlap of communication with compute, memory and time breakdowns, the steady
step, activation checkpointing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dtlab.core.results import RunResult

MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "activations")


def comm_overlap(result: RunResult) -> Any:
    """Per communication event: how much of it ran while the same rank was still computing backward.

    DDP starts a bucket's all-reduce as soon as its gradients are ready; the part
    that runs before backward's compute ends is hidden, the rest is exposed and
    adds to the step time. The loop's "backward" phase also contains DDP's final
    wait for the buckets, so for DDP the compute is taken to end when the last
    bucket is launched (its gradients were the last to be ready).
    """
    events = result.events_frame()
    phases = result.phases_frame()
    backward = phases[phases["phase"] == "backward"].groupby(["rank", "step"]).agg(
        bwd_start=("start", "min"), bwd_end=("end", "max")).reset_index()
    df = events[events["step"] >= 0].merge(backward, on=["rank", "step"], how="left")
    buckets = df["tag"].astype(str).str.startswith("ddp_bucket")
    last_launch = df[buckets].groupby(["rank", "step"])["start"].max().rename("last_launch").reset_index()
    df = df.merge(last_launch, on=["rank", "step"], how="left")
    compute_end = df["bwd_end"].where(~buckets, df[["last_launch", "bwd_end"]].min(axis=1))
    hidden = (_series_min(df["end"], compute_end) - df[["start", "bwd_start"]].max(axis=1)).clip(lower=0)
    df["compute_end"] = compute_end
    df["overlap_s"] = hidden.fillna(0.0)
    df["exposed_s"] = df["duration_s"] - df["overlap_s"]
    df["overlap_fraction"] = (df["overlap_s"] / df["duration_s"].where(df["duration_s"] > 0)).fillna(0.0)
    return df[["rank", "step", "op", "tag", "bytes", "start", "end", "duration_s", "overlap_s", "exposed_s",
               "overlap_fraction"]]


def _series_min(a: Any, b: Any) -> Any:
    """Element-wise minimum of two Series (NaN where either is NaN)."""
    return a.where(a < b, b).where(a.notna() & b.notna())


def memory_frame(results: list[RunResult], ranks: int | None = None) -> Any:
    """One row per (run, rank): the memory parts in bytes, labelled for plots.memory_breakdown."""
    import pandas as pd

    rows = []
    for r in results:
        for rank in r.ranks[:ranks]:
            rows.append({"label": f"{r.label} rank {rank.rank}", "tier": r.config.tier,
                         "world_size": r.config.world_size, "rank": rank.rank,
                         **{k: rank.memory.get(k, 0) for k in (*MEMORY_PARTS, "peak_rss")}})
    return pd.DataFrame(rows)


def breakdown_frame(results: list[RunResult]) -> Any:
    """One row per run: median seconds per phase (for plots.step_breakdown)."""
    import pandas as pd

    return pd.DataFrame([{"label": r.label, **r.phase_medians()} for r in results])


def dataparallel_lanes(result: RunResult, step: int) -> Any:
    """One step of a ``dp`` run as lanes: the master thread and each replica thread (for plots.gantt)."""
    phases = result.phases_frame()
    df = phases[(phases["step"] == step) & (phases["phase"] != "forward")].copy()
    replica = df["phase"].str.extract(r"^dp_forward:(\d+)$")[0]
    df["lane"] = ("replica " + replica).where(replica.notna(), "master")
    df["phase"] = df["phase"].str.replace(r"^dp_", "", regex=True).str.replace(r":\d+$", "", regex=True)
    return df.sort_values(["lane", "start"], key=lambda c: c if c.name != "lane" else c != "master")


def steady_step_s(result: RunResult, column: str = "total") -> float:
    """Median over the steady steps of the slowest rank's ``column`` (seconds): what a step costs once warm."""
    return float(result.steady().groupby("step")[column].max().median())


def checkpointing_table(runs: Mapping[tuple[str, bool], RunResult]) -> Any:
    """One row per run of ``(tier, checkpointing) -> result``: rank 0's activations, the steady step, the part
    recomputed, and the largest parameter difference from the same tier without checkpointing (0 expected:
    recomputation changes what is kept, not what is computed). For ``plots.checkpointing``."""
    import pandas as pd

    rows = []
    for (tier, ac), r in runs.items():
        rows.append({"run": f"{tier}{' + checkpointing' if ac else ''}",
                     "activations_MB": r.ranks[0].memory["activations"] / 1e6,
                     "step_ms": steady_step_s(r) * 1e3,
                     "recompute_ms": steady_step_s(r, "recompute") * 1e3 if ac else 0.0,
                     "diff_vs_without": r.max_param_diff(runs[(tier, False)])})
    return pd.DataFrame(rows)
