"""DDP step time against bucket_cap_mb, from one bucket per parameter to one bucket for the whole model.

An MLP of width 512 and depth 8 (18 parameters, 7.2 MiB of fp32 gradients)
trains with tier ddp at world size 2, one run per bucket cap, all caps
interleaved round after round. The smallest cap is below the smallest
parameter (a 40-byte bias), so each parameter gets its own bucket; the
largest holds the whole model in one. Runs record nothing (``record=False``:
pure DDP); the bucket layout DDP built (after its rebuild at step 0) comes
from the ddp tier's ``describe()``, which reads it from the reducer.

Writes ``bucket_sweep.csv`` (one row per run) and ``bucket_sweep.png``
(median step time against the cap); prints the best cap and worst/best.

    .venv/bin/python benchmarks/bucket_sweep.py [--quick] [--out results/bench]
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import _common as common

from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.tiers import ddp
from dtlab.train import run

NAME = "bucket_sweep"
WORLD = 2
# DDP's cap is in MiB; buckets close once they reach it. For the 512x8 MLP (checked with torch 2.13):
# 1e-5 (10 bytes): 18 buckets, one per parameter; 1e-3: 17 (the tiny head's weight and bias share one);
# 0.01: 9 (each weight with its bias); 0.1 and 1: 8 (the head joins the last layer); 2: 4; 3: 3; 4: 2;
# 8 (the model is 7.2 MiB): 1; 25 (DDP's default): 1.
CAPS_MB = (1e-5, 1e-3, 0.01, 0.1, 1.0, 2.0, 3.0, 4.0, 8.0, 25.0)
QUICK_CAPS_MB = (1e-5, 1.0, 25.0)
INPUT_SHAPE, NUM_CLASSES = (1, 8, 8), 10  # the synthetic data set's


def base_config(quick: bool) -> RunConfig:
    width, depth = (64, 4) if quick else (512, 8)
    return RunConfig(tier="ddp", world_size=WORLD, model=functools.partial(models.mlp, width=width, depth=depth),
                     dataset="synthetic", dataset_size=4096, global_batch_size=128, steps=8 if quick else 30,
                     optimizer="sgd", lr=0.05, threads_per_rank=max(1, (os.cpu_count() or 1) // WORLD))


def variant(cfg: RunConfig, layout: dict, steps_out: list):
    cap = cfg.tier_options.bucket_cap_mb

    def go(round_: int) -> dict:
        result = run(cfg, progress=False, record=False)
        steps_out.extend(common.steps_rows(result, round=round_, bucket_cap_mb=cap))
        sizes = result.ranks[0].strategy["bucket_sizes_bytes"]
        layout[cap] = (len(sizes), sum(sizes))
        return {"bucket_cap_mb": cap, "buckets": len(sizes), "gradient_bytes": sum(sizes),
                "bucket_sizes_bytes": list(sizes), "median_step_s": common.steady_step_s(result),
                "wall_s": result.wall_s}
    return go


def plot(path: Path, caps: list[float], rows: list[dict], layout: dict, title: str) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.subplots()
    med, lo, hi = [], [], []
    for cap in caps:
        times = [r["median_step_s"] * 1e3 for r in rows if r["bucket_cap_mb"] == cap and r["round"] >= 0]
        med.append(common.median(times))
        lo.append(min(times))
        hi.append(max(times))
    ax.fill_between(caps, lo, hi, alpha=0.25, label="min-max over rounds")
    ax.plot(caps, med, marker="o", label="median over rounds")
    for cap, y in zip(caps, med):
        ax.annotate(f"{layout[cap][0]}", (cap, y), textcoords="offset points", xytext=(0, 7), ha="center",
                    fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bucket_cap_mb (MB, log)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{title}\n(numbers: buckets per step)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)
    common.note(f"wrote {path}")
    return path


def main() -> None:
    args = common.parse(common.parser(__doc__))
    base = base_config(args.quick)
    caps = list(QUICK_CAPS_MB if args.quick else CAPS_MB)
    layout: dict[float, tuple[int, int]] = {}
    steps_rows: list = []
    variants = {f"cap={cap:g}": variant(base.replace(tier_options=ddp.Options(bucket_cap_mb=cap)), layout, steps_rows)
                for cap in caps}
    rows = common.interleave(variants, common.repeats(args, full=8, quick=1), warmup_rounds=0 if args.quick else 1,
                             log=common.note)
    model = base.model.keywords
    rows = [{"model": f"mlp width {model['width']} depth {model['depth']}", "world_size": WORLD,
             "threads_per_rank": base.resolved_threads, "global_batch": base.global_batch_size, "steps": base.steps,
             **r} for r in rows]
    common.write_csv(args.out / f"{NAME}.csv", rows)
    common.write_csv(args.out / f"{NAME}_steps.csv", steps_rows)
    plot(args.out / f"{NAME}.png", caps, rows, layout,
         f"DDP, MLP {model['width']}x{model['depth']}, world {WORLD}, gloo, {base.resolved_threads} thread/rank")

    params = len(list(base.model(INPUT_SHAPE, NUM_CLASSES).parameters()))
    if layout[caps[0]][0] != params or layout[caps[-1]][0] != 1:
        common.note(f"warning: the sweep does not span one bucket per parameter ({params}) to one bucket: "
                    f"{layout[caps[0]][0]} to {layout[caps[-1]][0]} buckets")
    medians = {cap: common.median(common.per_round(rows, f"cap={cap:g}", "median_step_s").values()) for cap in caps}
    for cap in caps:
        common.note(f"bucket_cap_mb {cap:>8g}: {layout[cap][0]:>3} buckets, median step {medians[cap] * 1e3:.2f} ms")
    best = min(caps, key=medians.get)
    worst = max(caps, key=medians.get)
    common.result_line(NAME, medians[worst] / medians[best], "none: worst/best step time", quick=args.quick,
                       detail=f"best bucket_cap_mb {best:g} ({layout[best][0]} buckets, "
                              f"{medians[best] * 1e3:.2f} ms), worst {worst:g} ({layout[worst][0]} buckets, "
                              f"{medians[worst] * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
