"""Figures of communication: bandwidth, predictions against measurements, sweeps, link caps, elastic timelines."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator

from dtlab.plots.style import (
    bar_height,
    bottom_legend,
    bytes_tick,
    figure,
    require,
    stacked_barh,
)

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
    require(df, ("op", "bytes", metric), "bandwidth")
    df = df[(df["bytes"] > 0) & df[metric].notna()]
    if df.empty:
        raise ValueError(f"bandwidth: no rows with bytes > 0 and a {metric} value")
    split = "group_size" in df.columns and df["group_size"].nunique() > 1
    keys = ["op", "group_size"] if split else ["op"]
    fig = figure(3.8)
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
    ax.xaxis.set_major_formatter(FuncFormatter(bytes_tick))
    ax.set_ylim(bottom=0)
    ax.set(title=f"Collective {BW_NAMES[metric]} vs message size", xlabel="message size (bytes, log scale)",
           ylabel=f"{BW_NAMES[metric]} (GB/s)")
    ax.grid(alpha=0.3, which="both")
    bottom_legend(fig, ax)
    return fig


# -- 7. predicted vs measured -----------------------------------------------------
def predicted_vs_measured(df: pd.DataFrame, tolerance: float = 0.15, log: bool = False) -> Figure:
    """Predicted vs measured time (ms) per label, with the y = x line and a ±15 % band.

    ``df``: columns label, predicted_s, measured_s. ``log`` uses log axes, for times that
    span orders of magnitude.
    """
    require(df, ("label", "predicted_s", "measured_s"), "predicted_vs_measured")
    measured = df["measured_s"].to_numpy(float) * 1e3
    predicted = df["predicted_s"].to_numpy(float) * 1e3
    hi = max(measured.max(), predicted.max()) * 1.15
    lo = min(measured.min(), predicted.min()) / 1.15 if log else 0.0
    x = np.geomspace(lo, hi, 50) if log else np.linspace(lo, hi, 50)
    fig = figure(4.2)
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
    require(df, (x, y) + ((annotate,) if annotate else ()), "sweep")
    df = df.sort_values(x)
    fig = figure(3.2)
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

    ``df``: ``dtlab.experiments.linksweep.link_sweep``'s frame (label, step_ms, exposed_comm_ms,
    comm_mb_per_step). Each bar's end gives the step time; the MB sent per step is
    written beside the label.
    """
    require(df, ("label", "step_ms", "exposed_comm_ms", "comm_mb_per_step"), "link_sweep")
    exposed = df["exposed_comm_ms"].clip(lower=0).to_numpy(float)
    step = df["step_ms"].to_numpy(float)
    parts = {"compute and hidden comm": np.clip(step - exposed, 0, None), "exposed comm": np.minimum(exposed, step)}
    labels = [f"{lab} ({mb:.2g} MB/step)" for lab, mb in zip(df["label"].astype(str), df["comm_mb_per_step"])]
    fig = figure(bar_height(len(df)))
    ax = fig.subplots()
    stacked_barh(ax, labels, parts, LINK_COLORS, "ms")
    ax.set(title="DDP step time by link cap and gradient compression", xlabel="time per step (ms)")
    ax.grid(axis="x", alpha=0.3)
    bottom_legend(fig, ax)
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
    require(df, ("t_s", "kind", "rank"), "elastic_timeline")
    ranks = sorted(int(r) for r in df["rank"].dropna().unique())
    lanes = ["agents", *[f"rank {r}" for r in ranks]]
    lane_of = {r: i + 1 for i, r in enumerate(ranks)}
    y = df["rank"].map(lambda r: 0 if pd.isna(r) else lane_of[int(r)])
    fig = figure(max(2.8, 1.9 + 0.5 * len(lanes)))
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
    bottom_legend(fig, ax, max_cols=4)
    return fig
