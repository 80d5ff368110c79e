"""Context parallelism by the numbers: each rank's attention work and each method's bytes, measured and by formula.

    python -m dtlab.analysis.context_parallel [--world-sizes 2,4] [--steps 3]

**Work.** Ring attention computes, for each of a rank's query chunks, the chunks of keys a causal
mask leaves work in (``dtlab.tiers.cp_ring``). Per chunk pair of c query and c key positions, one
attention block's forward and backward are 14 c² · batch · width floating-point operations in
matrix products: 2 for the scores and 2 for weighting the values in forward; in backward 2 to
recompute the scores, 2 each for dV, dP, dQ and dK (the diagonal pair computes its c² scores
and masks half of them). Contiguous chunks (c = S/n) give rank r r + 1 pairs; zig-zag chunks
(c = S/2n) give every rank 2n + 1. ``attention_flops`` measures it: torch's ``FlopCounterMode``
counts the products the tier's own ring attention runs for each rank (its ``SoloRing``: one
rank's computation without a process group, the same shapes as on the real ring).

**Bytes**, per step and rank, for the model's ``depth`` attention blocks, x = batch · (S/n) ·
width · 4 bytes (one rank's positions of q, k, v or the output):

* ring: 3n - 2 hops of a K/V block (2x) per block: 2 (3n - 2) x, all of it to the next rank;
* Ulysses: 4 all-to-alls per block, of 3x, x, x and 3x (q, k, v; the output; their gradients):
  8x as the recorder counts an all-to-all (its whole input), of which (n - 1)/n leaves the rank.

The ring's traffic per rank grows towards 6 · batch · S · width · 4 bytes per block as n grows;
Ulysses' shrinks as 8/n of that. ``recorded_bytes`` reads a run's events for the same figures.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import pandas as pd
import torch
from torch.utils.flop_counter import FlopCounterMode

from dtlab.core.config import RunConfig
from dtlab.core.data import SEQ_LEN
from dtlab.core.results import RunResult
from dtlab.tiers import cp
from dtlab.tiers.cp_layout import BACKWARD_TAG, FORWARD_TAG, positions
from dtlab.tiers.cp_ring import SoloRing
from dtlab.train import run

__all__ = ["FLOAT", "FLOPS_PER_SCORE", "attention_bytes", "attention_flops", "attention_flops_formula",
           "bytes_formula", "bytes_table", "main", "recorded_bytes", "work_table"]

FLOAT = 4  # bytes of an fp32 activation
FLOPS_PER_SCORE = 14  # per score element and unit of batch x width: 4 in forward, 10 in backward


def attention_flops_formula(n: int, balance: str, batch: int, width: int, seq: int = SEQ_LEN) -> list[int]:
    """Per rank: the matrix-product FLOPs of one ring-attention block's forward and backward."""
    if balance == "zigzag":
        c = seq // (2 * n)
        pairs = [2 * n + 1] * n
    else:
        c = seq // n
        pairs = [r + 1 for r in range(n)]
    return [FLOPS_PER_SCORE * batch * width * c * c * p for p in pairs]


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


def attention_bytes(method: str, n: int, batch: int, width: int, depth: int, seq: int = SEQ_LEN) -> dict[str, int]:
    """Per step and rank, the attention's communication by formula: ``counted`` as the recorder counts it (an
    isend its tensor, an all-to-all its whole input) and ``sent``, what leaves the rank."""
    if n == 1:
        return {"counted": 0, "sent": 0}
    x = batch * (seq // n) * width * FLOAT
    if method == "ring":
        counted = depth * 2 * (3 * n - 2) * x
        return {"counted": counted, "sent": counted}
    counted = depth * 8 * x
    return {"counted": counted, "sent": counted * (n - 1) // n}


def bytes_formula(batch: int, width: int, depth: int, degrees: list[int], seq: int = SEQ_LEN) -> pd.DataFrame:
    """``attention_bytes`` of both methods over ``degrees``: rows of method, degree, counted, sent."""
    return pd.DataFrame([{"method": m, "degree": n, **attention_bytes(m, n, batch, width, depth, seq)}
                         for m in cp.METHODS for n in degrees])


def _sent(row: Any) -> float:
    """What leaves the rank: an isend all of it, an all-to-all all but its own split."""
    splits = row.get("input_splits")  # absent from a run without all-to-alls
    if row["op"] != "all_to_all_single" or not isinstance(splits, list | tuple) or not sum(splits):
        return float(row["bytes"])
    return row["bytes"] * (sum(splits) - splits[int(row["rank"])]) / sum(splits)


def recorded_bytes(result: RunResult) -> pd.DataFrame:
    """Per rank: the attention's communication per training step in a cp run (the calls tagged by its
    forward and backward passes: isends, or all-to-alls), counted and sent, from the recorded events."""
    steps = result.config.steps
    ev = result.events_frame()
    ev = ev[(ev["step"] >= 0) & (ev["step"] < steps) & ev["tag"].isin([FORWARD_TAG, BACKWARD_TAG])
            & ev["op"].isin(["isend", "all_to_all_single"])]
    ev = ev.assign(sent=ev.apply(_sent, axis=1) if len(ev) else 0.0)
    table = ev.groupby("rank").agg(counted=("bytes", "sum"), sent=("sent", "sum"), calls=("op", "size")) / steps
    return table.reindex(range(result.config.world_size), fill_value=0.0)


def bytes_table(results: list[RunResult]) -> pd.DataFrame:
    """One row per cp run: method, degree, the busiest rank's recorded bytes per step and the formula's."""
    rows = []
    for r in results:
        cfg, recorded = r.config, recorded_bytes(r)
        want = attention_bytes(cfg.tier_options.method, cfg.world_size, cfg.global_batch_size, cfg.model_size,
                               cfg.model_depth)
        rows.append({"method": cfg.tier_options.method, "degree": cfg.world_size,
                     "counted": recorded["counted"].max(), "counted_formula": want["counted"],
                     "sent": recorded["sent"].max(), "sent_formula": want["sent"]})
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.analysis.context_parallel", description=__doc__.split("\n")[0])
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
