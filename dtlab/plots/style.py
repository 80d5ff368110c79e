"""What every figure shares: size, colours, byte units, legends, and saving."""

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
    "cell": "gainsboro",  # a %%ranks cell's span on a rank: the collectives drawn beside it are what it waited in
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
def figure(height: float) -> Figure:
    return Figure(figsize=(WIDTH, height), layout="constrained")


def require(df: pd.DataFrame, columns: Iterable[str], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{what}: missing column(s) {missing}; got {list(df.columns)}")
    if df.empty:
        raise ValueError(f"{what}: the DataFrame is empty")


def color_map(names: Iterable[str], fixed: Mapping[str, str], palette: Sequence[str]) -> dict[str, str]:
    """A colour per name: the fixed one where known, else the next from the palette."""
    spare = itertools.cycle([c for c in palette if c not in fixed.values()])
    return {name: fixed.get(name) or next(spare) for name in names}


def byte_unit(max_bytes: float) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if max_bytes >= scale:
            return unit, scale
    return "KiB", 2**10


def bytes_tick(x: float, _pos: int | None = None) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:g} {unit}"
    return f"{x:g} B"


def bottom_legend(fig: Figure, ax: Axes, max_cols: int = 5) -> None:
    # Below the plot, outside the axes: a legend there never hides data.
    handles, labels = ax.get_legend_handles_labels()
    rows = math.ceil(len(labels) / max_cols)
    fig.legend(handles, labels, loc="outside lower center", ncol=math.ceil(len(labels) / rows), frameon=False)


def stacked_barh(ax: Axes, labels: Sequence[str], parts: Mapping[str, np.ndarray], colors: Mapping[str, str],
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


def bar_height(n: int) -> float:
    return max(2.6, 1.6 + 0.45 * n)


# -- 8. files ---------------------------------------------------------------------
def save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``fig`` as a PNG at 120 dpi, creating parent folders; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path
