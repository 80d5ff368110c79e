"""Every pipeline schedule on one job: the measured bubble against its formula and its equal-times layout,
the step time, and activation memory measured against predicted.

    python -m dtlab.experiments.schedules [--rounds 3] [--microbatches 4] [--quick] [--csv FILE]

The job is notebook 10's compute-bound mlp (width 1024, 8 layers, batch 512) on 2 ranks, each with half
the cores. Rounds run the schedules one after another, then again in reverse order: a shared machine's swings
hit them all. Beside each idle share, the recorded transfers: the share of the step a send or receive was in
flight, and the share of the idle time that had one in flight. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from dtlab.core.config import RunConfig
from dtlab.cost.estimate import compare, estimate
from dtlab.read.pipeline import bubble_table, measured_idle, transfer_share
from dtlab.tiers.pipeline import Options
from dtlab.train import run

COMPARED = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")


def job(steps: int = 14) -> RunConfig:
    """Notebook 10's pipelined job: matrix products dominate its step."""
    cores = os.cpu_count() or 1
    return RunConfig(model="mlp", model_size=1024, model_depth=8, dataset="synthetic", dataset_size=8192,
                     global_batch_size=512, steps=steps, optimizer="sgd", lr=0.01, tier="pipeline", world_size=2,
                     threads_per_rank=max(1, cores // 2))


def run_schedules(cfg: RunConfig, schedules: Sequence[str] = COMPARED, microbatches: int = 4,
                  rounds: int = 1) -> dict[str, list[Any]]:
    """Each schedule's runs of ``cfg`` with ``microbatches``, interleaved round by round (odd rounds reversed)."""
    out: dict[str, list[Any]] = {s: [] for s in schedules}
    for r in range(rounds):
        for s in (schedules if r % 2 == 0 else schedules[::-1]):
            out[s].append(run(cfg.replace(tier_options=Options(s, microbatches)), progress=False))
    return out


def schedule_table(runs: Mapping[str, list[Any]]) -> pd.DataFrame:
    """Per schedule: ``bubble_table``'s columns (measured: the median over rounds), the median step time, and
    the largest rank's activation peak measured and predicted (``dtlab.estimate``) with their relative error."""
    rows = []
    for schedule, results in runs.items():
        bubble = bubble_table({schedule: results[0]}).iloc[0].to_dict()
        bubble["measured"] = statistics.median(measured_idle(r) for r in results)
        shares = [transfer_share(r) for r in results]
        for i, name in enumerate(("transfer_share", "idle_in_transfer", "idle_in_arrival")):
            bubble[name] = statistics.median(share[i] for share in shares)
        table = compare(estimate(results[0].config), results[0])
        acts = table[table["kind"] == "activations"]
        measured, predicted = int(acts["measured"].max()), int(acts["predicted"].max())
        rows.append({**bubble, "step_ms": statistics.median(r.median_step_s() * 1e3 for r in results),
                     "activations_MiB": measured / 2**20, "predicted_MiB": predicted / 2**20,
                     "activation_error": float(acts["error"].abs().max())})
    return pd.DataFrame(rows).drop(columns="run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.experiments.schedules", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--csv", type=Path, default=None, help="also write the table (and the load averages) here")
    parser.add_argument("--quick", action="store_true", default=os.environ.get("DTLAB_QUICK") == "1",
                        help="one round of 4 steps (also DTLAB_QUICK=1)")
    args = parser.parse_args(argv)
    rounds, steps = (1, 4) if args.quick else (args.rounds, args.steps)
    before = _loadavg()
    table = schedule_table(run_schedules(job(steps), microbatches=args.microbatches, rounds=rounds))
    print(f"2 ranks, M = {args.microbatches}, {steps} steps x {rounds} round(s); load average before {before}, "
          f"after {_loadavg()}; idle shares: measured (median over steps after the first, mean over ranks, median "
          "over rounds), formula, simulated (equal times); transfer_share: a send or receive in flight, share of "
          "the step; idle_in_transfer: share of the idle time with one in flight; idle_in_arrival: share of the "
          "idle time receiving data whose send was already posted")
    print(table.round(3).to_string(index=False))
    if args.csv is not None:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        table.assign(rounds=rounds, steps=steps, load_before=before, load_after=_loadavg()).to_csv(args.csv,
                                                                                                   index=False)
        print(f"wrote {args.csv}")
    return 0


def _loadavg() -> str:
    path = "/proc/loadavg"
    return " ".join(open(path).read().split()[:3]) if os.path.exists(path) else "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
