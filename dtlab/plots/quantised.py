"""Quantised communication's trade: the bytes each variant sends per step against how far its loss curve drifts.

The table comes from ``dtlab.experiments.quantised.measure``; here it is only drawn.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from dtlab.plots.style import TIER_PALETTE, figure, require

__all__ = ["bytes_vs_drift"]


def bytes_vs_drift(table: pd.DataFrame) -> Figure:
    """One point per variant: kB sent per step (x) against the loss curve's drift from fp32 (y, the mean
    |Δloss| over the last fifth of the steps), a colour per tier, each point labelled with its variant."""
    require(table, ("variant", "tier", "sent_per_step", "drift_last"), "bytes_vs_drift")
    fig = figure(3.6)
    ax = fig.subplots()
    for i, (tier, rows) in enumerate(table.groupby("tier", sort=False)):
        ax.scatter(rows["sent_per_step"] / 1e3, rows["drift_last"], s=45, color=TIER_PALETTE[i % len(TIER_PALETTE)],
                   label=tier, zorder=3)
        for x, y, name in zip(rows["sent_per_step"] / 1e3, rows["drift_last"], rows["variant"]):
            ax.annotate(name.removeprefix(f"{tier} "), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("kB sent per step (rank 0)")
    ax.set_ylabel("loss drift from fp32\n(mean |Δloss|, last fifth)")
    ax.set_title("quantised communication: bytes against drift")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig
