"""The course on a busy machine: each notebook's seconds in quick mode beside CPU hogs, pass or fail."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from dtlab.plots.style import figure, require

__all__ = ["notebook_seconds"]


def notebook_seconds(table: pd.DataFrame, hogs: int, cores: int) -> Figure:
    """``table``: rows ``notebook``, ``passed``, ``seconds`` (``dtlab.app.busy``'s CSV). One bar per notebook,
    green if it passed, red if not, its seconds written beside it."""
    require(table, ["notebook", "passed", "seconds"], "notebook_seconds")
    fig = figure(1.2 + 0.3 * len(table))
    ax = fig.add_subplot()
    colors = ["tab:green" if ok else "tab:red" for ok in table["passed"]]
    ax.barh(range(len(table)), table["seconds"], color=colors, height=0.6)
    for y, seconds in enumerate(table["seconds"]):
        ax.text(seconds, y, f" {seconds:.0f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(table)), table["notebook"])
    ax.invert_yaxis()
    ax.set_xlabel("seconds to run the notebook in quick mode (two at a time)")
    passed = int(table["passed"].sum())
    ax.set_title(f"{passed} of {len(table)} notebooks passed beside {hogs} CPU hogs on {cores} cores")
    ax.set_xlim(0, float(table["seconds"].max()) * 1.15)
    return fig
