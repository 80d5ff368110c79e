"""Figures of runs: speedup, step breakdown, timelines, memory and loss."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dtlab.plots.style import (
    LINESTYLES,
    MEMORY_COLORS,
    OP_PALETTE,
    PHASE_COLORS,
    TIER_PALETTE,
    bar_height,
    bottom_legend,
    byte_unit,
    color_map,
    figure,
    require,
    stacked_barh,
)


# -- 1. speedup -------------------------------------------------------------------
def _speedup_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Median throughput per (tier, world size) with speedup and efficiency (%) columns."""
    agg = df.groupby(["tier", "world_size"], as_index=False, sort=False)["samples_per_s"].median()
    single = agg.loc[agg["tier"] == "single", "samples_per_s"]
    if len(single):
        base = pd.Series(float(single.iloc[0]), index=agg.index)
    else:
        ones = agg[agg["world_size"] == 1].set_index("tier")["samples_per_s"]
        missing = sorted(set(agg["tier"]) - set(ones.index))
        if missing:
            raise ValueError(f"speedup: no 'single' row and no world_size 1 row for tier(s) {missing}")
        base = agg["tier"].map(ones)
    agg["speedup"] = agg["samples_per_s"] / base
    agg["efficiency"] = 100 * agg["speedup"] / agg["world_size"]
    return agg.sort_values(["tier", "world_size"], kind="stable")


def speedup(df: pd.DataFrame) -> Figure:
    """Speedup and parallel efficiency vs world size, one line per tier.

    ``df``: columns tier, world_size, samples_per_s. The baseline is the ``tier == "single"``
    row, or, without one, each tier's own world_size 1 row. Repeated runs are medianed.
    """
    require(df, ("tier", "world_size", "samples_per_s"), "speedup")
    agg = _speedup_frame(df)
    tiers = list(pd.unique(df["tier"]))
    colors = color_map(tiers, {}, TIER_PALETTE)
    worlds = sorted(agg["world_size"].unique())
    fig = figure(3.8)
    ax_s, ax_e = fig.subplots(1, 2)
    ax_s.plot([1, max(worlds)], [1, max(worlds)], "k--", lw=1, label="ideal")
    ax_e.axhline(100, color="k", ls="--", lw=1, label="ideal")
    for tier in tiers:
        rows = agg[agg["tier"] == tier]
        style = {"color": colors[tier], "marker": "o", "label": tier}
        ax_s.plot(rows["world_size"], rows["speedup"], **style)
        ax_e.plot(rows["world_size"], rows["efficiency"], **style)
    ax_s.set(title="Speedup", xlabel="world size (processes)", ylabel="speedup (× one process)")
    ax_e.set(title="Efficiency", xlabel="world size (processes)", ylabel="efficiency (% of ideal)",
             ylim=(0, max(110, agg["efficiency"].max() * 1.1)))
    for ax in (ax_s, ax_e):
        ax.set_xticks(worlds)
        ax.grid(alpha=0.3)
    fig.suptitle("Scaling: throughput relative to one process")
    bottom_legend(fig, ax_s)
    return fig


# -- 2. step breakdown ------------------------------------------------------------
STEP_PHASES = ("data", "forward", "backward", "comm", "optimizer")


def step_breakdown(df: pd.DataFrame) -> Figure:
    """Where a training step's time goes: one stacked bar per run, in ms.

    ``df``: one row per run, columns label and the phase times in seconds: data, forward,
    backward, comm, optimizer and, optionally, idle.
    """
    require(df, ("label", *STEP_PHASES), "step_breakdown")
    phases = [*STEP_PHASES, *(["idle"] if "idle" in df.columns else [])]
    parts = {p: df[p].fillna(0).to_numpy(float) * 1e3 for p in phases}
    fig = figure(bar_height(len(df)))
    ax = fig.subplots()
    stacked_barh(ax, df["label"].astype(str).tolist(), parts, PHASE_COLORS, "ms")
    ax.set(title="Time per training step by phase", xlabel="time per step (ms)")
    ax.grid(axis="x", alpha=0.3)
    bottom_legend(fig, ax, max_cols=6)
    return fig


# -- 3. timeline ------------------------------------------------------------------
def _select_steps(df: pd.DataFrame, step: int | Iterable[int] | None) -> pd.DataFrame:
    if step is None or df.empty:
        return df
    steps = [step] if isinstance(step, (int, np.integer)) else list(step)
    return df[df["step"].isin(steps)]


def _steps_name(step: int | Iterable[int] | None) -> str:
    if step is None:
        return "all steps"
    if isinstance(step, (int, np.integer)):
        return f"step {step}"
    steps = list(step)
    return f"steps {steps[0]}–{steps[-1]}" if steps == list(range(steps[0], steps[-1] + 1)) else f"steps {steps}"


def _lane(ax: Axes, df: pd.DataFrame, key: str, y: np.ndarray, t0: float, min_ms: float,
          colors: Mapping[str, str]) -> None:
    for name, rows in df.groupby(key, sort=False):
        start = (rows["start"].to_numpy(float) - t0) * 1e3
        # Instant events (async launches) would have zero width and vanish; keep them visible.
        width = np.maximum((rows["end"].to_numpy(float) - rows["start"].to_numpy(float)) * 1e3, min_ms)
        # white edges keep back-to-back bars (consecutive buckets) apart
        ax.barh(y[rows.index], width, left=start, height=0.36, color=colors[name], label=str(name),
                edgecolor="white", linewidth=0.6)


def timeline(events: pd.DataFrame | None, phases: pd.DataFrame, step: int | Iterable[int] | None = None,
             event_color: str = "op") -> Figure:
    """Per-rank Gantt chart: compute phases in one lane, communication ops in a second.

    ``phases``: columns rank, phase, start, end, step; ``events``: columns rank, op, start,
    end, step (bytes and tag are not drawn). start/end are absolute seconds on one clock;
    the x axis is ms since the earliest shown start. ``step`` picks one step, or a list or
    range of steps. ``events`` may be empty or None. ``event_color="tag"`` colours
    communication by tag instead of op (one colour per DDP bucket).
    """
    require(phases, ("rank", "phase", "start", "end", "step"), "timeline phases")
    events = pd.DataFrame() if events is None else events
    if not events.empty:
        require(events, ("rank", "op", "start", "end", "step"), "timeline events")
    phases = _select_steps(phases, step).reset_index(drop=True)
    events = _select_steps(events, step).reset_index(drop=True)
    if phases.empty and events.empty:
        raise ValueError(f"timeline: nothing recorded for step {step!r}")
    shown = [df for df in (phases, events) if not df.empty]
    t0 = min(float(df["start"].min()) for df in shown)
    span_ms = max((float(df["end"].max()) - t0) * 1e3 for df in shown)
    ranks = sorted(pd.unique(pd.concat([df["rank"] for df in shown])))
    row = {r: i for i, r in enumerate(ranks)}

    fig = figure(max(2.8, 1.6 + 0.75 * len(ranks)))
    ax = fig.subplots()
    min_ms = span_ms * 0.002
    if not phases.empty:
        ph_colors = color_map(pd.unique(phases["phase"]), PHASE_COLORS, OP_PALETTE)
        _lane(ax, phases, "phase", phases["rank"].map(row).to_numpy() - 0.2, t0, min_ms, ph_colors)
    if not events.empty:
        op_colors = color_map(pd.unique(events[event_color]), {}, OP_PALETTE)
        _lane(ax, events, event_color, events["rank"].map(row).to_numpy() + 0.2, t0, min_ms, op_colors)
    for i in range(1, len(ranks)):
        ax.axhline(i - 0.5, color="0.8", lw=0.8)
    ticks = [y for i in range(len(ranks)) for y in (i - 0.2, i + 0.2)]
    ax.set_yticks(ticks, [f"rank {r} {lane}" for r in ranks for lane in ("compute", "comm")])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span_ms * 1.01)
    note = "" if not events.empty else ", no communication events"
    ax.set(title=f"Per-rank timeline ({_steps_name(step)}{note})", xlabel="time since first shown start (ms)")
    ax.grid(axis="x", alpha=0.3)
    bottom_legend(fig, ax, max_cols=6)
    return fig


def gantt(df: pd.DataFrame, lane: str = "lane", color_by: str = "phase", title: str = "Timeline") -> Figure:
    """A Gantt chart with one row per value of ``lane`` (threads, replicas, pipeline stages).

    ``df``: columns ``lane``, ``color_by``, start and end (absolute seconds); the x axis
    is ms since the earliest start. Rows keep the order in which lanes first appear.
    """
    require(df, (lane, color_by, "start", "end"), "gantt")
    df = df.reset_index(drop=True)
    lanes = list(pd.unique(df[lane]))
    row = {name: i for i, name in enumerate(lanes)}
    t0 = float(df["start"].min())
    span_ms = (float(df["end"].max()) - t0) * 1e3
    fig = figure(max(2.4, 1.4 + 0.45 * len(lanes)))
    ax = fig.subplots()
    colors = color_map(pd.unique(df[color_by]), PHASE_COLORS, OP_PALETTE)
    _lane(ax, df, color_by, df[lane].map(row).to_numpy().astype(float), t0, span_ms * 0.002, colors)
    ax.set_yticks(range(len(lanes)), [str(x) for x in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set(title=title, xlabel="time since first shown start (ms)")
    ax.grid(axis="x", alpha=0.3)
    bottom_legend(fig, ax, max_cols=6)
    return fig


# -- 4. memory --------------------------------------------------------------------
MEMORY_KINDS = ("parameters", "gradients", "optimizer_state", "activations")


def memory_breakdown(df: pd.DataFrame) -> Figure:
    """Memory per label by kind, as stacked bars in KiB, MiB or GiB (whichever fits the data).

    ``df``: columns label, parameters, gradients, optimizer_state, activations (bytes).
    """
    require(df, ("label", *MEMORY_KINDS), "memory_breakdown")
    raw = {k: df[k].fillna(0).to_numpy(float) for k in MEMORY_KINDS}
    unit, scale = byte_unit(float(sum(raw.values()).max()))
    fig = figure(bar_height(len(df)))
    ax = fig.subplots()
    stacked_barh(ax, df["label"].astype(str).tolist(), {k: v / scale for k, v in raw.items()}, MEMORY_COLORS, unit)
    ax.set(title="Memory by kind", xlabel=f"memory ({unit})")
    ax.grid(axis="x", alpha=0.3)
    bottom_legend(fig, ax)
    return fig


# -- 5. loss ----------------------------------------------------------------------
def loss_curves(curves: Mapping[str, pd.Series]) -> Figure:
    """Training loss per step, one line per run.

    ``curves``: label -> Series of the global training loss indexed by step.
    """
    if not curves:
        raise ValueError("loss_curves: no curves given")
    fig = figure(3.6)
    ax = fig.subplots()
    for i, (label, series) in enumerate(curves.items()):
        # Equivalent runs give identical curves; varied dashes and widths keep each one visible.
        ax.plot(series.index, series.to_numpy(float), label=str(label), ls=LINESTYLES[i % len(LINESTYLES)],
                lw=max(0.8, 2.4 - 0.4 * i))
    ax.set(title="Training loss", xlabel="step", ylabel="training loss (cross-entropy)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(loc="best")
    return fig
