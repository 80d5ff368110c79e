"""Pipeline schedule diagrams: one lane per stage or rank, one bar per micro-batch's action.

The frame is a schedule's actions, measured (``read.pipeline.schedule_frame``) or laid
out with equal times (``cost.pipeline.simulate``): columns lane, phase, microbatch,
start, end, and optionally stage and hold (the rank's how-manyth stage it is, from 0).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dtlab.plots.style import OP_PALETTE, PHASE_COLORS, color_map, figure, require

__all__ = ["ACTION_COLORS", "COMPUTE", "pipeline_schedule"]

# Zero-bubble schedules split a backward in two: its input part (I) and its weight part (W).
ACTION_COLORS = {"forward": PHASE_COLORS["forward"], "backward": PHASE_COLORS["backward"],
                 "backward_input": "tab:red", "backward_weight": "tab:olive"}
COMPUTE = tuple(ACTION_COLORS)
HATCHES = ("", "//", "xx", "..")  # a rank's first, second, ... stage


def pipeline_schedule(df: pd.DataFrame, title: str = "Pipeline schedule", seconds: bool = True) -> Figure:
    """A schedule as a Gantt chart, every compute bar labelled with its micro-batch.

    ``seconds``: start and end are absolute seconds (x: ms since the earliest start); otherwise they are
    time units (x as given). With a ``hold`` column, a rank's later stages are hatched, so an interleaved
    or V-shaped schedule shows which of its stages each bar ran. Other phases (transfers) get their own
    colours.
    """
    require(df, ("lane", "phase", "microbatch", "start", "end"), "pipeline_schedule")
    df = df.reset_index(drop=True)
    lanes = list(pd.unique(df["lane"]))
    y = df["lane"].map({name: i for i, name in enumerate(lanes)}).to_numpy(float)
    scale, t0 = (1e3, float(df["start"].min())) if seconds else (1.0, 0.0)
    left = (df["start"].to_numpy(float) - t0) * scale
    span = float((df["end"].to_numpy(float) - t0).max() * scale)
    width = np.maximum((df["end"].to_numpy(float) - df["start"].to_numpy(float)) * scale, span * 0.002)
    colors = color_map(pd.unique(df["phase"]), ACTION_COLORS, OP_PALETTE)
    hold = df["hold"].fillna(0).astype(int).to_numpy() if "hold" in df else np.zeros(len(df), int)
    fig = figure(max(2.4, 1.5 + 0.45 * len(lanes)))
    ax = fig.subplots()
    ax.barh(y, width, left=left, height=0.6, color=[colors[p] for p in df["phase"]],
            hatch=[HATCHES[h % len(HATCHES)] for h in hold], edgecolor="white", linewidth=0.6)
    for i in np.flatnonzero(df["phase"].isin(COMPUTE).to_numpy()):
        ax.text(left[i] + width[i] / 2, y[i], str(df["microbatch"].iloc[i]), ha="center", va="center",
                fontsize=7, color="white")
    handles = [Patch(color=color, label=str(name)) for name, color in colors.items()]
    if hold.max() > 0:
        handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//", label="hatched: 2nd stage"))
    ax.set_yticks(range(len(lanes)), [str(x) for x in lanes])
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01)
    ax.set(title=title, xlabel="time since first shown start (ms)" if seconds else "time (units: one forward = 1)")
    ax.grid(axis="x", alpha=0.3)
    rows = math.ceil(len(handles) / 4)  # below the plot, as style.bottom_legend places it
    fig.legend(handles=handles, loc="outside lower center", ncol=math.ceil(len(handles) / rows), frameon=False)
    return fig
