"""Plots: a DataFrame in, a matplotlib Figure out.

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so no global
state is touched: they render headless (Agg) and display in notebooks when returned
as a cell's value. All figures are sized for a notebook (7.5 inches wide).
"""

from dtlab.plots.crossover import speedup_curve
from dtlab.plots.faults import loss_vs_time, replica_timeline
from dtlab.plots.network import bandwidth, elastic_timeline, link_sweep, predicted_vs_measured, sweep
from dtlab.plots.pipeline import pipeline_schedule
from dtlab.plots.placement import (
    draw_matrix,
    draw_mesh,
    draw_placement,
    held_slices,
    stage_placements,
    weight_placements,
)
from dtlab.plots.quantised import bytes_vs_drift
from dtlab.plots.runs import gantt, loss_curves, memory_breakdown, speedup, step_breakdown, timeline
from dtlab.plots.scaling import critical_batch, predicted_against_published, published_scaling
from dtlab.plots.sequence import (
    activations_saved,
    attention_work,
    calls_by_tag,
    checkpointing,
    comm_vs_width,
    cp_bytes,
    ring_messages,
)
from dtlab.plots.style import LINESTYLES, MEMORY_COLORS, PHASE_COLORS, TIER_PALETTE, WIDTH, save

__all__ = ["LINESTYLES", "MEMORY_COLORS", "PHASE_COLORS", "TIER_PALETTE", "WIDTH", "bandwidth", "draw_matrix",
           "draw_mesh", "draw_placement", "elastic_timeline", "gantt", "held_slices", "link_sweep", "loss_curves",
           "memory_breakdown", "pipeline_schedule", "predicted_vs_measured", "save", "speedup", "speedup_curve",
           "stage_placements", "step_breakdown", "sweep", "timeline", "weight_placements", "loss_vs_time",
           "replica_timeline", "activations_saved", "attention_work", "calls_by_tag", "checkpointing",
           "comm_vs_width", "cp_bytes", "ring_messages", "critical_batch", "published_scaling",
           "predicted_against_published", "bytes_vs_drift"]
