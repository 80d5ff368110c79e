"""Exercise ``ulysses_attention``: causal attention over a sequence split across the ranks, by trading the sequence
split for a head split with an all-to-all, and back.

Rank r holds block r of the positions, every head. Attention per head needs every
position, but the heads are independent: one all-to-all sends head group g of this
rank's block to rank g, so that each rank then holds h/n heads over the whole sequence
(its blocks arriving in rank order, which is position order). There ordinary causal
attention runs, no merging of partial softmaxes; a second all-to-all, the inverse,
brings each block's output back to its rank. DeepSpeed-Ulysses (Jacobs et al. 2023).

The ``cp`` tier's ``method="ulysses"`` runs the same exchange inside the model, with its
backward (``dtlab.tiers.parts.cp_ulysses``); this exercise is the forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.exercises._agree import sizes_agreed
from dtlab.exercises._check import Exercise, call_learner, ops_used
from dtlab.exercises._reach import Fingerprints, Found, HeldWatch, held_values, places
from dtlab.exercises._ulysses_check import BLOCK, CASES, HEAD_DIM, HEADS, TOLERANCE, WORLD_SIZES, Case, judge

DESCRIPTION = (
    "Write fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: causal self-attention over a "
    "sequence split across the n = dist.get_world_size() ranks, Ulysses' way. Rank r holds block r of the positions "
    "(the blocks in rank order make the sequence) of the queries, keys and values of every head: float32 tensors "
    f"shaped [heads, block, head_dim] ({HEADS}, {BLOCK}, {HEAD_DIM} here). Return this rank's block of the causal "
    "attention over the whole sequence, every head: per head softmax(Q K^T / sqrt(head_dim)) V, where the query at "
    "position i sees the keys at positions 0..i of the whole sequence; a tensor shaped like q. Communicate with "
    "all-to-alls only (dist.all_to_all_single or dist.all_to_all; no other call), so that each rank attends with "
    "heads / n whole heads: its all-to-alls move q, k and v once and the output once, in even splits (every rank "
    "sends each rank the same share), adding up to 4 × q's bytes per rank. Checked at world sizes 2 and 4 "
    f"({HEADS // 2} heads, then 1, per rank), with random blocks and with large scores (queries ×50): the output on "
    f"every rank against causal attention computed in one process in float64 ({TOLERANCE}), which calls each rank "
    "made, the bytes they carried and their splits, and, at every line of your code, the other ranks' keys and "
    "values within its reach (found by their values): never more heads of them than its own heads / n."
)

HINTS = (
    "The heads are independent of each other, the positions are not. Trade one split for the other: send each rank "
    "the heads it is to look after, from your block of the sequence; then a rank holds a few heads over the whole "
    "sequence and ordinary causal attention works there. The same exchange in reverse brings every block's output "
    "home.",
    "dist.all_to_all_single(output, input) cuts input's dim 0 into n equal parts, part s to rank s, and fills "
    "output's dim 0 part s with what rank s sent: put the destination first, e.g. q.reshape(n, heads // n, block, "
    "head_dim) gives head group g to rank g. To send q, k and v in one call, torch.stack([q, k, v]), .reshape(3, n, "
    "...) and .transpose(0, 1) to bring the rank first (.contiguous() before sending). What arrives, [n, ...], is in "
    "rank order, which is position order: .permute and .reshape it to [heads // n, n * block, head_dim]. "
    "F.scaled_dot_product_attention(q, k, v, is_causal=True). Back: cut the output's positions into n blocks and "
    "put the block first; what returns from rank g is head group g.",
    "n = world size; h, t, d = q.shape\n"
    "send = stack([q, k, v]).reshape(3, n, h // n, t, d).transpose(0, 1).contiguous()   # head group g -> rank g\n"
    "got = empty_like(send); all_to_all_single(got, send)     # got[s]: rank s's block of my heads\n"
    "full = got.permute(1, 2, 0, 3, 4).reshape(3, h // n, n * t, d)\n"
    "y = scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True)\n"
    "back = y.reshape(h // n, n, t, d).transpose(0, 1).contiguous()   # block s -> rank s\n"
    "mine = empty_like(back); all_to_all_single(mine, back)   # mine[g]: head group g of my block\n"
    "return mine.reshape(h, t, d)",
)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: one all-to-all to head groups over the whole sequence, causal SDPA, one all-to-all back."""
    n = dist.get_world_size()
    h, t, d = q.shape
    # dim 0: the rank that takes head group g (contiguous: the all-to-all cuts the memory as it lies)
    send = torch.stack([q, k, v]).reshape(3, n, h // n, t, d).transpose(0, 1).contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send)  # got[s]: rank s's block of this rank's heads
    full = got.permute(1, 2, 0, 3, 4).reshape(3, h // n, n * t, d)  # rank order is position order
    y = F.scaled_dot_product_attention(full[0], full[1], full[2], is_causal=True)
    back = y.reshape(h // n, n, t, d).transpose(0, 1).contiguous()  # dim 0: the rank whose block it is
    mine = torch.empty_like(back)
    dist.all_to_all_single(mine, back)  # mine[g]: head group g of this rank's block
    return mine.reshape(h, t, d)


def stub(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A starting point: replace the body (see ``describe('ulysses_attention')``)."""
    raise NotImplementedError(
        "write Ulysses attention: with one all-to-all give each rank a group of heads over the whole sequence, run "
        "causal attention there, and with a second all-to-all bring every block's output back to its rank; return "
        "this rank's block, every head, shaped like q (exercises.hint('ulysses_attention') when stuck)")


# -- checking ----------------------------------------------------------------------------------------------------
def _inputs(i: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(6113 * i + rank)
    q, k, v = (torch.randn(HEADS, BLOCK, HEAD_DIM, generator=gen) for _ in range(3))
    return q * CASES[i][1], k, v


class _OtherHeads:
    """Whether the learner's code holds other ranks' keys or values of more heads than its heads / n at once, found
    by their values at every line it runs (a ``HeldWatch`` probe): a relay of every head shows, whatever the
    calls that moved it and however their bytes were padded."""

    def __init__(self, rank: int, n: int, case: int) -> None:
        self.share, self.heads, tensors = HEADS // n, [], []
        for s in range(n):
            if s != rank:
                _, k, v = _inputs(case, s)
                for j in range(HEADS):
                    self.heads += [j, j]
                    tensors += [k[j], v[j]]
        self.prints = Fingerprints(tensors)
        self.first: str | None = None

    def __call__(self, found: list[Found], moment: str) -> None:
        if self.first is not None or not self.heads:
            return
        shares = self.prints.shares(held_values(found))
        heads = sorted({j for j, share in zip(self.heads, shares) if share > 0.99})
        if len(heads) > self.share:
            where = [f.where for f in found if self.prints.shares(held_values([f])).max() > 0.99]
            self.first = (f"other ranks' keys or values of {len(heads)} heads ({', '.join(map(str, heads))}) at once "
                          f"{moment} (in {places(where, 3)})")


def on_rank(info: Any, fn: Any) -> list[Case]:
    """Every test case, in the same order on every rank; the learner gets copies, so the inputs stay as given."""
    cases = []
    label = f"ulysses/{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    for i, (name, _) in enumerate(CASES):
        q, k, v = _inputs(i, info.rank)
        held = _OtherHeads(info.rank, info.world_size, i)
        with sizes_agreed(info.rank, info.world_size, f"{label}/{i}"), HeldWatch(held, fn):
            value, calls = call_learner(fn, q.clone(), k.clone(), v.clone(), where=f"with {name}")
        out = value.detach().clone() if isinstance(value, torch.Tensor) else None
        cases.append(Case(name, q, k, v, out, type(value).__name__, calls, held.first))
    return cases


def summary(records: dict[int, list[list[Case]]]) -> str:
    per_n = [f"n={n}: {sum(c.nbytes for c in ranks[0][0].calls):,} bytes in {ops_used(ranks[0][0].calls)}"
             for n, ranks in records.items()]
    return (f"every rank's output matched causal attention computed in one process (float64; {TOLERANCE}) at world "
            f"sizes {', '.join(map(str, records))}, with random blocks and with large scores (queries "
            f"×{CASES[-1][1]:g}), using all-to-alls only, each moving q, k, v and the output once. Rank 0's calls: "
            + "; ".join(per_n) + f" (4 × q's {records[min(records)][0][0].q.nbytes:,} bytes, whatever n).")


EXERCISE = Exercise("ulysses_attention", DESCRIPTION, on_rank, judge, summary, ulysses_attention, stub,
                    world_sizes=WORLD_SIZES, allowed_world_sizes=WORLD_SIZES, hints=HINTS)
