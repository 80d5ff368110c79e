"""Plots: a DataFrame in, a matplotlib Figure out.

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so no global
state is touched: they render headless (Agg) and display in notebooks when returned
as a cell's value. All figures are sized for a notebook (7.5 inches wide).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator

WIDTH = 7.5  # inches: the width of a notebook's output area
DPI = 120

# Fixed colours, so a phase looks the same in every figure.
PHASE_COLORS = {
    "data": "tab:gray",
    "forward": "tab:blue",
    "backward": "tab:orange",
    "comm": "tab:red",
    "optimizer": "tab:green",
    "idle": "lightgray",
}
MEMORY_COLORS = {
    "parameters": "tab:blue",
    "gradients": "tab:orange",
    "optimizer_state": "tab:green",
    "activations": "tab:purple",
}
# Communication ops get colours unused by the phases, so the two lanes never look alike.
OP_PALETTE = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "gold", "navy", "teal")
TIER_PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:cyan")
LINESTYLES = ("-", "--", ":", "-.")


# -- helpers ----------------------------------------------------------------------
def _figure(height: float) -> Figure:
    return Figure(figsize=(WIDTH, height), layout="constrained")


def _require(df: pd.DataFrame, columns: Iterable[str], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{what}: missing column(s) {missing}; got {list(df.columns)}")
    if df.empty:
        raise ValueError(f"{what}: the DataFrame is empty")


def _colors(names: Iterable[str], fixed: Mapping[str, str], palette: Sequence[str]) -> dict[str, str]:
    """A colour per name: the fixed one where known, else the next from the palette."""
    spare = itertools.cycle([c for c in palette if c not in fixed.values()])
    return {name: fixed.get(name) or next(spare) for name in names}


def _byte_unit(max_bytes: float) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if max_bytes >= scale:
            return unit, scale
    return "KiB", 2**10


def _bytes_tick(x: float, _pos: int | None = None) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:g} {unit}"
    return f"{x:g} B"


def _bottom_legend(fig: Figure, ax: Axes, max_cols: int = 5) -> None:
    # Below the plot, outside the axes: a legend there never hides data.
    handles, labels = ax.get_legend_handles_labels()
    rows = math.ceil(len(labels) / max_cols)
    fig.legend(handles, labels, loc="outside lower center", ncol=math.ceil(len(labels) / rows), frameon=False)


def _stacked_barh(ax: Axes, labels: Sequence[str], parts: Mapping[str, np.ndarray], colors: Mapping[str, str],
                  unit: str) -> None:
    """Horizontal stacked bars, first label on top, each bar's total written at its end."""
    y = np.arange(len(labels))
    left = np.zeros(len(labels))
    for name, values in parts.items():
        ax.barh(y, values, left=left, color=colors[name], label=name, height=0.6)
        left += values
    for yi, total in zip(y, left):
        ax.text(total, yi, f" {total:.3g} {unit}", va="center", fontsize=8)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlim(0, left.max() * 1.18 if left.max() > 0 else 1)  # room for the totals


def _bar_height(n: int) -> float:
    return max(2.6, 1.6 + 0.45 * n)


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
    _require(df, ("tier", "world_size", "samples_per_s"), "speedup")
    agg = _speedup_frame(df)
    tiers = list(pd.unique(df["tier"]))
    colors = _colors(tiers, {}, TIER_PALETTE)
    worlds = sorted(agg["world_size"].unique())
    fig = _figure(3.8)
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
    _bottom_legend(fig, ax_s)
    return fig


# -- 2. step breakdown ------------------------------------------------------------
STEP_PHASES = ("data", "forward", "backward", "comm", "optimizer")


def step_breakdown(df: pd.DataFrame) -> Figure:
    """Where a training step's time goes: one stacked bar per run, in ms.

    ``df``: one row per run, columns label and the phase times in seconds: data, forward,
    backward, comm, optimizer and, optionally, idle.
    """
    _require(df, ("label", *STEP_PHASES), "step_breakdown")
    phases = [*STEP_PHASES, *(["idle"] if "idle" in df.columns else [])]
    parts = {p: df[p].fillna(0).to_numpy(float) * 1e3 for p in phases}
    fig = _figure(_bar_height(len(df)))
    ax = fig.subplots()
    _stacked_barh(ax, df["label"].astype(str).tolist(), parts, PHASE_COLORS, "ms")
    ax.set(title="Time per training step by phase", xlabel="time per step (ms)")
    ax.grid(axis="x", alpha=0.3)
    _bottom_legend(fig, ax, max_cols=6)
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
    _require(phases, ("rank", "phase", "start", "end", "step"), "timeline phases")
    events = pd.DataFrame() if events is None else events
    if not events.empty:
        _require(events, ("rank", "op", "start", "end", "step"), "timeline events")
    phases = _select_steps(phases, step).reset_index(drop=True)
    events = _select_steps(events, step).reset_index(drop=True)
    if phases.empty and events.empty:
        raise ValueError(f"timeline: nothing recorded for step {step!r}")
    shown = [df for df in (phases, events) if not df.empty]
    t0 = min(float(df["start"].min()) for df in shown)
    span_ms = max((float(df["end"].max()) - t0) * 1e3 for df in shown)
    ranks = sorted(pd.unique(pd.concat([df["rank"] for df in shown])))
    row = {r: i for i, r in enumerate(ranks)}

    fig = _figure(max(2.8, 1.6 + 0.75 * len(ranks)))
    ax = fig.subplots()
    min_ms = span_ms * 0.002
    if not phases.empty:
        ph_colors = _colors(pd.unique(phases["phase"]), PHASE_COLORS, OP_PALETTE)
        _lane(ax, phases, "phase", phases["rank"].map(row).to_numpy() - 0.2, t0, min_ms, ph_colors)
    if not events.empty:
        op_colors = _colors(pd.unique(events[event_color]), {}, OP_PALETTE)
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
    _bottom_legend(fig, ax, max_cols=6)
    return fig


def gantt(df: pd.DataFrame, lane: str = "lane", color_by: str = "phase", title: str = "Timeline") -> Figure:
    """A Gantt chart with one row per value of ``lane`` (threads, replicas, pipeline stages).

    ``df``: columns ``lane``, ``color_by``, start and end (absolute seconds); the x axis
    is ms since the earliest start. Rows keep the order in which lanes first appear.
    """
    _require(df, (lane, color_by, "start", "end"), "gantt")
    df = df.reset_index(drop=True)
    lanes = list(pd.unique(df[lane]))
    row = {name: i for i, name in enumerate(lanes)}
    t0 = float(df["start"].min())
    span_ms = (float(df["end"].max()) - t0) * 1e3
    fig = _figure(max(2.4, 1.4 + 0.45 * len(lanes)))
    ax = fig.subplots()
    colors = _colors(pd.unique(df[color_by]), PHASE_COLORS, OP_PALETTE)
    _lane(ax, df, color_by, df[lane].map(row).to_numpy().astype(float), t0, span_ms * 0.002, colors)
    ax.set_yticks(range(len(lanes)), [str(x) for x in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set(title=title, xlabel="time since first shown start (ms)")
    ax.grid(axis="x", alpha=0.3)
    _bottom_legend(fig, ax, max_cols=6)
    return fig


# -- 4. memory --------------------------------------------------------------------
MEMORY_KINDS = ("parameters", "gradients", "optimizer_state", "activations")


def memory_breakdown(df: pd.DataFrame) -> Figure:
    """Memory per label by kind, as stacked bars in KiB, MiB or GiB (whichever fits the data).

    ``df``: columns label, parameters, gradients, optimizer_state, activations (bytes).
    """
    _require(df, ("label", *MEMORY_KINDS), "memory_breakdown")
    raw = {k: df[k].fillna(0).to_numpy(float) for k in MEMORY_KINDS}
    unit, scale = _byte_unit(float(sum(raw.values()).max()))
    fig = _figure(_bar_height(len(df)))
    ax = fig.subplots()
    _stacked_barh(ax, df["label"].astype(str).tolist(), {k: v / scale for k, v in raw.items()}, MEMORY_COLORS, unit)
    ax.set(title="Memory by kind", xlabel=f"memory ({unit})")
    ax.grid(axis="x", alpha=0.3)
    _bottom_legend(fig, ax)
    return fig


# -- 5. loss ----------------------------------------------------------------------
def loss_curves(curves: Mapping[str, pd.Series]) -> Figure:
    """Training loss per step, one line per run.

    ``curves``: label -> Series of the global training loss indexed by step.
    """
    if not curves:
        raise ValueError("loss_curves: no curves given")
    fig = _figure(3.6)
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


# -- 6. bandwidth -----------------------------------------------------------------
BW_NAMES = {"busbw": "bus bandwidth", "algbw": "algorithm bandwidth"}


def bandwidth(df: pd.DataFrame, limit_gbps: float | None = None, limit_label: str = "memcpy",
              metric: str = "busbw") -> Figure:
    """Bandwidth (GB/s, 1 GB = 1e9 bytes) vs message size, one line per op (median per size).

    ``df``: columns op, bytes and ``metric`` (bytes/s: "busbw", default, or "algbw");
    an events DataFrame works as is. With several group_size values, each gets its own
    line. ``limit_gbps`` draws a horizontal reference line named ``limit_label``.
    Rows with no bytes or no bandwidth (zero duration) are skipped.
    """
    if metric not in BW_NAMES:
        raise ValueError(f"bandwidth: metric must be one of {list(BW_NAMES)}, got {metric!r}")
    _require(df, ("op", "bytes", metric), "bandwidth")
    df = df[(df["bytes"] > 0) & df[metric].notna()]
    if df.empty:
        raise ValueError(f"bandwidth: no rows with bytes > 0 and a {metric} value")
    split = "group_size" in df.columns and df["group_size"].nunique() > 1
    keys = ["op", "group_size"] if split else ["op"]
    fig = _figure(3.8)
    ax = fig.subplots()
    for key, rows in df.groupby(keys, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        med = rows.groupby("bytes")[metric].median() / 1e9
        label = f"{key[0]} ({int(key[1])} ranks)" if split else str(key[0])
        ax.plot(med.index, med.to_numpy(), marker="o", ms=4, label=label)
    if limit_gbps is not None:
        ax.axhline(limit_gbps, color="k", ls="--", lw=1, label=f"{limit_label} ({limit_gbps:g} GB/s)")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=9))
    ax.xaxis.set_major_formatter(FuncFormatter(_bytes_tick))
    ax.set_ylim(bottom=0)
    ax.set(title=f"Collective {BW_NAMES[metric]} vs message size", xlabel="message size (bytes, log scale)",
           ylabel=f"{BW_NAMES[metric]} (GB/s)")
    ax.grid(alpha=0.3, which="both")
    _bottom_legend(fig, ax)
    return fig


# -- 7. predicted vs measured -----------------------------------------------------
def predicted_vs_measured(df: pd.DataFrame, tolerance: float = 0.15, log: bool = False) -> Figure:
    """Predicted vs measured time (ms) per label, with the y = x line and a ±15 % band.

    ``df``: columns label, predicted_s, measured_s. ``log`` uses log axes, for times that
    span orders of magnitude.
    """
    _require(df, ("label", "predicted_s", "measured_s"), "predicted_vs_measured")
    measured = df["measured_s"].to_numpy(float) * 1e3
    predicted = df["predicted_s"].to_numpy(float) * 1e3
    hi = max(measured.max(), predicted.max()) * 1.15
    lo = min(measured.min(), predicted.min()) / 1.15 if log else 0.0
    x = np.geomspace(lo, hi, 50) if log else np.linspace(lo, hi, 50)
    fig = _figure(4.2)
    ax = fig.subplots()
    ax.fill_between(x, x * (1 - tolerance), x * (1 + tolerance), color="0.85", label=f"±{tolerance:.0%} band")
    ax.plot(x, x, "k--", lw=1, label="perfect prediction (y = x)")
    for label, rows in df.assign(_m=measured, _p=predicted).groupby("label", sort=False):
        ax.scatter(rows["_m"], rows["_p"], s=36, zorder=3, label=str(label))
    if log:
        ax.set(xscale="log", yscale="log")
    # Equal limits keep y = x on the diagonal; no equal aspect, so the axes can use the figure's width.
    ax.set(xlim=(lo, hi), ylim=(lo, hi), title="Predicted vs measured step time",
           xlabel="measured (ms)", ylabel="predicted (ms)")
    ax.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", frameon=False)
    return fig


def sweep(df: pd.DataFrame, x: str, y: str, *, title: str, xlabel: str, ylabel: str, logx: bool = True,
          annotate: str | None = None) -> Figure:
    """One measured quantity against one knob (bucket size, micro-batches, message size).

    The best (lowest) point is marked; ``annotate`` names a column written beside
    each point (e.g. the number of buckets a cap gave).
    """
    _require(df, (x, y) + ((annotate,) if annotate else ()), "sweep")
    df = df.sort_values(x)
    fig = _figure(3.2)
    ax = fig.subplots()
    ax.plot(df[x], df[y], marker="o", color="tab:blue")
    best = df.loc[df[y].idxmin()]
    ax.plot([best[x]], [best[y]], marker="*", markersize=14, color="tab:red", linestyle="none",
            label=f"best: {best[x]:g}")
    if annotate:
        for xv, yv, note in zip(df[x], df[y], df[annotate]):  # iterrows would turn ints into floats
            ax.annotate(str(note), (xv, yv), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    if logx:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))  # 0.001, 1, 25 rather than 10^k
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.set_ylim(0, float(df[y].max()) * 1.2)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return fig


# -- 7b. the network and elastic runs ---------------------------------------------
LINK_COLORS = {"compute and hidden comm": "tab:blue", "exposed comm": "tab:red"}


def link_sweep(df: pd.DataFrame) -> Figure:
    """DDP step time per (link cap, comm hook), split into compute and exposed communication (ms).

    ``df``: ``dtlab.linksweep.link_sweep``'s frame (label, step_ms, exposed_comm_ms,
    comm_mb_per_step). Each bar's end gives the step time; the MB sent per step is
    written beside the label.
    """
    _require(df, ("label", "step_ms", "exposed_comm_ms", "comm_mb_per_step"), "link_sweep")
    exposed = df["exposed_comm_ms"].clip(lower=0).to_numpy(float)
    step = df["step_ms"].to_numpy(float)
    parts = {"compute and hidden comm": np.clip(step - exposed, 0, None), "exposed comm": np.minimum(exposed, step)}
    labels = [f"{lab} ({mb:.2g} MB/step)" for lab, mb in zip(df["label"].astype(str), df["comm_mb_per_step"])]
    fig = _figure(_bar_height(len(df)))
    ax = fig.subplots()
    _stacked_barh(ax, labels, parts, LINK_COLORS, "ms")
    ax.set(title="DDP step time by link cap and gradient compression", xlabel="time per step (ms)")
    ax.grid(axis="x", alpha=0.3)
    _bottom_legend(fig, ax)
    return fig


# kind -> (legend name, color, marker); kinds not listed are not drawn
TIMELINE_MARKERS = {
    "node_start": ("agent started", "black", "s"),
    "worker_start": ("worker started", "tab:gray", "^"),
    "process_group_ready": ("process group ready", "tab:cyan", "|"),
    "begin": ("training begins", "tab:green", ">"),
    "resume": ("resumed from snapshot", "tab:olive", "*"),
    "snapshot": ("snapshot saved", "tab:orange", "D"),
    "waiting_for_join": ("waiting for a node", "tab:purple", "o"),
    "oom_answer": ("OOM answered (accumulation x2)", "tab:pink", "P"),
    "fault": ("injected fault", "red", "X"),
    "worker_error": ("worker failed", "darkred", "x"),
    "worker_finish": ("worker finished", "black", "|"),
}


def elastic_timeline(df: pd.DataFrame) -> Figure:
    """An elastic run's events on one time axis: one lane per rank (and one for the agents).

    ``df``: ``dtlab.tiers.elastic.timeline``'s frame (t_s, kind, rank, attempt,
    world_size, step). Steps are drawn as bars per rank and phase; each phase -- an
    attempt at one world size (a node joining changes the world without a
    restart, so the attempt number stays) -- is shaded and labelled, so a restart
    (the gap after a fault) and a change of world size read directly off the plot.
    """
    _require(df, ("t_s", "kind", "rank"), "elastic_timeline")
    ranks = sorted(int(r) for r in df["rank"].dropna().unique())
    lanes = ["agents", *[f"rank {r}" for r in ranks]]
    lane_of = {r: i + 1 for i, r in enumerate(ranks)}
    y = df["rank"].map(lambda r: 0 if pd.isna(r) else lane_of[int(r)])
    fig = _figure(max(2.8, 1.9 + 0.5 * len(lanes)))
    ax = fig.subplots()
    phase = [c for c in ("attempt", "world_size") if c in df.columns]
    if phase:
        for i, (key, rows) in enumerate(df.dropna(subset=phase).groupby(phase)):
            values = dict(zip(phase, key if isinstance(key, tuple) else (key,)))
            t0, t1 = float(rows["t_s"].min()), float(rows["t_s"].max())
            ax.axvspan(t0, t1, color="0.93" if i % 2 == 0 else "0.86", zorder=0)
            text = "\n".join(f"{name} {int(values[c])}" for c, name in (("attempt", "attempt"), ("world_size", "world"))
                              if c in values)
            ax.text((t0 + t1) / 2, -1.2, text, ha="center", va="top", fontsize=7)
    span = float(df["t_s"].max() - df["t_s"].min()) or 1.0
    steps = df[df["kind"] == "step"].assign(_y=y)
    keys = ["_y", *(c for c in phase if c in steps.columns)]
    for i, (_, rows) in enumerate(steps.groupby(keys)):
        t0, t1 = float(rows["t_s"].min()), float(rows["t_s"].max())
        ax.barh(rows["_y"].iloc[0], max(t1 - t0, span * 0.006), left=t0, height=0.35, color="tab:blue", alpha=0.6,
                label="training steps" if i == 0 else None, zorder=2)
    for kind, (name, color, marker) in TIMELINE_MARKERS.items():
        rows = df[df["kind"] == kind]
        if not len(rows):
            continue
        ax.scatter(rows["t_s"], y[rows.index], color=color, marker=marker, s=45, label=name, zorder=3)
        if kind in ("fault", "resume") and "step" in rows.columns:
            for (t, yy, st) in zip(rows["t_s"], y[rows.index], rows["step"]):
                if pd.notna(st):
                    ax.annotate(f"step {int(st)}", (t, yy), textcoords="offset points", xytext=(4, 6), fontsize=7,
                                color=color)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -1.3)  # room above the lanes for the attempt labels
    ax.set_xlim(float(df["t_s"].min()) - span * 0.03, float(df["t_s"].max()) + span * 0.1)
    ax.set(title="Elastic run: steps, snapshots, faults and restarts", xlabel="time since the first event (s)")
    ax.grid(axis="x", alpha=0.3)
    _bottom_legend(fig, ax, max_cols=4)
    return fig


# -- 8. files ---------------------------------------------------------------------
def save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` as a PNG at 120 dpi, creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path
