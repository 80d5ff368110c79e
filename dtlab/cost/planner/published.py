"""The published runs beside the planner's predictions, in the shape notebook 19's figures read.

``published_frame`` predicts every run of a table in ``planner.runs.SCHEMA`` (``data/published_runs.csv``
by default) at its published layout (``planner.prediction.predict``; by default each source with the
constants refitted without it, ``planner.fit.out_of_sample``) and puts each on one scale: the
share of the GPU's peak its model FLOPs reach (MFU), published and predicted. For one run every
metric is proportional to its throughput, so a published figure in any metric (hardware TFLOP/s,
tokens per second, MFU) becomes a published MFU as ``predicted MFU x published / predicted``: the
FLOP counts are the planner's (6N plus attention, PaLM's), the throughput the source's.
``family`` sorts a layout into the three the figure sets side by side; ``step_parts`` says where a
predicted step's time goes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from dtlab.cost.planner import fit
from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.prediction import predict
from dtlab.cost.planner.runs import Run, read_runs
from dtlab.cost.planner.validate import DEFAULT_RUNS

__all__ = ["FAMILIES", "PARTS", "family", "published_frame", "step_parts"]

FAMILIES = ("data parallel, FSDP", "tensor parallel", "tensor + pipeline parallel")
# a predicted step's parts (planner.step.step_time's keys), which add up to its step_s
PARTS = {"compute": "compute_s", "pipeline bubble": "bubble_s", "tensor-parallel comm.": "tp_comm_s",
         "context-parallel comm.": "cp_comm_s", "pipeline sends": "pp_comm_s", "expert all-to-alls": "ep_comm_s",
         "data-parallel comm. exposed": "dp_exposed_s", "optimizer": "optimizer_s"}


def family(layout: Layout) -> str:
    """Which of ``FAMILIES`` a layout belongs to: no model split (dp, ZeRO, FSDP), tensor parallel only, or
    pipeline stages too (with or without context parallelism)."""
    if layout.pp > 1:
        return FAMILIES[2]
    return FAMILIES[1] if layout.tp > 1 else FAMILIES[0]


def _layout_label(run: Run, row: dict) -> str:
    lay = run.layout
    parts = [f"tp{lay.tp}", f"pp{lay.pp}", f"dp{lay.dp}"] + ([f"cp{lay.cp}"] if lay.cp > 1 else [])
    return " ".join(parts + [f"ZeRO-{lay.zero}", lay.checkpointing, f"b{row['micro_batch']}"])


def published_frame(runs: Sequence[Run] | None = None, out_of_sample: bool = True) -> pd.DataFrame:
    """One row per run: where it comes from, its model and layout (``family``; ``replica_tokens``, the tokens a
    data-parallel replica computes per step, which its gradients' reduction must hide behind), the published and
    predicted values in its own metric with the error, both as MFU and HFU (``mfu_published``, ``mfu_predicted``,
    ...), whether it is ``scored`` (``planner.prediction``), and the predicted step's parts in seconds
    (``PARTS``). ``out_of_sample``: each source predicted with the constants refitted without it (``planner.fit``,
    leave one source out); else with the committed constants, as the planner predicts a run it has not seen."""
    runs = read_runs(DEFAULT_RUNS) if runs is None else runs
    predicted = fit.out_of_sample(runs) if out_of_sample else [predict(run) for run in runs]
    rows = []
    for run, p in zip(runs, predicted, strict=True):
        hardware_over_model = p["hfu"] / p["mfu"]  # recomputation's share, the same at any throughput
        rows.append({"row": run.index, "source": fit.source_of(run), "model": run.model.name,
                     "parameters": run.model.parameters(), "gpu": run.gpu, "gpus": run.gpus, "tp": run.layout.tp,
                     "pp": run.layout.pp, "dp": run.layout.dp, "cp": run.layout.cp,
                     "family": family(run.layout), "layout": _layout_label(run, p),
                     "replica_tokens": run.global_batch * run.model.seq // run.layout.dp, "metric": run.metric,
                     "published": run.value, "predicted": p["predicted"], "error": p["error"], "scored": p["scored"],
                     "mfu_published": p["mfu_published"], "mfu_predicted": p["mfu"] if p["scored"] else math.nan,
                     "hfu_published": p["mfu_published"] * hardware_over_model,
                     "hfu_predicted": p["hfu"] if p["scored"] else math.nan, "step_s": p["step_s"],
                     **{column: p[column] for column in PARTS.values()}})
    return pd.DataFrame(rows)


def step_parts(frame: pd.DataFrame) -> pd.DataFrame:
    """Per row of ``published_frame``, each part's share of the predicted step (they add up to 1)."""
    shares = pd.DataFrame({name: frame[column] / frame["step_s"] for name, column in PARTS.items()})
    shares.index = frame["model"] + ", " + frame["gpus"].astype(str) + " x " + frame["gpu"]
    return shares.loc[:, (shares > 0).any()]
