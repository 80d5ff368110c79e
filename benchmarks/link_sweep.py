"""DDP across two simulated hosts over link caps and comm hooks: what the network costs, what compression wins.

Two nodes (one rank each, ``multinode`` tier) in their own network namespaces,
links capped with ``tc tbf`` at 10 Gbit/s, 1 Gbit/s and 200 Mbit/s; at each cap
DDP with the plain all-reduce, fp16 compression and PowerSGD (rank 1). The job:
an MLP of width 512 and depth 2 (1.2 MB of gradients), global batch 64, one
thread per rank. Rounds are interleaved; each point is the median over rounds.

Prints ``link_sweep.fp16_at_200mbit`` (fp16 / all-reduce step time at 200
Mbit/s: below 1, compression pays) and ``link_sweep.slowdown_200mbit``
(all-reduce step at 200 Mbit/s / at 10 Gbit/s); writes ``link_sweep.csv`` and
``link_sweep.png``. Needs root; elsewhere it prints why and measures nothing.

    .venv/bin/python benchmarks/link_sweep.py [--quick] [--out results/bench] [--repeats ROUNDS]
"""

from __future__ import annotations

import _common as common
import pandas as pd

from dtlab import plots
from dtlab.analysis import linksweep
from dtlab.core.config import RunConfig
from dtlab.launch import netns

NAME = "link_sweep"


def main() -> None:
    args = common.parse(common.parser(__doc__))
    ok, reason = netns.available()
    if not ok:
        common.note(f"not measured: {reason}")
        common.result_line(f"{NAME}.fp16_at_200mbit", float("nan"), "none: needs root", quick=args.quick,
                           detail=reason)
        return
    base = RunConfig(tier="ddp", world_size=2, model="mlp", model_size=256 if args.quick else 512, model_depth=2,
                     dataset="synthetic", global_batch_size=64, steps=6 if args.quick else 14, optimizer="sgd",
                     threads_per_rank=1)
    caps = (200.0,) if args.quick else linksweep.DEFAULT_CAPS_MBIT
    hooks = ("allreduce", "fp16") if args.quick else linksweep.DEFAULT_HOOKS
    frames = []
    for r in range(common.repeats(args, full=3, quick=1)):
        frames.append(linksweep.link_sweep(base, caps, hooks, progress=common.note).assign(round=r))
    runs = pd.concat(frames, ignore_index=True)
    numeric = ["step_ms", "comm_ms", "exposed_comm_ms", "compute_ms", "comm_mb_per_step", "final_loss"]
    df = runs.groupby(["link_mbit", "comm_hook", "label"], sort=False, as_index=False)[numeric].median()
    common.write_csv(args.out / f"{NAME}.csv", df.to_dict("records"))
    common.write_csv(args.out / f"{NAME}_runs.csv", runs.to_dict("records"))
    plots.save(plots.link_sweep(df), args.out / f"{NAME}.png")

    def step(mbit: float, hook: str) -> float:
        return float(df[(df["link_mbit"] == mbit) & (df["comm_hook"] == hook)]["step_ms"].iloc[0])

    points = "; ".join(f"{row.label}: {row.step_ms:.1f} ms (exposed comm {row.exposed_comm_ms:.1f} ms)"
                       for row in df.itertuples())
    common.result_line(f"{NAME}.fp16_at_200mbit", step(200.0, "fp16") / step(200.0, "allreduce"),
                       "none: < 1 means compression pays", quick=args.quick, detail=points)
    if 10_000.0 in caps:
        common.result_line(f"{NAME}.slowdown_200mbit", step(200.0, "allreduce") / step(10_000.0, "allreduce"),
                           "none: the cost of a slow link", quick=args.quick)


if __name__ == "__main__":
    main()
