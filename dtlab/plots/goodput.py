"""Goodput against the mean time between failures: predicted curves, measured points, and a labelled projection."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dtlab.plots.style import TIER_PALETTE, WIDTH, require

__all__ = ["goodput_figure", "variant_colors"]


def variant_colors(names: list[str]) -> dict[str, str]:
    """A fixed colour per variant name, by its kind: a variant's curve and points share it."""
    return {name: TIER_PALETTE[i % len(TIER_PALETTE)] for i, name in enumerate(sorted(names))}


def _measured(ax, frame: pd.DataFrame, colors: dict[str, str]) -> None:  # noqa: ANN001 - a matplotlib Axes
    curves = frame[frame["kind"] == "curve"]
    for name, rows in curves.groupby("variant"):
        style = ":" if "async" in name else "-"
        ax.plot(rows["mtbf_s"], rows["goodput"], style, color=colors[name], label=f"{name} (predicted)")
    points = frame[(frame["kind"] == "point") & np.isfinite(frame["mtbf_s"].astype(float))]
    for name, rows in points.groupby("variant"):
        ax.scatter(rows["mtbf_s"], rows["goodput"], color=colors[name], edgecolor="black", zorder=3,
                   label=f"{name} (measured)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("mean training time between faults, MTBF (s)")
    ax.set_ylabel("goodput (useful steps per wall second)")
    ax.set_title("Measured here: 2 ranks, MLP, faults at random", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def _projection(ax, frame: pd.DataFrame) -> None:  # noqa: ANN001 - a matplotlib Axes
    proj = frame[frame["kind"] == "projection"]
    for i, (name, rows) in enumerate(proj.groupby("variant")):
        ax.plot(rows["gpus"], rows["fraction"], marker="o", ms=3, color=TIER_PALETTE[(i + 4) % len(TIER_PALETTE)],
                label=name)
    ax.axvline(16384, color="grey", ls="--", lw=0.8)
    ax.text(16384, 0.45, " Llama 3: 16,384 GPUs,\n 419 unexpected faults\n in 54 days", fontsize=7, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("GPUs (MTBF scaled as 1 / GPUs)")
    ax.set_ylabel("fraction of fault-free throughput")
    ax.set_title("PROJECTION: Llama 3's fault rate, assumed costs", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")


def goodput_figure(frame: pd.DataFrame) -> Figure:
    """``frame``: ``python -m dtlab.experiments.goodput``'s table (``kind`` curve / point / projection rows with
    ``variant``, ``mtbf_s``, ``goodput``; projection rows ``gpus``, ``fraction``). Left: goodput against MTBF
    here, curves predicted and points measured; right, if present: the projection."""
    require(frame, ["kind", "variant", "mtbf_s"], "goodput_figure")
    kinds = set(frame["kind"])
    if "curve" not in kinds:
        raise ValueError("goodput_figure: the table has no predicted curve rows (kind == 'curve')")
    colors = variant_colors([v for v in frame[frame["kind"].isin(["curve", "point"])]["variant"].unique()])
    panels = 2 if "projection" in kinds else 1
    fig = Figure(figsize=(WIDTH * (1.0 if panels == 2 else 0.6), 4.2), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    _measured(axes[0], frame, colors)
    if panels == 2:
        _projection(axes[1], frame)
    finite = frame[frame["kind"] == "point"]["mtbf_s"].astype(float)
    if len(finite) and not all(math.isfinite(m) for m in finite):
        axes[0].text(0.02, 0.97, "runs in which no fault fired are not drawn", transform=axes[0].transAxes,
                     fontsize=7, va="top")
    return fig
