"""Throughput per tier at world sizes 1 and 2, weak-scaling efficiency of ddp, and naive vs bucketed DDP.

All runs of a round go one after another (interleaved), round after round:

1. throughput: samples/s of tiers single (world 1 only), dp, ddp-naive, ddp and
   zero at world sizes 1 and 2, threads per rank = cores / world size, on one
   fixed job (MLP, fixed global batch);
2. weak scaling of ddp with one thread per rank on a compute-bound MLP (width
   1024, per-rank batch 1024, so compute is ~10x the gradient all-reduce):
   efficiency = per-rank samples/s at world 2 / samples/s at world 1. Target
   >= 0.7. The same with a per-rank batch of 64 (communication-bound) is
   reported beside it, to show what the target depends on;
3. naive vs bucketed DDP: step time of ddp-naive / ddp at world size 2 on the
   job of (1) (above 1: bucketing and overlap pay).

    .venv/bin/python benchmarks/scaling.py [--quick] [--out results/bench]
"""

from __future__ import annotations

import os

import _common as common

from dtlab.core.config import RunConfig
from dtlab.train import run

NAME = "scaling"
TARGET_EFFICIENCY = 0.7
TIERS = ("single", "dp", "ddp-naive", "ddp", "zero")
WORLDS = (1, 2)
PER_RANK_BATCH = {"weak": 1024, "weak-small": 64}
WEAK_WIDTH = 1024


def jobs(quick: bool) -> dict[str, RunConfig]:
    cores = os.cpu_count() or 1
    steps = 8 if quick else 40
    size = 64 if quick else 512
    base = RunConfig(model="mlp", model_size=size, dataset="synthetic", dataset_size=8192, global_batch_size=128,
                     steps=steps, optimizer="sgd", lr=0.05)
    out = {}
    for tier in TIERS:
        for world in WORLDS:
            if tier == "single" and world != 1:
                continue
            out[f"{tier}-w{world}"] = base.replace(tier=tier, world_size=world,
                                                   threads_per_rank=max(1, cores // world))
    for name, per_rank in PER_RANK_BATCH.items():
        for world in WORLDS:
            out[f"{name}-ddp-w{world}"] = base.replace(
                tier="ddp", world_size=world, threads_per_rank=1, steps=min(steps, 20),
                model_size=size if quick else WEAK_WIDTH, global_batch_size=(64 if quick else per_rank) * world)
    return out


def variant(key: str, cfg: RunConfig, steps_out: list):
    def go(round_: int) -> dict:
        result = run(cfg, progress=False)
        steps_out.extend(common.steps_rows(result, round=round_, variant=key))
        step_s = common.steady_step_s(result)
        return {"tier": cfg.tier, "world_size": cfg.world_size, "threads_per_rank": cfg.resolved_threads,
                "processes": len(result.ranks), "model_size": cfg.model_size,
                "global_batch": cfg.global_batch_size, "steps": cfg.steps, "median_step_s": step_s,
                "samples_per_s": cfg.global_batch_size / step_s,
                "per_rank_samples_per_s": cfg.global_batch_size / step_s / cfg.world_size, "wall_s": result.wall_s}
    return go


def main() -> None:
    args = common.parse(common.parser(__doc__))
    steps_rows: list = []
    variants = {key: variant(key, cfg, steps_rows) for key, cfg in jobs(args.quick).items()}
    rows = common.interleave(variants, common.repeats(args, full=7, quick=1), warmup_rounds=0 if args.quick else 1,
                             log=common.note)
    common.write_csv(args.out / f"{NAME}.csv", rows)
    common.write_csv(args.out / f"{NAME}_steps.csv", steps_rows)

    print(f"{NAME}.throughput (medians over rounds):", flush=True)
    print(f"  {'run':<18} {'threads/rank':>12} {'samples/s':>10} {'step ms':>8}", flush=True)
    for key in variants:
        mine = [r for r in rows if r["variant"] == key and r["round"] >= 0]
        sps = common.median(r["samples_per_s"] for r in mine)
        ms = common.median(r["median_step_s"] for r in mine) * 1e3
        print(f"  {key:<18} {mine[0]['threads_per_rank']:>12} {sps:>10.0f} {ms:>8.2f}", flush=True)

    eff = common.ratios(rows, "weak-ddp-w2", "weak-ddp-w1", "per_rank_samples_per_s")
    common.note(f"weak-scaling efficiency per round: {common.spread(eff)}")
    efficiency = common.median(eff)
    small = common.median(common.ratios(rows, "weak-small-ddp-w2", "weak-small-ddp-w1", "per_rank_samples_per_s"))
    common.result_line(NAME, efficiency, f">= {TARGET_EFFICIENCY}", quick=args.quick,
                       passed=efficiency >= TARGET_EFFICIENCY,
                       detail=f"weak-scaling efficiency of ddp (per-rank samples/s w2 / w1, MLP {WEAK_WIDTH}, "
                              f"per-rank batch {PER_RANK_BATCH['weak']}, 1 thread/rank); "
                              f"{small:.2f} at per-rank batch {PER_RANK_BATCH['weak-small']}")
    naive = common.ratios(rows, "ddp-naive-w2", "ddp-w2", "median_step_s")
    common.note(f"ddp-naive/ddp step time per round: {common.spread(naive)}")
    common.result_line(f"{NAME}.naive_vs_bucketed", common.median(naive), "none: > 1 means bucketing pays",
                       quick=args.quick, detail="step time ddp-naive / ddp at world 2")


if __name__ == "__main__":
    main()
