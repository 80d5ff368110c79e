"""Context parallelism by the formula: each rank's attention work and each method's bytes.

**Work.** Ring attention computes, for each of a rank's query chunks, the chunks of keys a causal
mask leaves work in (``dtlab.tiers.parts.cp_ring``). Per chunk pair of c query and c key positions, one
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
Ulysses' shrinks as 8/n of that. ``recorded_bytes`` reads a run's events for the same figures."""

from __future__ import annotations

import pandas as pd

from dtlab.core.data import SEQ_LEN
from dtlab.tiers import cp

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
