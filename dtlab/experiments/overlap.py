"""Communication–computation overlap measured: ddp's buckets, fsdp's prefetch, tp's all-reduces and its decomposed MLP.

    python -m dtlab.experiments.overlap [--steps N] [--world-size N] [--csv PATH]

Each run's overlap per rank is ``dtlab.read.overlap.overlap_by_rank`` (its docstring says what counts). The
decomposed MLP runs twice: overlapping, and as the control that cannot overlap (``ring_overlap=False``: each
transfer waited for before the next chunk computes), whose share is what the measure counts where nothing
overlaps.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import pandas as pd

from dtlab.core.config import RunConfig
from dtlab.read.overlap import overlap_by_rank
from dtlab.tiers import ddp, tp
from dtlab.train import run

__all__ = ["demo_configs", "main", "measure"]


def demo_configs(steps: int = 12, world_size: int = 2) -> dict[str, RunConfig]:
    """The runs ``main`` compares: ddp's buckets, fsdp's prefetch, tp's all-reduces and its decomposed MLP."""
    base = RunConfig(model="mlp", model_size=256, model_depth=4, steps=steps, global_batch_size=128,
                     threads_per_rank=1, optimizer="adam")
    # ddp with buckets of a quarter MB: about one per layer, so the early ones can run under backward
    return {"ddp": base.replace(tier="ddp", world_size=world_size, tier_options=ddp.Options(bucket_cap_mb=0.25)),
            "fsdp": base.replace(tier="fsdp", world_size=world_size),
            "tp": base.replace(tier="tp", world_size=world_size),
            "tp decomposed_mlp": base.replace(tier="tp", world_size=world_size,
                                              tier_options=tp.Options(decomposed_mlp=True)),
            "tp decomposed_mlp, control": base.replace(tier="tp", world_size=world_size,
                                                       tier_options=tp.Options(decomposed_mlp=True,
                                                                               ring_overlap=False))}


def measure(configs: dict[str, RunConfig]) -> pd.DataFrame:
    """One row per run and rank: ``overlap_by_rank``'s columns and the run's label."""
    frames = [overlap_by_rank(run(cfg, progress=False)).assign(run=label) for label, cfg in configs.items()]
    return pd.concat(frames, ignore_index=True)[["run", "rank", "comm_s", "overlapped_s", "overlap_pct"]]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.overlap", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--csv", default="", help="also write the table here")
    args: Any = p.parse_args(argv)
    table = measure(demo_configs(args.steps, args.world_size))
    if args.csv:
        table.to_csv(args.csv, index=False)
    with pd.option_context("display.width", 160, "display.float_format", "{:.4g}".format):
        print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
