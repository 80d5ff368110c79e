"""The planner against published training runs: ``python -m dtlab.cost.planner.validate [--runs FILE]``.

Each row of the CSV (``planner.runs.SCHEMA``; ``data/published_runs.csv`` by default) is predicted at its
published layout — not the search's best — with the same model for every row: where the source left the
micro-batch or the interleaving out, the planner takes its fastest choice that fits in memory. It prints
one line per run (published, predicted, error) and a median per source, and ends with exactly one line::

    published runs: N; median |error| X %; worst Y % (ROW)

``predict(run)`` and ``validate(runs)`` do the same without printing (notebooks, tests).

The model's one constant fitted to training runs, ``roofline.devices.SUSTAINED`` (the share of its best
GEMM rate a GPU keeps inside a training step), is fitted by ``fit_sustained(runs, source)``: the value
at which the median signed error over that source's rows is zero (``--fit SOURCE`` prints it; the
committed value comes from ``--fit "Narayanan et al. 2021"``, every other source held out).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from dtlab.cost.planner.layout import check_layout
from dtlab.cost.planner.runs import Run, read_runs
from dtlab.cost.planner.search import evaluate
from dtlab.cost.roofline import devices

__all__ = ["DEFAULT_RUNS", "MICRO_BATCHES", "fit_sustained", "main", "predict", "summary", "sustained", "validate"]

DEFAULT_RUNS = Path(__file__).resolve().parents[3] / "data" / "published_runs.csv"
MICRO_BATCHES = (1, 2, 4, 8, 16)  # tried where a run does not publish its micro-batch
INTERLEAVES = (1, 2, 3, 4, 5, 6, 8)  # model chunks per GPU tried where a pipelined run does not publish them


def _candidates(run: Run) -> list[tuple[int, int]]:
    micro = [run.micro_batch] if run.micro_batch else [b for b in MICRO_BATCHES
                                                       if run.global_batch % (run.layout.dp * b) == 0]
    if run.interleave:
        chunks = [run.interleave]
    elif run.layout.pp == 1:
        chunks = [1]
    else:
        chunks = [v for v in INTERLEAVES if run.layout.stage_layers(run.model.layers) % v == 0]
    return [(b, v) for b in micro for v in chunks]


def predict(run: Run) -> dict[str, Any]:
    """The planner's row for ``run`` at its published layout, with ``predicted`` (the run's metric) and ``error``
    (predicted over published, less one). ValueError naming the run if its published layout cannot run."""
    rows = []
    for b, v in _candidates(run):
        layout = dataclasses.replace(run.layout, micro_batch=b, interleave=v,
                                     schedule="interleaved" if v > 1 else "1f1b")
        try:
            check_layout(run.model, run.cluster, layout, run.global_batch)
        except ValueError as exc:
            if run.micro_batch and run.interleave:
                raise ValueError(f"{run.label}: {exc}") from None
            continue
        rows.append(evaluate(run.model, run.cluster, layout, run.global_batch))
    if not rows:
        raise ValueError(f"{run.label}: no micro-batch of {MICRO_BATCHES} divides global_batch={run.global_batch} "
                         f"over dp={run.layout.dp} with a valid pipeline schedule")
    fits = [r for r in rows if r["feasible"]]
    row = min(fits or rows, key=lambda r: r["step_s"])
    peak = run.cluster.device.peak("bf16" if run.layout.precision == "bf16" else "fp32")
    predicted = {"tokens_per_s_per_gpu": row["tokens_per_s"] / run.gpus, "mfu": row["mfu"],
                 "tflops_per_gpu_model": row["mfu"] * peak / 1e12,
                 "tflops_per_gpu_hw": row["hfu"] * peak / 1e12}[run.metric]
    return {**row, "predicted": predicted, "published": run.value, "error": predicted / run.value - 1,
            "fits": bool(fits)}


def validate(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per run: where it comes from, its layout, published and predicted values, the error."""
    out = []
    for run in runs:
        p = predict(run)
        layout = (f"tp{run.layout.tp} pp{run.layout.pp} dp{run.layout.dp}" + (f" cp{run.layout.cp}" if run.layout.cp
                                                                               > 1 else "")
                  + f" z{run.layout.zero} {run.layout.checkpointing} b{p['micro_batch']}"
                  + (f" v{p['interleave']}" if p["interleave"] > 1 else ""))
        out.append({"row": run.index, "source": run.source.split(",")[0], "model": run.model.name,
                    "gpus": f"{run.gpus} x {run.gpu}", "layout": layout + ("" if p["fits"] else " (no fit)"),
                    "metric": run.metric, "published": run.value, "predicted": p["predicted"],
                    "error": p["error"], "label": run.label})
    return pd.DataFrame(out)


def summary(table: pd.DataFrame) -> str:
    """``published runs: N; median |error| X %; worst Y % (ROW)``."""
    errors = table["error"].abs()
    worst = table.loc[errors.idxmax()]
    return (f"published runs: {len(table)}; median |error| {100 * statistics.median(errors):.1f} %; "
            f"worst {100 * worst['error']:+.1f} % ({worst['label']})")


@contextlib.contextmanager
def sustained(value: float) -> Iterator[None]:
    """``roofline.devices.SUSTAINED`` set to ``value`` for the duration (what-if questions and the fit)."""
    before = devices.SUSTAINED
    devices.SUSTAINED = value
    try:
        yield
    finally:
        devices.SUSTAINED = before


def fit_sustained(runs: Sequence[Run], source: str, low: float = 0.4, high: float = 1.2) -> float:
    """The ``SUSTAINED`` at which the median signed error of the runs whose source starts with ``source`` is zero
    (bisection: a larger value predicts every run faster)."""
    chosen = [run for run in runs if run.source.startswith(source)]
    if not chosen:
        raise ValueError(f"--fit {source!r}: no run's source starts with it")
    for _ in range(30):
        middle = (low + high) / 2
        with sustained(middle):
            error = statistics.median(predict(run)["error"] for run in chosen)
        low, high = (middle, high) if error < 0 else (low, middle)
    return round((low + high) / 2, 3)


def _print(table: pd.DataFrame) -> None:
    shown = table.drop(columns="label").assign(error=(100 * table["error"]).map("{:+.1f} %".format))
    with pd.option_context("display.width", 200, "display.max_colwidth", 40, "display.float_format", "{:.4g}".format):
        print(shown.to_string(index=False))
        by_source = table.assign(abs_error=table["error"].abs()).groupby("source", sort=False)["abs_error"]
        print("\nmedian |error| by source:")
        for source, errors in by_source:
            print(f"  {source}: {100 * errors.median():.1f} % over {len(errors)} run(s)")
    print(summary(table))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.cost.planner.validate",
                                     description="Predict published training runs with the planner.")
    parser.add_argument("--runs", default=str(DEFAULT_RUNS), help="a CSV in planner.runs.SCHEMA "
                                                                 "(default: data/published_runs.csv)")
    parser.add_argument("--fit", metavar="SOURCE", help="print the SUSTAINED that zeroes the median error of the "
                                                        "runs whose source starts with SOURCE, and stop")
    args = parser.parse_args(argv)
    try:
        runs = read_runs(args.runs)
        if args.fit:
            print(f"SUSTAINED fitted on the runs of {args.fit!r}: {fit_sustained(runs, args.fit)}")
            return 0
        table = validate(runs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        _print(table)
    except BrokenPipeError:  # the reader stopped early (| head): not an error of ours
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - stays open until exit, so the final flush succeeds
    return 0


if __name__ == "__main__":
    sys.exit(main())
