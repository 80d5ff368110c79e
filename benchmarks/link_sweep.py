"""DDP on two simulated hosts over link caps, delays and comm hooks: what the network costs, what compression wins.

Two nodes (one rank each, ``multinode`` tier) in their own network namespaces,
links capped with ``tc tbf`` at 10 Gbit/s and 200 Mbit/s, each with no delay
and with 2 ms one way per packet (a user-space relay: this kernel has no
netem); at each link DDP with the plain all-reduce, fp16 compression and
PowerSGD (rank 1; it makes two all-reduces in a row per bucket, so it pays the
delay twice). The job: an MLP of width 512 and depth 2 (1.2 MB of gradients)
on the digits, Adam (lr 0.003), global batch 64, 100 steps (3.5 epochs), one
thread per rank; the quality is the held-out loss after training. Each round
runs every point once with the round's seed (0, 1, 2), points in reverse order
on odd rounds; a point's step time and loss are medians over rounds, with
their range; hook-against-all-reduce step ratios are taken per round, with
their min-max (``_common.median_interval``; a 90 % bootstrap from 10 rounds).
``cat /proc/loadavg`` before and after is printed.

Prints ``link_sweep.fp16_at_200mbit`` and ``link_sweep.powersgd_at_200mbit_2ms``
(hook / all-reduce step time: below 1, compression pays) and
``link_sweep.slowdown_200mbit`` (all-reduce step at 200 Mbit/s / at 10
Gbit/s); writes ``link_sweep.csv`` (per point), ``link_sweep_runs.csv`` (per
run) and ``link_sweep.png``. Needs root; elsewhere it prints why and measures nothing.

    .venv/bin/python benchmarks/link_sweep.py [--quick] [--out results/bench] [--repeats ROUNDS]
"""

from __future__ import annotations

from pathlib import Path

import _common as common
import pandas as pd

from dtlab import plots
from dtlab.core.config import RunConfig
from dtlab.experiments import linksweep
from dtlab.launch import netns
from dtlab.read import multinode

NAME = "link_sweep"
CAPS_MBIT = (10_000.0, 200.0)
DELAYS_MS = (0.0, 2.0)
KEYS = ["link_mbit", "link_delay_ms", "comm_hook", "label"]


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg gives them (the machine is shared)."""
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "unknown"


def points(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (link, hook): medians over rounds, and the step time's and held-out loss's range."""
    numeric = ["step_ms", "comm_ms", "exposed_comm_ms", "compute_ms", "comm_mb_per_step", "final_loss", "eval_loss"]
    g = runs.groupby(KEYS, sort=False)
    df = g[numeric].median()
    df["step_ms_min"], df["step_ms_max"] = g["step_ms"].min(), g["step_ms"].max()
    df["eval_loss_min"], df["eval_loss_max"] = g["eval_loss"].min(), g["eval_loss"].max()
    df["rounds"] = g.size()
    return df.reset_index()


def main() -> None:
    args = common.parse(common.parser(__doc__))
    ok, reason = netns.available()
    if not ok:
        common.note(f"not measured: {reason}")
        common.result_line(f"{NAME}.fp16_at_200mbit", float("nan"), "none: needs root", quick=args.quick,
                           detail=reason)
        return
    base = RunConfig(tier="ddp", world_size=2, model="mlp", model_size=256 if args.quick else 512, model_depth=2,
                     dataset="digits", global_batch_size=64, steps=8 if args.quick else 100, optimizer="adam",
                     lr=0.003, threads_per_rank=1)
    caps = (200.0,) if args.quick else CAPS_MBIT
    delays = (2.0,) if args.quick else DELAYS_MS
    hooks = ("allreduce", "fp16") if args.quick else linksweep.DEFAULT_HOOKS
    load_before = loadavg()
    frames = []
    for r in range(common.repeats(args, full=3, quick=1)):
        order = (caps, delays) if r % 2 == 0 else (caps[::-1], delays[::-1])
        frames.append(linksweep.link_sweep(base.replace(seed=r), *order[:1], hooks, delays_ms=order[1],
                                           progress=common.note).assign(round=r, seed=r))
    load_after = loadavg()
    runs = pd.concat(frames, ignore_index=True)
    df = points(runs)
    common.write_csv(args.out / f"{NAME}.csv", df.to_dict("records"))
    common.write_csv(args.out / f"{NAME}_runs.csv", runs.to_dict("records"))
    plots.save(plots.link_sweep(df), args.out / f"{NAME}.png")
    load = f"load average before {load_before}, after {load_after}"
    common.note(load)
    detail = "; ".join(f"{row.label}: {row.step_ms:.1f} ms ({row.step_ms_min:.1f}-{row.step_ms_max:.1f}), held-out "
                       f"loss {row.eval_loss:.3f} ({row.eval_loss_min:.3f}-{row.eval_loss_max:.3f})"
                       for row in df.itertuples())
    slow, delay = min(caps), max(delays)
    fp16 = multinode.step_ratios(runs, "fp16", slow, min(delays))
    common.result_line(f"{NAME}.fp16_at_200mbit", common.median(fp16), "none: < 1 means compression pays",
                       quick=args.quick, detail=f"{common.ratio_text(fp16)}; {load}; {detail}")
    if "powersgd" in hooks:
        psgd = multinode.step_ratios(runs, "powersgd", slow, delay)
        common.result_line(f"{NAME}.powersgd_at_200mbit_2ms", common.median(psgd), "none: < 1 means it pays",
                           quick=args.quick, detail=common.ratio_text(psgd))
    if 10_000.0 in caps:
        slowdown = multinode.slowdown(runs, slow)
        common.result_line(f"{NAME}.slowdown_200mbit", common.median(slowdown), "none: the cost of a slow link",
                           quick=args.quick, detail=common.ratio_text(slowdown))


if __name__ == "__main__":
    main()
