"""Where data parallelism pays: speedup against model width, measured and predicted, with break-even marked.

(Not ``plots/speedup.py``: a submodule of that name would replace the
function ``plots.speedup`` on the package as soon as it is imported.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from dtlab.plots.style import bottom_legend, figure, require

__all__ = ["PREDICTION_LABEL", "RETIMED_LABEL", "crossing", "speedup_curve"]

# What the lines are, in the legend: dtlab.estimate's step time for single and for ddp, their ratio
PREDICTION_LABEL = ("predicted by dtlab.estimate: compute on\n"
                    "this machine's roofline, link calibrated\n"
                    "in this run, wake-up excess (busy_s)")
RETIMED_LABEL = "the same, compute re-timed\n(run as the ranks run it)"


def crossing(widths: Sequence[float], speedups: Sequence[float], level: float = 1.0) -> float | None:
    """The width where ``speedups`` first reaches ``level``, linear in log(width) between neighbours.

    ``widths`` ascending. None if it never does; ``widths[0]`` if the first point is already there.
    """
    x, y = np.asarray(widths, dtype=float), np.asarray(speedups, dtype=float)
    if len(x) != len(y):
        raise ValueError(f"crossing: {len(x)} widths but {len(y)} speedups")
    if (x <= 0).any():
        raise ValueError("crossing: widths must be > 0 (they are interpolated in log-width)")
    if (np.diff(x) <= 0).any():
        raise ValueError("crossing: widths must be strictly ascending")
    for i in range(len(x)):
        if y[i] >= level:
            if i == 0:
                return float(x[0])
            lo, hi = math.log(x[i - 1]), math.log(x[i])
            frac = (level - y[i - 1]) / (y[i] - y[i - 1])
            return float(math.exp(lo + frac * (hi - lo)))
    return None


def _where_above(widths: np.ndarray, speedups: np.ndarray) -> str:
    """Legend text: the break-even width if the curve crosses 1 and stays above; else where it is >= 1, if anywhere."""
    cross = crossing(widths, speedups)
    if cross is None:
        return "below break-even everywhere"
    above = widths[speedups >= 1]
    if (speedups[widths >= above[0]] >= 1).all():
        return f"break-even at width ≈ {cross:.0f}"
    return f"≥ 1 only at width{'s' if len(above) > 1 else ''} {', '.join(f'{x:g}' for x in above)}"


def _tick_label(width: float, nbytes: float | None) -> str:
    if nbytes is None or not math.isfinite(nbytes):
        return f"{width:g}"
    return f"{width:g}\n{nbytes / 1e6:.2g} MB"


def speedup_curve(frame: pd.DataFrame, title: str | None = None) -> Figure:
    """Speedup of ddp over single against MLP width (log scale): measured markers, the prediction's line.

    ``frame``: one row per width, columns width and speedup (single step time /
    ddp step time, measured); optional speedup_min and speedup_max (the spread
    of the measured rounds, shaded; ``frame.attrs["rounds"]`` says how many),
    predicted_speedup (``dtlab.estimate``'s, labelled ``PREDICTION_LABEL``),
    retimed_speedup (the same with re-timed compute, dashed, ``RETIMED_LABEL``),
    speedup_vs_1t (against single on one thread: a second reference),
    gradient_bytes (written under each width) and ddp_ms/single_ms (for the
    annotation). A horizontal line marks break-even (speedup 1); the measured
    crossover is marked where there is one, else the closest approach is
    annotated. The title says what is compared: ``title``, else
    ``frame.attrs["baseline"]`` (``dtlab.experiments.speedup`` sets it).
    """
    require(frame, ("width", "speedup"), "speedup_curve")
    df = frame.dropna(subset=["width", "speedup"]).sort_values("width")
    w = df["width"].to_numpy(float)
    fig = figure(5.2)
    ax = fig.subplots()
    ax.axhline(1.0, color="k", ls="--", lw=1, label="break-even (speedup 1)")
    if "speedup_vs_1t" in df.columns:
        ax.plot(w, df["speedup_vs_1t"], "s", mfc="none", color="tab:gray", ms=6,
                label="measured: ddp vs single on 1 thread")
    if {"speedup_min", "speedup_max"} <= set(df.columns):
        rounds = frame.attrs.get("rounds")
        ax.fill_between(w, df["speedup_min"], df["speedup_max"], color="tab:blue", alpha=0.2, lw=0,
                        label=f"measured: min-max of {f'{rounds} ' if rounds else 'the '}rounds")
    if "predicted_speedup" in df.columns:
        ax.plot(w, df["predicted_speedup"], "-", color="tab:orange", lw=2,
                label=f"{PREDICTION_LABEL};\n{_where_above(w, df['predicted_speedup'].to_numpy(float))}")
    if "retimed_speedup" in df.columns:
        ax.plot(w, df["retimed_speedup"], "--", color="tab:purple", lw=1.5, label=RETIMED_LABEL)
    ax.plot(w, df["speedup"], "o", color="tab:blue", ms=8, zorder=3,
            label="measured: ddp vs single (all cores), median of rounds")
    cross = crossing(w, df["speedup"].to_numpy(float))
    if cross is not None:
        ax.axvline(cross, color="tab:green", ls=":", lw=1.5, label=f"measured break-even: width ≈ {cross:.0f}")
        ax.annotate(f"ddp pays from\nwidth ≈ {cross:.0f}", (cross, 1.0), xytext=(8, -30), textcoords="offset points",
                    fontsize=9, color="tab:green")
    else:
        best = df.loc[df["speedup"].idxmax()]
        detail = (f"\n(ddp {best['ddp_ms']:.3g} ms vs single {best['single_ms']:.3g} ms)"
                  if {"ddp_ms", "single_ms"} <= set(df.columns) else "")
        ax.annotate(f"closest: ×{best['speedup']:.2f} at width {best['width']:g}{detail}",
                    (best["width"], best["speedup"]), xytext=(0.5, 0.12), textcoords="axes fraction",
                    ha="center", fontsize=9, arrowprops={"arrowstyle": "->", "color": "0.3"})
    ax.set_xscale("log", base=2)
    nbytes = df["gradient_bytes"].to_numpy(float) if "gradient_bytes" in df.columns else [None] * len(w)
    ax.set_xticks(w, [_tick_label(x, b) for x, b in zip(w, nbytes)])
    ax.xaxis.set_minor_formatter(NullFormatter())
    # the medians and the lines set the scale; one stalled round's maximum (a loaded machine) runs off the top
    values = [df[c].to_numpy(float) for c in ("speedup", "predicted_speedup", "retimed_speedup", "speedup_vs_1t")
              if c in df.columns]
    top = max(1.2, float(np.nanmax(np.concatenate(values))) * 1.3)
    ax.set_ylim(0, top)
    below = "\n(and MB of gradients all-reduced per step)" if "gradient_bytes" in df.columns else ""
    ax.set(xlabel=f"MLP width (hidden units per layer, log scale){below}",
           ylabel="speedup: single step time / ddp step time (×)")
    ax.grid(alpha=0.3)
    ax.set_title(title or frame.attrs.get("baseline", "ddp vs single"), fontsize=9)
    fig.suptitle("When does data parallelism pay? Speedup against model width")
    bottom_legend(fig, ax, max_cols=2)
    return fig
