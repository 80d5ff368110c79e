"""Figures for the cost model: a DataFrame in, a matplotlib Figure out (see ``dtlab.plots``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator

if TYPE_CHECKING:  # for the annotation only: plots sit below cost
    from dtlab.cost.links import LinkModel
from dtlab.plots.style import LINESTYLES, TIER_PALETTE, WIDTH, bytes_tick, require


def calibration(fit_df: pd.DataFrame, link: LinkModel) -> Figure:
    """Measured collective time against message size, with the fitted alpha-beta line (log-log).

    ``fit_df``: ``costmodel.fit_frame``'s columns op, bytes, group_size, seconds.
    """
    require(fit_df, ("op", "bytes", "group_size", "seconds"), "calibration")
    fig = Figure(figsize=(WIDTH, 3.8), layout="constrained")
    ax = fig.subplots()
    for i, ((op, n), rows) in enumerate(fit_df.groupby(["op", "group_size"], sort=True)):
        color = TIER_PALETTE[i % len(TIER_PALETTE)]
        rows = rows.sort_values("bytes")
        ax.scatter(rows["bytes"], rows["seconds"] * 1e3, color=color, s=24, zorder=3,
                   label=f"{op}, {int(n)} ranks: measured (median)")
        sizes = np.geomspace(float(rows["bytes"].min()), float(rows["bytes"].max()), 60)
        ax.plot(sizes, link.predict(str(op), sizes, int(n)) * 1e3, color=color, lw=1.2,
                label=f"{op}: alpha-beta model")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=9))
    ax.xaxis.set_major_formatter(FuncFormatter(bytes_tick))
    ax.set(title=f"Calibration: {link.label}\nalpha = {link.alpha_s * 1e6:.3g} us, "
                 f"bandwidth = {link.bandwidth_gbps:.3g} GB/s",
           xlabel="message size (bytes, log scale)", ylabel="time (ms, log scale)")
    ax.grid(alpha=0.3, which="both")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=2, frameon=False)
    return fig


def projection(df: pd.DataFrame) -> Figure:
    """What-if speedup and efficiency against world size, one line per link (``costmodel.project``'s frame).

    Labelled a simulation: these are model outputs, not measurements.
    """
    require(df, ("link", "world_size", "speedup", "efficiency"), "projection")
    fig = Figure(figsize=(WIDTH, 3.9), layout="constrained")
    ax_s, ax_e = fig.subplots(1, 2)
    sizes = np.sort(df["world_size"].unique())
    ax_s.plot(sizes, sizes, "k--", lw=1, label="ideal (speedup = N)")
    for i, (link, rows) in enumerate(df.groupby("link", sort=False)):
        rows = rows.sort_values("world_size")
        style = {"color": TIER_PALETTE[i % len(TIER_PALETTE)], "ls": LINESTYLES[i % len(LINESTYLES)], "marker": "o",
                 "ms": 3.5}
        ax_s.plot(rows["world_size"], rows["speedup"], label=str(link), **style)
        ax_e.plot(rows["world_size"], rows["efficiency"] * 100, **style)
    for ax in (ax_s, ax_e):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.grid(alpha=0.3, which="both")
    ax_s.set_yscale("log", base=2)
    ax_s.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax_s.set(title="Speedup over one rank", xlabel="world size N (ranks, log scale)",
             ylabel="speedup (x, log scale)")
    ax_e.set(title="Parallel efficiency", xlabel="world size N (ranks, log scale)", ylabel="efficiency (%)",
             ylim=(0, 105))
    fig.suptitle("What-if projection: SIMULATION from the alpha-beta model, not measured", fontsize=11)
    fig.legend(*ax_s.get_legend_handles_labels(), loc="outside lower center", ncol=2, frameon=False)
    return fig
