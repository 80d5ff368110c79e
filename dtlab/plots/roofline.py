"""A roofline: attainable FLOP/s against arithmetic intensity, measured points under each placement's two roofs."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dtlab.plots.style import TIER_PALETTE, bottom_legend, figure, require

__all__ = ["roofline"]


def roofline(points: pd.DataFrame, roofs: pd.DataFrame, title: str | None = None) -> Figure:
    """Measured GFLOP/s against FLOPs per byte (log-log), with each placement's roofs.

    ``points``: one row per measurement, columns ``placement`` (a label), ``kind`` (``gemm`` or
    ``triad``: other kinds are not drawn), ``flops``, ``bytes`` and ``seconds`` (and ``m``, ``n``, ``k``
    to count the GEMM shapes). ``roofs``: one row
    per placement, columns ``placement``, ``peak_flops`` (FLOP/s) and ``bandwidth`` (bytes/s):
    attainable = min(peak, bandwidth x intensity), the two roofs meeting at the ridge point.
    """
    require(points, ("placement", "kind", "flops", "bytes", "seconds"), "roofline points")
    require(roofs, ("placement", "peak_flops", "bandwidth"), "roofline roofs")
    drawn = points[points["kind"].isin(("gemm", "triad")) & (points["flops"] > 0)].copy()
    drawn["intensity"] = drawn["flops"] / drawn["bytes"]
    drawn["gflops"] = drawn["flops"] / drawn["seconds"] / 1e9
    lo = min(drawn["intensity"].min(), 0.05) / 2 if len(drawn) else 0.05
    hi = max(drawn["intensity"].max() if len(drawn) else 1.0, *(roofs["peak_flops"] / roofs["bandwidth"])) * 2
    x = np.geomspace(lo, hi, 200)
    fig = figure(5.6)
    ax = fig.subplots()
    for i, roof in enumerate(roofs.itertuples(index=False)):
        color = TIER_PALETTE[i % len(TIER_PALETTE)]
        ax.plot(x, np.minimum(roof.peak_flops, roof.bandwidth * x) / 1e9, "-", color=color, lw=2,
                label=f"roofs, {roof.placement}: {roof.peak_flops / 1e9:.0f} GFLOP/s, {roof.bandwidth / 1e9:.1f} GB/s")
        mine = drawn[drawn["placement"] == roof.placement]
        gemms, triads = mine[mine["kind"] == "gemm"], mine[mine["kind"] == "triad"]
        ax.scatter(gemms["intensity"], gemms["gflops"], s=9, color=color, alpha=0.45, lw=0)
        ax.scatter(triads["intensity"], triads["gflops"], s=40, marker="x", color=color)
    # one legend entry per marker kind, in grey: the colour says the placement, as the roofs' entries do
    shapes = drawn.loc[drawn["kind"] == "gemm", ["m", "n", "k"]].drop_duplicates() if "m" in drawn else []
    ax.scatter([], [], s=9, color="0.4", label=f"fp32 GEMMs measured ({len(shapes)} shapes; colour: placement)")
    ax.scatter([], [], s=40, marker="x", color="0.4", label="triad a = b + 2c measured (array sizes)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="arithmetic intensity (FLOP per byte moved, log scale)",
           ylabel="attainable GFLOP/s (log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title or "Measured points under the roofs: min(peak, bandwidth × intensity)", fontsize=9)
    fig.suptitle("This machine's roofline")
    bottom_legend(fig, ax, max_cols=1)
    return fig
