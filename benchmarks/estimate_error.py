"""The memory estimator against measured runs: every estimated tier, world sizes 1, 2 and 4, three models.

For each point, ``dtlab.estimate`` predicts the bytes per rank and kind without
starting anything (fake tensors), then the same job runs for real and counts
its tensors. A point's error is that of the largest rank's total (parameters,
gradients, optimizer state, activations and communication buffers); the CSV
keeps every rank and kind. Nothing is fitted: the estimator has no parameters.
World size 4 on this 2-core machine is oversubscribed, which changes no count.

Step time: one link per collective is calibrated on a sweep of that collective at
world size 2 (``estimate.calibration``, which the width sweep of ``dtlab.experiments.speedup`` shares:
all_reduce, all_gather, reduce_scatter, broadcast); then in each round what a collective costs beyond
the link's price for it between a step's compute, slow wake-ups included (``costmodel.with_busy``, after 5 ms and after
0.5 ms of compute, on a synthetic job of matrix products and all-reduces, never on a step point;
measured again each round, as the machine's speed drifts), and every step point is predicted (its
ranks' compute timed at once in child processes, for fsdp, tp, fsdp-tp and cp on the fake backend;
the tier's communication on the links) and run unrecorded (the prediction is of
training, not of dtlab's instrumentation), side by side, the rounds interleaved:
a point's error is the median over rounds of each round's prediction against the same round's
measurement (the table shows the medians of each). The step points: single, ddp, zero, fsdp at
world 1 and 2, GPipe, 1F1B and tp on the mlp (width 512, depth 4); ddp on the cnn; single, ddp
with and without activation checkpointing, fsdp, tp and cp on the charformer. World size 4 (ddp
on the mlp, fsdp-tp 2 x 2 on the charformer) is oversubscribed on 2 cores: reported, not counted.

Each step point is predicted twice in each round: with the compute timed here (``compute="timed"``,
the estimator's default: a rank's compute run as the ranks run it) and, for the tiers whose compute is
the single tier's at a rank's batch (single, ddp, zero), with the compute predicted on this machine's
measured roofline (``compute=`` the saved ``roofline.json``, measured first if there is none:
``python -m dtlab.cost.roofline``), nothing of the job run. The other tiers' rows show no
roofline figure.

Prints ``estimate_error.memory_median`` (target <= 0.05), ``estimate_error.memory_worst``
(target <= 0.15), ``estimate_error.step_median`` (target <= 0.15) and
``estimate_error.step_worst`` (target <= 0.30, counted points), both with the compute timed;
``estimate_error.step_median_roofline`` and ``estimate_error.step_worst_roofline`` (no target: the
points the roofline covers); and writes ``estimate_error.csv`` and ``estimate_error_steps.csv``.

    .venv/bin/python benchmarks/estimate_error.py [--quick] [--out results/bench] [--part steps|memory]
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import _common as common

from dtlab.core.config import RunConfig
from dtlab.cost.estimate import compare, estimate
from dtlab.cost.estimate.calibration import RoundLinks, calibrate_link
from dtlab.cost.estimate.step import PREDICTED_TIERS
from dtlab.cost.roofline.saved import machine_roofline
from dtlab.tiers import pipeline, tp
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
        if model != "cnn":  # tensor parallelism and the pipeline split the mlp and the charformer
            yield f"tp w2 {model}", job.replace(tier="tp", world_size=2)
        if model == "charformer":
            yield "tp w2 charformer +SP", job.replace(tier="tp", world_size=2,
                                                      tier_options=tp.Options(sequence_parallel=True))
            yield "fsdp-tp w4 (2x2) charformer", job.replace(tier="fsdp-tp", world_size=4)
            for n in (2, 4):
                yield f"cp w{n} charformer", job.replace(tier="cp", world_size=n)
        for schedule in ("gpipe", "1f1b") if model != "cnn" else ():
            for n in (2, 4):
                options = pipeline.Options(schedule=schedule, microbatches=8)
                yield f"pipeline {schedule} w{n} {model}", job.replace(tier="pipeline", world_size=n,
                                                                       tier_options=options)


def step_points(quick: bool) -> dict[str, RunConfig]:
    base = RunConfig(steps=6 if quick else 25, global_batch_size=64, model_size=512, model_depth=4, timeout_s=180)
    pipe = {s: pipeline.Options(schedule=s, microbatches=4) for s in ("gpipe", "1f1b")}
    if quick:
        return {"ddp w2 mlp512": base.replace(tier="ddp", world_size=2)}
    char = base.replace(model="charformer", dataset="text", model_size=64, model_depth=2, global_batch_size=32)
    cnn = base.replace(model="cnn", model_size=16)
    return {"single mlp512": base, "ddp w2 mlp512": base.replace(tier="ddp", world_size=2),
            "zero w2 mlp512": base.replace(tier="zero", world_size=2),
            "fsdp w1 mlp512": base.replace(tier="fsdp", world_size=1),
            "fsdp w2 mlp512": base.replace(tier="fsdp", world_size=2),
            "pipeline gpipe w2 mlp512": base.replace(tier="pipeline", world_size=2, tier_options=pipe["gpipe"]),
            "pipeline 1f1b w2 mlp512": base.replace(tier="pipeline", world_size=2, tier_options=pipe["1f1b"]),
            "ddp w4 mlp512 (oversubscribed)": base.replace(tier="ddp", world_size=4),
            "ddp w2 cnn": cnn.replace(tier="ddp", world_size=2),
            "single charformer": char, "ddp w2 charformer": char.replace(tier="ddp", world_size=2),
            "ddp w2 charformer +AC": char.replace(tier="ddp", world_size=2, activation_checkpointing=True),
            "fsdp w2 charformer": char.replace(tier="fsdp", world_size=2),
            "tp w2 mlp512": base.replace(tier="tp", world_size=2),
            "tp w2 charformer": char.replace(tier="tp", world_size=2),
            "cp w2 charformer": char.replace(tier="cp", world_size=2),
            "fsdp-tp w4 (2x2) charformer (oversubscribed)": char.replace(tier="fsdp-tp", world_size=4)}


def step_errors(args) -> None:
    link = calibrate_link(2, quick=args.quick)
    print(link.describe(), flush=True)
    # busy_s on a synthetic job (matrix products, then an all-reduce), never one of the points below,
    # measured as each round starts (-1: the warm-up round)
    link_for = RoundLinks(link, 2, quick=args.quick, log=lambda line: print(line, flush=True))

    jobs = step_points(args.quick)
    roof = machine_roofline(quick=args.quick, say=lambda line: print(line, flush=True))

    def side_by_side(cfg: RunConfig, round_: int) -> dict[str, float]:
        # predicted and measured in the same round: a shared machine's speed drifts between rounds
        out = {"predicted_ms": estimate(cfg, link_for(round_)).step_ms}
        if cfg.tier in PREDICTED_TIERS:
            out["roofline_ms"] = estimate(cfg, link_for(round_), compute=roof).step_ms
        return {**out, "step_ms": common.steady_step_s(run(cfg, progress=False, record=False)) * 1e3}

    variants = {label: (lambda r, cfg=cfg: side_by_side(cfg, r)) for label, cfg in jobs.items()}
    rows = common.interleave(variants, common.repeats(args, 3), log=print)
    errors, on_roofline, out = {}, {}, []
    for label, cfg in jobs.items():
        measured, predicted = (common.per_round(rows, label, key) for key in ("step_ms", "predicted_ms"))
        # each round's prediction against the same round's measurement, then the median over rounds
        errors[label] = common.median((predicted[r] - measured[r]) / measured[r] for r in measured)
        row = {"point": label, "predicted_ms": common.median(predicted.values()),
               "measured_ms": common.median(measured.values()), "error": errors[label]}
        if cfg.tier in PREDICTED_TIERS:
            roofline = common.per_round(rows, label, "roofline_ms")
            on_roofline[label] = common.median((roofline[r] - measured[r]) / measured[r] for r in measured)
            row |= {"roofline_ms": common.median(roofline.values()), "roofline_error": on_roofline[label]}
        out.append(row)
        also = (f"  on the roofline {row['roofline_ms']:8.2f} ms  error {row['roofline_error']:+.1%}"
                if "roofline_ms" in row else "")
        print(f"  {label:32} predicted {row['predicted_ms']:8.2f} ms  measured {row['measured_ms']:8.2f} ms  "
              f"error {errors[label]:+.1%}{also}", flush=True)
    _roofline_lines(args, on_roofline, roof)
    counted = {k: abs(v) for k, v in errors.items() if "oversubscribed" not in k}
    median = common.median(counted.values())
    worst = max(counted, key=counted.get)
    common.result_line(f"{NAME}.step_median", median, "<= 0.15", quick=args.quick, passed=median <= 0.15,
                       detail=f"{len(counted)} counted points; links: {link.label}; busy_s per round "
                              f"{link_for.busy_text('busy_s')} ms, after 0.5 ms "
                              f"{link_for.busy_text('busy_short_s')} ms")
    common.result_line(f"{NAME}.step_worst", counted[worst], "<= 0.30", quick=args.quick,
                       passed=counted[worst] <= 0.30, detail=f"worst counted point: {worst} ({errors[worst]:+.1%})")
    common.write_csv(args.out / f"{NAME}_steps.csv", out)


def _roofline_lines(args, errors: dict[str, float], roof) -> None:
    """The points the roofline covers, their compute predicted on it: median and worst error (no target)."""
    counted = {k: abs(v) for k, v in errors.items() if "oversubscribed" not in k}
    if not counted:
        return
    worst = max(counted, key=counted.get)
    where = f"roofline measured {roof.machine.get('measured', '?')}"
    common.result_line(f"{NAME}.step_median_roofline", common.median(counted.values()), "none: compare with "
                       "step_median", quick=args.quick, detail=f"{len(counted)} counted points; {where}")
    common.result_line(f"{NAME}.step_worst_roofline", counted[worst], "none: compare with step_worst",
                       quick=args.quick, detail=f"worst counted point: {worst} ({errors[worst]:+.1%})")


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--part", choices=("steps", "memory", "both"), default="both", help="what to measure (both)")
    args = common.parse(p)
    if args.part != "memory":
        step_errors(args)
    if args.part != "steps":
        memory_errors(args)


def memory_errors(args) -> None:
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
