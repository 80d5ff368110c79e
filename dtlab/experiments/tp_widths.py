"""The TP width sweep: ddp, fsdp and tp run at each width, their bytes per step measured beside the formula's.

    python -m dtlab.experiments.tp_widths [--widths 32,64,128,256] [--steps 4]

The job is notebook 13's charformer on 2 ranks (batch 16, one thread per rank); per tier and width, rank 0's
recorded bytes per training step and parameter bytes against ``dtlab.cost.tp.bytes_by_formula``.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from dtlab.core import data
from dtlab.core.config import RunConfig
from dtlab.cost.tp import bytes_by_formula
from dtlab.train import run

__all__ = ["job", "main", "width_sweep"]


def job(steps: int = 4) -> RunConfig:
    """Notebook 13's sweep job: the charformer under ``tp`` on 2 ranks, batch 16."""
    return RunConfig(tier="tp", world_size=2, model="charformer", dataset="text", model_size=64, model_depth=2,
                     global_batch_size=16, steps=steps, optimizer="sgd", lr=0.05, threads_per_rank=1)


def width_sweep(job: RunConfig, widths: list[int], vocab: int = 0) -> pd.DataFrame:
    """``job`` (a tp job) run by ddp, fsdp and tp at each width: rank 0's bytes per training step and parameter
    bytes, measured and by ``bytes_by_formula``, and their ratios."""
    rows = []
    for width in widths:
        formulas = bytes_by_formula(job.replace(model_size=width), vocab=vocab)
        for tier in ("ddp", "fsdp", "tp"):
            r = run(job.replace(tier=tier, model_size=width), progress=False)
            ev = r.events_frame()
            ev = ev[(ev["rank"] == 0) & (ev["step"] >= 0) & (ev["step"] < r.config.steps)]  # no set-up, no gather
            rows.append({"tier": tier, "width": width, "comm_bytes": ev["bytes"].sum() / r.config.steps,
                         "param_bytes": r.ranks[0].memory["parameters"], "formula_comm": formulas[tier][0],
                         "formula_params": formulas[tier][1]})
    out = pd.DataFrame(rows)
    return out.assign(**{"comm / formula": out["comm_bytes"] / out["formula_comm"],
                         "params / formula": out["param_bytes"] / out["formula_params"]})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.tp_widths", description=__doc__.split("\n")[0])
    p.add_argument("--widths", default="32,64,128,256", help="comma-separated model widths")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",") if w.strip()]
    vocab = data.load("text", 0, 0).num_classes
    with pd.option_context("display.width", 200):
        print(width_sweep(job(args.steps), widths, vocab=vocab).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
