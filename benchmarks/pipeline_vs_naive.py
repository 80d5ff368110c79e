"""Single device vs naive model-parallel split vs pipelining, and a sweep over the micro-batch count.

The shape of PyTorch's model-parallel tutorial (ResNet50 on 2 GPUs: single 3.75 s,
naive split 4.02 s, pipelined 2.43 s at its best split size), on this machine's
cores: a compute-bound MLP (width 1024, 8 hidden layers, global batch 512) runs

* ``single``: one rank with every core (threads_per_rank = cores);
* ``naive``: tier pipeline, 2 stages of 4 layers, one core each, one micro-batch
  (the whole batch) at a time: one stage computes while the other waits;
* ``gpipe-M`` and ``1f1b-M``: the same 2 stages pipelined over M micro-batches.

All variants run interleaved, round after round; ratios are taken within a round
and medianed over rounds. Targets: naive / single >= 1 (splitting alone gains
nothing) and best pipelined / naive <= 0.9. The sweep should bottom out inside the
range: few micro-batches leave a large bubble ((S-1)/(M+S-1) of each stage idle),
many pay per-micro-batch costs (a P2P transfer each way, small matmuls).

Per pipelined run it also sums the recorded sends and receives: the share of the step one was in flight,
and the share of the idle time that had one in flight; the load average is printed before and after.

Writes ``pipeline_vs_naive.csv`` (one row per run), ``pipeline_vs_naive_steps.csv``
and ``pipeline_vs_naive.png`` (step time against M, with naive and single marked).

    .venv/bin/python benchmarks/pipeline_vs_naive.py [--quick] [--out results/bench]
"""

from __future__ import annotations

import os
from pathlib import Path

import _common as common
import pandas as pd
from matplotlib.ticker import NullLocator

from dtlab import plots
from dtlab.core.config import RunConfig
from dtlab.cost import pipeline as pipeline_cost
from dtlab.read import pipeline as pipeline_analysis
from dtlab.tiers import pipeline
from dtlab.train import run

NAME = "pipeline_vs_naive"
STAGES = 2
TARGET_NAIVE, TARGET_PIPELINED = 1.0, 0.9
SWEEP = {"gpipe": (1, 2, 4, 8, 16), "1f1b": (2, 4, 8)}
QUICK_SWEEP = {"gpipe": (1, 2, 4), "1f1b": (2, 4)}
# More than RunResult.steady's default (1), on purpose: step 0 builds the schedule (a shape exchange) and
# step 1 still warms caches.
WARMUP_STEPS = 2


def jobs(quick: bool) -> dict[str, RunConfig]:
    cores = os.cpu_count() or 1
    width, batch, steps = (128, 64, 4) if quick else (1024, 512, 8)
    base = RunConfig(model="mlp", model_size=width, model_depth=8, dataset="synthetic", dataset_size=8192,
                     global_batch_size=batch, steps=steps, optimizer="sgd", lr=0.01)
    pp = base.replace(tier="pipeline", world_size=STAGES, threads_per_rank=max(1, cores // STAGES))
    out = {"single": base.replace(threads_per_rank=cores),
           "naive": pp.replace(tier_options=pipeline.Options(schedule="naive", microbatches=1))}
    for schedule, ms in (QUICK_SWEEP if quick else SWEEP).items():
        for m in ms:
            out[f"{schedule}-M{m}"] = pp.replace(tier_options=pipeline.Options(schedule=schedule, microbatches=m))
    return out


def variant(key: str, cfg: RunConfig, steps_out: list):
    o = cfg.tier_options

    def go(round_: int) -> dict:
        result = run(cfg, progress=False)
        steps_out.extend(common.steps_rows(result, round=round_, variant=key))
        row = {"tier": cfg.tier, "world_size": cfg.world_size, "threads_per_rank": cfg.resolved_threads,
               "schedule": getattr(o, "schedule", ""), "microbatches": getattr(o, "microbatches", ""),
               "median_step_s": common.steady_step_s(result, WARMUP_STEPS), "wall_s": result.wall_s}
        if cfg.tier == "pipeline":  # measured idle share of the stages over the steady steps
            bubble = pipeline_analysis.bubble_frame(result)
            first = result.steady(WARMUP_STEPS)["step"].min()
            row["idle_fraction"] = float(bubble[bubble["step"] >= first]["idle_fraction"].median())
            row["ideal_idle_fraction"] = pipeline_cost.ideal_bubble(o.schedule, STAGES, o.microbatches)
            # what the recorded sends and receives explain of the idle time (see read.pipeline.transfer_share)
            row["transfer_share"], row["idle_in_transfer"], row["idle_in_arrival"] = \
                pipeline_analysis.transfer_share(result)
        return row
    return go


def main() -> None:
    args = common.parse(common.parser(__doc__))
    configs = jobs(args.quick)
    load_before = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    steps_rows: list = []
    variants = {key: variant(key, cfg, steps_rows) for key, cfg in configs.items()}
    rows = common.interleave(variants, common.repeats(args, full=5, quick=1), warmup_rounds=0 if args.quick else 1,
                             log=common.note)
    common.write_csv(args.out / f"{NAME}.csv", rows)
    common.write_csv(args.out / f"{NAME}_steps.csv", steps_rows)

    vs_naive = {k: common.median(common.ratios(rows, k, "naive", "median_step_s")) for k in variants
                if k.startswith(("gpipe", "1f1b"))}
    pipelined = [k for k in vs_naive if configs[k].tier_options.microbatches > 1]  # gpipe-M1 is the naive split
    print(f"{NAME}.sweep (medians over rounds):", flush=True)
    print(f"  {'run':<10} {'step ms':>8} {'/ naive':>8} {'idle':>6} {'ideal':>6} {'in flight':>9} "
          f"{'idle in flight':>14}", flush=True)
    medians = {}
    for key in variants:
        mine = [r for r in rows if r["variant"] == key and r["round"] >= 0]
        medians[key] = common.median(r["median_step_s"] for r in mine) * 1e3
        idle = common.median(r.get("idle_fraction", float("nan")) for r in mine)
        ideal = mine[0].get("ideal_idle_fraction", float("nan"))
        moved = common.median(r.get("transfer_share", float("nan")) for r in mine)
        waited = common.median(r.get("idle_in_transfer", float("nan")) for r in mine)
        print(f"  {key:<10} {medians[key]:>8.1f} {vs_naive.get(key, float('nan')):>8.3f} {idle:>6.2f} {ideal:>6.2f} "
              f"{moved:>9.2f} {waited:>14.2f}", flush=True)
    load_after = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    common.note(f"load average before {' '.join(load_before)}, after {' '.join(load_after)}")

    naive = common.ratios(rows, "naive", "single", "median_step_s")
    common.note(f"naive/single per round: {common.spread(naive)}")
    ratio = common.median(naive)
    common.result_line(f"{NAME}.naive_vs_single", ratio, f">= {TARGET_NAIVE:g}: no gain", quick=args.quick,
                       passed=ratio >= TARGET_NAIVE,
                       detail=f"step time naive split ({STAGES} stages, 1 micro-batch) / single device (all cores)")
    best = min(pipelined, key=vs_naive.get)
    common.note(f"{best}/naive per round: {common.spread(common.ratios(rows, best, 'naive', 'median_step_s'))}")
    gpipe = [k for k in variants if k.startswith("gpipe")]
    optimum = min(gpipe, key=medians.get)
    interior = optimum not in (gpipe[0], gpipe[-1])
    common.result_line(NAME, vs_naive[best], f"<= {TARGET_PIPELINED:g}", quick=args.quick,
                       passed=vs_naive[best] <= TARGET_PIPELINED,
                       detail=f"step time best pipelined ({best}) / naive split; gpipe sweep optimum at {optimum} "
                              f"({'interior' if interior else 'at an end of the range'}); "
                              f"pipelined / single {medians[best] / medians['single']:.2f}")

    sweep = [{"microbatches": configs[k].tier_options.microbatches, "median_step_ms": medians[k],
              "label": f"{vs_naive[k]:.2f}x"} for k in gpipe]
    fig = plots.sweep(pd.DataFrame(sweep), "microbatches", "median_step_ms", logx=True, annotate="label",
                      title=f"GPipe over {STAGES} stages: step time against micro-batches (label: / naive)",
                      xlabel="micro-batches per step (log scale)", ylabel="median step time (ms)")
    ax = fig.axes[0]
    ax.set_xticks([r["microbatches"] for r in sweep], [str(r["microbatches"]) for r in sweep])  # not 2x10^0
    ax.xaxis.set_minor_locator(NullLocator())
    for key, style in (("naive", "--"), ("single", ":")):
        ax.axhline(medians[key], color="k", ls=style, lw=1, label=f"{key} ({medians[key]:.0f} ms)")
    ax.set_ylim(0, max(medians.values()) * 1.2)
    ax.legend(loc="lower right")
    common.note(f"wrote {plots.save(fig, args.out / f'{NAME}.png')}")


if __name__ == "__main__":
    main()
