"""Scaling figures: published runs against the planner's predictions, and a critical batch predicted and run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from dtlab.plots.style import TIER_PALETTE, WIDTH, bottom_legend, figure, require

__all__ = ["critical_batch", "predicted_against_published", "published_scaling"]

GPU_MARKERS = ("o", "s", "D", "^")


def published_scaling(frame: pd.DataFrame, families: Sequence[str] | None = None,
                      title: str = "Published runs against the planner's predictions") -> Figure:
    """Per-GPU throughput as a share of the GPU's peak (MFU, %) against GPUs (log), one panel per layout family
    side by side: published points filled, predicted ones hollow, a line between each pair (a run not scored, its
    predicted MFU NaN, has its published point alone); colour: the source, marker: the GPU. ``frame``:
    ``scaling.published_frame``'s columns ``family``, ``source``, ``gpu``, ``gpus``, ``mfu_published``,
    ``mfu_predicted``."""
    require(frame, ("family", "source", "gpu", "gpus", "mfu_published", "mfu_predicted"), "published runs")
    panels = list(families or dict.fromkeys(frame["family"]))
    colours = {s: TIER_PALETTE[i % len(TIER_PALETTE)] for i, s in enumerate(dict.fromkeys(frame["source"]))}
    markers = {g: GPU_MARKERS[i % len(GPU_MARKERS)] for i, g in enumerate(dict.fromkeys(frame["gpu"]))}
    fig = Figure(figsize=(WIDTH, 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), sharex=True, sharey=True, squeeze=False)[0]
    top = 100 * np.nanmax([frame["mfu_published"].max(), frame["mfu_predicted"].max()])
    for ax, name in zip(axes, panels, strict=True):
        rows = frame[frame["family"] == name]
        for row in rows.itertuples(index=False):
            colour, marker = colours[row.source], markers[row.gpu]
            ax.scatter([row.gpus], [100 * row.mfu_published], marker=marker, s=34, color=colour, zorder=3)
            if np.isnan(row.mfu_predicted):  # not scored (planner.prediction): the published point alone
                continue
            ax.plot([row.gpus, row.gpus], [100 * row.mfu_published, 100 * row.mfu_predicted], "-", color=colour,
                    lw=1, alpha=0.6)
            ax.scatter([row.gpus], [100 * row.mfu_predicted], marker=marker, s=34, facecolors="none",
                       edgecolors=colour, zorder=3)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(frame["gpus"].min() / 2, frame["gpus"].max() * 2)
        ax.set_title(f"{name} ({len(rows)} runs)", fontsize=9)
        ax.set_xlabel("GPUs (log scale)")
        ax.grid(alpha=0.3, which="both")
        ax.set_ylim(0, top * 1.12)
    axes[0].set_ylabel("model FLOP/s per GPU, % of peak (MFU)")
    for source, colour in colours.items():
        axes[0].scatter([], [], color=colour, s=34, label=source)
    for gpu, marker in markers.items():
        axes[0].scatter([], [], marker=marker, color="0.4", s=34, label=gpu)
    axes[0].scatter([], [], color="0.4", s=34, label="published (filled)")
    axes[0].scatter([], [], facecolors="none", edgecolors="0.4", s=34, label="predicted (hollow)")
    fig.suptitle(title)
    bottom_legend(fig, axes[0], max_cols=4)
    return fig


def _against(ax, frame: pd.DataFrame, column: str, colours: dict, markers: dict, low: float, top: float) -> None:
    scored = frame[frame[column].notna()]
    for row in scored.itertuples(index=False):
        ax.scatter([100 * row.mfu_published], [100 * getattr(row, column)], marker=markers[row.gpu], s=22,
                   color=colours[row.source], alpha=0.8, zorder=3)
    line = np.array([0.0, top])
    ax.plot(line, line, "-", color="0.3", lw=1)
    for band, style in ((0.1, "--"), (0.2, ":")):
        ax.plot(line, line * (1 + band), style, color="0.5", lw=0.8)
        ax.plot(line, line * (1 - band), style, color="0.5", lw=0.8)
    errors = (scored[column] / scored["mfu_published"] - 1).abs()
    ax.set(xlim=(low, top), ylim=(low, top), xlabel="published MFU (%)", aspect="equal")
    ax.set_title(f"median |error| {100 * errors.median():.1f} %, worst {100 * errors.max():.1f} % "
                 f"({len(scored)} runs)", fontsize=8)
    ax.grid(alpha=0.3)


def predicted_against_published(frame: pd.DataFrame, panels: dict[str, str] | None = None,
                                title: str = "The planner against published runs") -> Figure:
    """Predicted MFU against published MFU (%), one point per scored run (colour: the source, marker: the GPU),
    with the diagonal and lines at ±10 % (dashed) and ±20 % (dotted); one panel per entry of ``panels`` (a
    heading -> a column of predicted MFUs; default: ``mfu_predicted`` out of sample and, where present,
    ``mfu_predicted_in_sample``). Unscored runs (NaN) are left out. ``frame``: ``source``, ``gpu``,
    ``mfu_published`` and the panels' columns (``planner.validate``'s table)."""
    if panels is None:
        panels = {"leave-one-source-out": "mfu_predicted"}
        if "mfu_predicted_in_sample" in frame:
            panels["in-sample"] = "mfu_predicted_in_sample"
    require(frame, ("source", "gpu", "mfu_published", *panels.values()), "validated runs")
    colours = {s: TIER_PALETTE[i % len(TIER_PALETTE)] for i, s in enumerate(dict.fromkeys(frame["source"]))}
    markers = {g: GPU_MARKERS[i % len(GPU_MARKERS)] for i, g in enumerate(dict.fromkeys(frame["gpu"]))}
    values = 100 * frame[["mfu_published", *panels.values()]].to_numpy(dtype=float)
    low, top = 0.8 * np.nanmin(values), 1.1 * np.nanmax(values)
    fig = Figure(figsize=(WIDTH, 4.8), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (heading, column) in zip(axes, panels.items(), strict=True):
        _against(ax, frame, column, colours, markers, low, top)
        ax.set_title(f"{heading}: " + ax.get_title(), fontsize=8)
    axes[0].set_ylabel("predicted MFU (%)")
    scored = set(frame.loc[frame[next(iter(panels.values()))].notna(), "source"])
    for source, colour in colours.items():
        axes[0].scatter([], [], color=colour, s=22, label=source + ("" if source in scored else " (not scored)"))
    for gpu, marker in markers.items():
        axes[0].scatter([], [], marker=marker, color="0.4", s=22, label=gpu)
    fig.suptitle(title)
    bottom_legend(fig, axes[0], max_cols=3)
    return fig


def critical_batch(curve: pd.DataFrame, measured: pd.DataFrame, batch: float, formula_batch: float | None = None,
                   title: str = "Data parallelism on this machine: compute against the all-reduces") -> Figure:
    """Milliseconds per step against samples per rank (log-log): the predicted compute (forward + backward) and
    all-reduces as lines, the predicted critical batch (and the formula's) as vertical lines, and the runs on
    either side as points. ``curve``: ``batch``, ``compute_s``, ``comm_s``; ``measured``: ``batch``,
    ``compute_s``, ``comm_s`` (``critical_batch.measure``)."""
    require(curve, ("batch", "compute_s", "comm_s"), "predicted curve")
    require(measured, ("batch", "compute_s", "comm_s"), "measured runs")
    fig = figure(4.4)
    ax = fig.subplots()
    ax.plot(curve["batch"], 1e3 * curve["compute_s"], "-", color="tab:blue", lw=2,
            label="compute, predicted (the roofline)")
    ax.plot(curve["batch"], 1e3 * curve["comm_s"], "-", color="tab:red", lw=2,
            label="all-reduces, predicted (the link)")
    ax.scatter(measured["batch"], 1e3 * measured["compute_s"], s=60, color="tab:blue", marker="o", zorder=3,
               label="compute, measured")
    ax.scatter(measured["batch"], 1e3 * measured["comm_s"], s=70, color="tab:red", marker="X", zorder=3,
               label="all-reduces, measured")
    ax.axvline(batch, color="0.2", ls="--", lw=1.2, label=f"critical batch, predicted: {batch:.0f}")
    if formula_batch is not None and np.isfinite(formula_batch):
        ax.axvline(formula_batch, color="0.5", ls=":", lw=1.2,
                   label=f"formula (n-1)/n b C / (3W): {formula_batch:.0f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="samples per rank per step (log scale)", ylabel="ms per step (log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title, fontsize=9)
    bottom_legend(fig, ax, max_cols=3)
    return fig
