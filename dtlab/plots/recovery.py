"""A fault's cost part by part: one lane per run (or per group), time since the fault across."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from dtlab.plots.style import bottom_legend, figure, require

__all__ = ["PART_COLORS", "recovery_timeline"]

PART_COLORS = {"detection": "tab:red", "restart": "tab:orange", "rendezvous": "tab:olive", "quorum": "tab:purple",
               "snapshot load": "tab:brown", "state transfer": "tab:cyan", "redone steps": "tab:gray",
               "not back by the end": "lightgray"}


def recovery_timeline(parts: pd.DataFrame, title: str = "What one fault cost, part by part") -> Figure:
    """``parts``: rows ``lane``, ``part`` (a key of ``PART_COLORS``), ``start_s`` and ``end_s`` (seconds since the
    fault), as ``dtlab.read.recovery`` gives them (several runs concatenated). Lanes top to bottom in the
    order they first appear; each lane's end is written beside it."""
    require(parts, ["lane", "part", "start_s", "end_s"], "recovery_timeline")
    unknown = sorted(set(parts["part"]) - set(PART_COLORS))
    if unknown:
        raise ValueError(f"recovery_timeline: unknown part(s) {unknown}; known: {list(PART_COLORS)}")
    lanes = list(dict.fromkeys(parts["lane"]))
    fig = figure(1.2 + 0.45 * len(lanes))
    ax = fig.add_subplot()
    seen: set[str] = set()
    for y, lane in enumerate(lanes):
        rows = parts[parts["lane"] == lane]
        for _, row in rows.iterrows():
            label = row["part"] if row["part"] not in seen else None
            seen.add(row["part"])
            ax.barh(y, row["end_s"] - row["start_s"], left=row["start_s"], height=0.6,
                    color=PART_COLORS[row["part"]], label=label)
        end = float(rows["end_s"].max())
        ax.text(end, y, f" {end:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the fault")
    ax.set_xlim(left=0, right=float(parts["end_s"].max()) * 1.15)
    ax.set_title(title)
    bottom_legend(fig, ax, max_cols=4)
    return fig
