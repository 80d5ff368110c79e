"""Context parallelism's work and bytes, measured: each rank's attention FLOPs and each method's recorded bytes.

    python -m dtlab.experiments.cp_work [--world-sizes 2,4] [--steps 3]

``attention_flops`` counts, with torch's ``FlopCounterMode``, the matrix products the tier's own ring
attention runs for each rank (its ``SoloRing``: one rank's computation without a process group, the same
shapes as on the real ring), to set beside ``dtlab.cost.cp.attention_flops_formula``; ``main`` runs the
cp tier by both methods at each degree and prints ``dtlab.read.cp.bytes_table``.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
import torch
from torch.utils.flop_counter import FlopCounterMode

from dtlab.core.config import RunConfig
from dtlab.core.data import SEQ_LEN
from dtlab.cost.cp import attention_flops_formula
from dtlab.read.cp import bytes_table
from dtlab.tiers import cp
from dtlab.tiers.parts.cp_layout import positions
from dtlab.tiers.parts.cp_ring import SoloRing
from dtlab.train import run

__all__ = ["attention_flops", "main", "work_table"]


def attention_flops(n: int, balance: str, batch: int, heads: int, width: int, seq: int = SEQ_LEN) -> list[int]:
    """Per rank: the matrix-product FLOPs the tier's ring attention computes for one block, forward and backward,
    counted by ``FlopCounterMode`` on each rank's computation in this process (``SoloRing``)."""
    out = []
    for rank in range(n):
        t = len(positions(rank, n, balance, seq))
        q, k, v = (torch.randn(batch, heads, t, width // heads, requires_grad=True) for _ in range(3))
        attend = cp.attention(cp.Options("ring", balance), n, SoloRing(rank, n), seq)
        with FlopCounterMode(display=False) as counter:
            y = attend(q, k, v)
            y.backward(torch.ones_like(y))
        out.append(int(counter.get_total_flops()))
    return out


def work_table(n: int, batch: int, heads: int, width: int, seq: int = SEQ_LEN) -> pd.DataFrame:
    """One row per rank and balance: FLOPs measured and by formula, and the share of the busiest rank's."""
    rows = []
    for balance in cp.BALANCES:
        measured = attention_flops(n, balance, batch, heads, width, seq)
        formula = attention_flops_formula(n, balance, batch, width, seq)
        rows += [{"balance": balance, "rank": r, "flops": m, "formula": f, "of_busiest": m / max(measured)}
                 for r, (m, f) in enumerate(zip(measured, formula))]
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.experiments.cp_work", description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="2,4", help="comma-separated degrees (each divides the heads)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    job = RunConfig(tier="cp", model="charformer", dataset="text", model_heads=args.heads, steps=args.steps,
                    world_size=max(sizes), threads_per_rank=1)
    with pd.option_context("display.width", 200):
        print(work_table(max(sizes), job.global_batch_size, args.heads, job.model_size).to_string(index=False))
        runs = [run(job.replace(world_size=n, tier_options=cp.Options(method=m)), progress=False)
                for m in cp.METHODS for n in sizes]
        print(bytes_table(runs).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
