"""DDP against DiLoCo over slow and fast links: bytes and seconds per step, and who reaches a loss first.

Two simulated hosts (network namespaces, ``tc tbf`` caps of 200 Mbit/s and
10 Gbit/s), one rank each: DDP (the ``multinode`` tier) and DiLoCo (the
``diloco`` tier, two replica groups) with H = sync_every = 1, 5, 20, 50. The
job: an MLP of width 512 and depth 2 (1.2 MB of parameters), global batch 64,
Adam; DDP runs N = 100 steps, DiLoCo 200. Per run: bytes sent per step (rank
0's recorded all-reduces), the median step time, and the training loss against
steps and against training time (a 10-step moving average).

Targets, at 200 Mbit/s, median over interleaved rounds: DiLoCo H=20 reaches the
loss DDP has after N steps in at most 0.5 of DDP's training time
(``diloco_link.time_to_loss``), and sends at most 1/15 of its bytes per step
(``diloco_link.bytes``). Writes ``diloco_link.csv`` and ``diloco_link.png``.
Needs root; elsewhere it prints why and measures nothing.

    .venv/bin/python benchmarks/diloco_link.py [--quick] [--out results/bench] [--repeats ROUNDS]
"""

from __future__ import annotations

import math

import _common as common

from dtlab import plots
from dtlab.analysis import ft as ft_runs
from dtlab.core.config import RunConfig
from dtlab.launch import netns
from dtlab.tiers import diloco, multinode
from dtlab.train import run

NAME = "diloco_link"
SMOOTH = 10  # steps in the moving average of the training loss


def configs(quick: bool) -> dict[str, RunConfig]:
    job = dict(world_size=2, model="mlp", model_size=256 if quick else 512, model_depth=2, dataset="synthetic",
               dataset_size=4096, global_batch_size=64, optimizer="adam", lr=0.003, threads_per_rank=1)
    ddp_steps, diloco_steps = (20, 40) if quick else (100, 200)
    links, hs = ((200.0,), (5,)) if quick else ((200.0, 10_000.0), (1, 5, 20, 50))
    out = {}
    for mbit in links:
        out[f"ddp@{mbit:g}"] = RunConfig(tier="multinode", **job, steps=ddp_steps, tier_options=multinode.Options(
            nnodes=2, network="netns", link_mbit=mbit))
        for h in hs:
            out[f"diloco_h{h}@{mbit:g}"] = RunConfig(tier="diloco", **job, steps=diloco_steps,
                                                     tier_options=diloco.Options(sync_every=h, network="netns",
                                                                                 link_mbit=mbit))
    return out


def sent_per_step(result) -> float:
    events = result.events_frame()
    mine = events[(events["rank"] == 0) & (events["step"] >= 0) & (events["op"] == "all_reduce")]
    return float(mine["bytes"].sum()) / result.config.steps


def measure(name: str, cfg: RunConfig, curves: dict) -> dict:
    result = run(cfg, progress=False)
    curve = ft_runs.loss_by_time(result)
    curve["smooth"] = curve["loss"].rolling(SMOOTH, min_periods=1).mean()
    curves[name] = curve
    return {"bytes_per_step": sent_per_step(result), "step_s": common.steady_step_s(result),
            "final_smooth_loss": float(curve["smooth"].iloc[-1]), "train_s": float(curve["time_s"].iloc[-1])}


def time_to(curve, loss: float) -> float:
    """Training time until the smoothed loss first reaches ``loss`` (NaN if it never does)."""
    reached = curve[curve["smooth"] <= loss]
    return float(reached["time_s"].iloc[0]) if len(reached) else math.nan


def main() -> None:
    args = common.parse(common.parser(__doc__))
    ok, reason = netns.available()
    if not ok:
        common.note(f"not measured: {reason}")
        common.result_line(f"{NAME}.time_to_loss", float("nan"), "none: needs root", quick=args.quick, detail=reason)
        return
    cfgs, curves = configs(args.quick), {}
    variants = {name: (lambda _r, name=name, cfg=cfg: measure(name, cfg, curves)) for name, cfg in cfgs.items()}
    rows, per_round = [], []
    for r in range(-(0 if args.quick else 1), common.repeats(args, full=3, quick=1)):
        done = common.interleave(variants, 1, warmup_rounds=0)
        h = "diloco_h20@200" if "diloco_h20@200" in curves else "diloco_h5@200"
        target = float(curves["ddp@200"]["smooth"].iloc[-1])  # what DDP reached after its N steps
        for row in done:
            row["round"] = r
            row["time_to_ddp_loss_s"] = time_to(curves[row["variant"]], target)
        rows += done
        if r >= 0:
            ddp, dl = (next(x for x in done if x["variant"] == v) for v in ("ddp@200", h))
            per_round.append({"time": dl["time_to_ddp_loss_s"] / ddp["train_s"],
                              "bytes": dl["bytes_per_step"] / ddp["bytes_per_step"]})
        common.note(f"round {r + 1} done")
    common.write_csv(args.out / f"{NAME}.csv", rows)
    shown = {k: v for k, v in curves.items() if k.endswith("@200")}
    plots.save(plots.loss_vs_time({k: v.assign(loss=v["smooth"]) for k, v in shown.items()}), args.out / f"{NAME}.png")
    times, sent = [p["time"] for p in per_round], [p["bytes"] for p in per_round]
    common.result_line(f"{NAME}.time_to_loss", common.median(times), "<= 0.5", quick=args.quick,
                       passed=common.median(times) <= 0.5,
                       detail=f"{h} time to DDP's loss after N steps / DDP's time at 200 Mbit/s: "
                              f"{common.ratio_text(times)}")
    common.result_line(f"{NAME}.bytes", common.median(sent), f"<= {1 / 15:.3f}", quick=args.quick,
                       passed=common.median(sent) <= 1 / 15,
                       detail=f"{h} / DDP bytes sent per step (recorded all-reduces): {common.ratio_text(sent)}")


if __name__ == "__main__":
    main()
