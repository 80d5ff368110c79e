"""Plots: a DataFrame in, a matplotlib Figure out.

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so no global
state is touched: they render headless (Agg) and display in notebooks when returned
as a cell's value. All figures are sized for a notebook (7.5 inches wide).
"""

from dtlab.plots.crossover import speedup_curve
from dtlab.plots.network import bandwidth, elastic_timeline, link_sweep, predicted_vs_measured, sweep
from dtlab.plots.placement import draw_matrix, draw_mesh, draw_placement, held_slices, weight_placements
from dtlab.plots.runs import gantt, loss_curves, memory_breakdown, speedup, step_breakdown, timeline
from dtlab.plots.style import LINESTYLES, MEMORY_COLORS, PHASE_COLORS, TIER_PALETTE, WIDTH, save

__all__ = ["LINESTYLES", "MEMORY_COLORS", "PHASE_COLORS", "TIER_PALETTE", "WIDTH", "bandwidth", "draw_matrix",
           "draw_mesh", "draw_placement", "elastic_timeline", "gantt", "held_slices", "link_sweep", "loss_curves",
           "memory_breakdown", "predicted_vs_measured", "save", "speedup", "speedup_curve", "step_breakdown", "sweep",
           "timeline", "weight_placements"]
