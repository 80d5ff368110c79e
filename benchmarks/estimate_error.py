"""The memory estimator against measured runs: every estimated tier, world sizes 1, 2 and 4, three models.

For each point, ``dtlab.estimate`` predicts the bytes per rank and kind without
starting anything (fake tensors), then the same job runs for real and counts
its tensors. A point's error is that of the largest rank's total (parameters,
gradients, optimizer state, activations and communication buffers); the CSV
keeps every rank and kind. Nothing is fitted: the estimator has no parameters.
World size 4 on this 2-core machine is oversubscribed, which changes no count.

Prints ``estimate_error.memory_median`` (target <= 0.05) and
``estimate_error.memory_worst`` (target <= 0.15) and writes ``estimate_error.csv``.

    .venv/bin/python benchmarks/estimate_error.py [--quick] [--out results/bench]
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import _common as common

from dtlab.analysis.estimate import compare, estimate
from dtlab.core.config import RunConfig
from dtlab.tiers import pipeline
from dtlab.train import run

NAME = "estimate_error"
MODELS = {"mlp": {"model": "mlp", "model_size": 128, "model_depth": 4},
          "cnn": {"model": "cnn", "model_size": 16},
          "charformer": {"model": "charformer", "dataset": "text", "model_size": 32, "model_depth": 4}}


def points(quick: bool) -> Iterator[tuple[str, RunConfig]]:
    """(label, job) for every tier the estimator covers, on each model it can run, at each world size
    (quick: the mlp's ddp, fsdp and 1F1B at world 2, enough to see that the benchmark runs)."""
    base = RunConfig(steps=2, global_batch_size=32, threads_per_rank=1, timeout_s=120)
    if quick:
        job = base.replace(**MODELS["mlp"])
        yield "ddp w2 mlp", job.replace(tier="ddp", world_size=2)
        yield "fsdp w2 mlp", job.replace(tier="fsdp", world_size=2)
        yield "pipeline 1f1b w2 mlp", job.replace(tier="pipeline", world_size=2,
                                                  tier_options=pipeline.Options(schedule="1f1b"))
        return
    for model in MODELS:
        job = base.replace(**MODELS[model])
        for ac in (False, True) if model == "charformer" else (False,):
            suffix = f" {model}{' +AC' if ac else ''}"
            yield f"single{suffix}", job.replace(activation_checkpointing=ac)
            for tier in ("ddp", "zero", "fsdp"):
                for n in (1, 2, 4):
                    yield f"{tier} w{n}{suffix}", job.replace(tier=tier, world_size=n, activation_checkpointing=ac)
        for schedule in ("gpipe", "1f1b") if model != "cnn" else ():  # the pipeline splits mlp and charformer
            for n in (2, 4):
                options = pipeline.Options(schedule=schedule, microbatches=8)
                yield f"pipeline {schedule} w{n} {model}", job.replace(tier="pipeline", world_size=n,
                                                                       tier_options=options)


def main() -> None:
    args = common.parse(common.parser(__doc__))
    rows, errors = [], {}
    for label, cfg in points(args.quick):
        est = estimate(cfg)
        result = run(cfg, progress=False)
        table = compare(est, result)
        measured = {r: sum(g["measured"]) for r, g in table.groupby("rank")}
        top = max(measured, key=measured.get)
        predicted = sum(table[table["rank"] == top]["predicted"])
        errors[label] = (predicted - measured[top]) / measured[top]
        print(f"  {label:32} predicted {predicted / 1e6:8.3f} MB  measured {measured[top] / 1e6:8.3f} MB  "
              f"error {errors[label]:+.2%}", flush=True)
        rows += [{"point": label, **row} for row in table.to_dict("records")]
    median = statistics.median(abs(e) for e in errors.values())
    label, worst = max(errors.items(), key=lambda kv: abs(kv[1]))
    common.result_line(f"{NAME}.memory_median", median, "<= 0.05", quick=args.quick, passed=median <= 0.05,
                       detail=f"{len(errors)} points, largest rank's total bytes, predicted vs counted")
    common.result_line(f"{NAME}.memory_worst", abs(worst), "<= 0.15", quick=args.quick, passed=abs(worst) <= 0.15,
                       detail=f"worst point: {label} ({worst:+.2%})")
    common.write_csv(args.out / f"{NAME}.csv", rows)


if __name__ == "__main__":
    main()
