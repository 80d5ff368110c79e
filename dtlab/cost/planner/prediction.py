"""One published run predicted at its published layout, what the source left out chosen as the planner would advise.

A row of ``data/published_runs.csv`` (``planner.runs``) may leave its micro-batch or its interleaving blank:
the source did not publish them. They are never resolved in the planner's favour. ``candidates`` lists every
legal choice — every micro-batch that divides the replica's share of the global batch, every number of model
chunks that divides a stage's layers, each checked by ``check_layout`` — and ``predict`` takes the one the
planner would advise a user: the fastest that fits in the GPU's memory by its own memory model. The spread over
every choice that fits is reported beside it (``low``, ``high``). A run with unpublished choices of which
none fits is reported so (``scored`` False, no prediction): the planner would not advise it, so it cannot be
said to predict it. A run whose layout is published in full is predicted at that layout whatever the memory
model says (``fits`` tells), since nothing is chosen for it. An unpublished attention implementation is no
layout choice: the loader takes ``runs.ATTENTION_DEFAULT`` and the row's ``note`` says so.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dtlab.cost.planner.layout import Layout, check_layout, divisors
from dtlab.cost.planner.runs import ATTENTION_DEFAULT, Run
from dtlab.cost.planner.search import evaluate

__all__ = ["candidates", "metric_value", "predict", "unpublished"]


def unpublished(run: Run) -> list[str]:
    """The layout's choices the source left out (an interleave is no choice without pipeline stages)."""
    missing = ["micro_batch"] if run.micro_batch is None else []
    return missing + (["interleave"] if run.interleave is None and run.layout.pp > 1 else [])


def candidates(run: Run) -> list[Layout]:
    """Every legal layout the published one leaves open (just the published layout when nothing is left out)."""
    lay = run.layout
    micro = [run.micro_batch] if run.micro_batch else divisors(max(1, run.global_batch // lay.dp))
    if run.interleave or lay.pp == 1:
        chunks = [run.interleave or 1]
    else:
        chunks = divisors(lay.stage_layers(run.model.layers))
    out = []
    for b in micro:
        for v in chunks:
            layout = dataclasses.replace(lay, micro_batch=b, interleave=v, schedule="interleaved" if v > 1 else "1f1b")
            try:
                check_layout(run.model, run.cluster, layout, run.global_batch)
            except ValueError as exc:
                if not unpublished(run):  # the published layout itself cannot run: say why
                    raise ValueError(f"{run.label}: {exc}") from None
                continue
            out.append(layout)
    if not out:
        raise ValueError(f"{run.label}: no micro-batch divides global_batch={run.global_batch} over dp={lay.dp} "
                         f"with a valid pipeline schedule")
    return out


def metric_value(run: Run, row: dict[str, Any]) -> float:
    """A planner row's prediction in the run's published metric."""
    peak = run.cluster.device.peak("bf16" if run.layout.precision == "bf16" else "fp32")
    return {"tokens_per_s_per_gpu": row["tokens_per_s"] / run.gpus, "mfu": row["mfu"],
            "tflops_per_gpu_model": row["mfu"] * peak / 1e12, "tflops_per_gpu_hw": row["hfu"] * peak / 1e12}[run.metric]


def _fastest(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The planner's advice among ``rows``: the least step time, a tie going to the layout needing less memory."""
    return min(rows, key=lambda r: (r["step_s"], r["peak_bytes"]))


def predict(run: Run) -> dict[str, Any]:
    """The planner's row for ``run`` (its advised layout where choices were unpublished) with ``predicted`` (in
    the run's metric), ``error`` (predicted over published, less one), ``low`` and ``high`` (the prediction's
    range over every candidate that fits), ``candidates`` and ``feasible_count`` (how many choices, how many fit),
    ``fits`` (the predicted layout fits by the memory model), ``scored``, ``note``, and ``mfu_published`` (the
    published figure as a share of peak). Unscored: ``predicted`` and ``error`` are NaN."""
    rows = [evaluate(run.model, run.cluster, layout, run.global_batch) for layout in candidates(run)]
    fits = [r for r in rows if r["feasible"]]
    values = [metric_value(run, r) for r in fits]
    gb = run.cluster.gpu_memory_bytes / 1e9
    if not unpublished(run):
        row, scored = rows[0], True
        over = f"published layout; the memory model puts it at {row['peak_bytes'] / 1e9:.1f} GB of {gb:.0f}"
        note = "" if fits else over
    elif fits:
        row, scored, note = _fastest(fits), True, ""
    else:
        row, scored = min(rows, key=lambda r: r["peak_bytes"]), False
        note = (f"not scored: none of the {len(rows)} choices of {' and '.join(unpublished(run))} fits "
                f"(the smallest needs {row['peak_bytes'] / 1e9:.1f} GB of {gb:.0f})")
    if not run.attention_published:  # said beside the prediction: an assumption, not a choice searched over
        note = "; ".join(filter(None, [f"attention not published: taken as {ATTENTION_DEFAULT}", note]))
    predicted = metric_value(run, row) if scored else math.nan
    if not unpublished(run):
        values = [predicted]  # nothing was chosen: no range
    # every metric is proportional to throughput, so the published figure is an MFU through any row's FLOP count
    mfu_published = row["mfu"] * run.value / metric_value(run, row)
    return {**row, "predicted": predicted, "published": run.value, "error": predicted / run.value - 1,
            "mfu_published": mfu_published,
            "low": min(values) if values else math.nan, "high": max(values) if values else math.nan,
            "candidates": len(rows), "feasible_count": len(fits), "fits": bool(row["feasible"]), "scored": scored,
            "note": note}
