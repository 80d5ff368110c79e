"""Ring attention: each rank keeps its queries and passes its K/V block around a ring of ranks.

Each rank attends to the block it holds while the next one travels (``batch_isend_irecv``
to rank r+1, from rank r-1), one hop per step; the partial results merge exactly with the
online softmax (log-sum-exp), as in flash attention. The backward is a second ring pass:
the K/V blocks travel again together with their dK/dV, which each rank adds to and which
arrive back at their owner after n hops. Ring attention as picotron builds it, forward
and backward written by hand as a ``torch.autograd.Function``.

Causal masking by chunk (``cp_layout``): a rank holds one chunk (contiguous) or two
(zig-zag). For each of its query chunks a and each chunk b of the block it holds, it
attends fully if b < a, causally within the chunk if b == a, and not at all if b > a (the
block still passes through on its way round the ring). Only the pairs it attends to are
computed, so the work per rank is what the layout gives it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from dtlab.instrument.recorder import tagged
from dtlab.tiers.parts.cp_layout import BACKWARD_TAG, FORWARD_TAG

__all__ = ["Ring", "RingAttention", "SoloRing", "attended_pairs", "ring_attention", "ring_hops_per_block"]

# Point-to-point tags: in backward a K/V block and a dK/dV block of the same size are in
# flight to the same peer at once, so each stream gets its own tag and they cannot swap.
_KV, _GRAD = 0, 1
Layout = tuple[tuple[int, ...], ...]  # every rank's chunks, in rank order (cp_layout.layout)


def ring_hops_per_block(world_size: int) -> int:
    """The isends each rank issues per attention block and training step: n-1 K/V hops in forward;
    in backward n-1 K/V hops again and n dK/dV hops (the last brings them home)."""
    return 3 * world_size - 2 if world_size > 1 else 0


# -- the ring ---------------------------------------------------------------------------
class Ring:
    """Shifts a tensor one rank along the ring (to r+1, from r-1) and counts the seconds waited."""

    def __init__(self) -> None:
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.waited_s = 0.0

    def shift(self, tensor: torch.Tensor, tag: int) -> _Arrived | _InFlight:
        """Start sending ``tensor`` on; ``wait()`` on the result returns the neighbour's tensor."""
        if self.size == 1:  # the next rank is this one
            return _Arrived(tensor)
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), (self.rank + 1) % self.size, tag=tag),
               dist.P2POp(dist.irecv, received, (self.rank - 1) % self.size, tag=tag)]
        return _InFlight(dist.batch_isend_irecv(ops), received, self)


class SoloRing(Ring):
    """A ring of ``size`` ranks seen from ``rank`` alone, without a process group: each shift hands back a fresh
    block of the same shape (every rank's block has this one's), so this rank's computation runs, and saves,
    as on the real ring. For predictions on fake tensors and for counting one rank's work."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.waited_s = rank, size, 0.0

    def shift(self, tensor: torch.Tensor, tag: int) -> _Arrived:
        if self.size == 1:  # as Ring: the next rank is this one
            return _Arrived(tensor)
        return _Arrived(torch.empty_like(tensor))  # a receive lands in a fresh buffer


class _Arrived:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


class _InFlight:
    def __init__(self, works: list[Any], received: torch.Tensor, ring: Ring) -> None:
        self.works, self.received, self.ring = works, received, ring

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        self.ring.waited_s += time.perf_counter() - start
        return self.received


# -- attention on one pair of chunks ----------------------------------------------------
def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:  # the diagonal chunk: query i sees keys 0..i of it
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q to one K/V chunk, and each row's log-sum-exp of the scores."""
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: two partial attentions, each normalised over its own keys, as one over both."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = torch.exp(lse - new_lse).unsqueeze(-1) * out + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out
    return out, new_lse


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This chunk pair's share of dQ, dK, dV, from the full softmax's log-sum-exp (flash attention's backward)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))  # the final attention weights on this chunk
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


def attended_pairs(mine: tuple[int, ...], theirs: tuple[int, ...]) -> Iterator[tuple[int, int, bool]]:
    """(my query chunk's index, their key chunk's index, causal) for every pair a causal mask leaves work in."""
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            if b <= a:
                yield i, j, b == a


def _part(t: torch.Tensor, i: int, parts: int, dim: int = -2) -> torch.Tensor:
    """The i-th of ``parts`` equal chunks of ``t``'s sequence dimension (-2; a log-sum-exp's: -1), a view."""
    return t.chunk(parts, dim)[i]


# -- the autograd Function --------------------------------------------------------------
class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries to every rank's keys, the sequence laid out as ``layout`` says.

    Inputs (batch, heads, positions, head_dim): this rank's positions of q, k and v (its chunks,
    in increasing order). Every rank of the default process group calls it together, forward
    and backward.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                layout: Layout) -> torch.Tensor:
        mine = layout[ring.rank]
        kv = torch.stack([k, v])
        outs: list[Any] = [None] * len(mine)
        lses: list[Any] = [None] * len(mine)
        with tagged(FORWARD_TAG):
            for step in range(ring.size):
                theirs = layout[(ring.rank - step) % ring.size]
                # Send the block on before using it: the transfer overlaps this step's compute.
                incoming = ring.shift(kv, _KV) if step < ring.size - 1 else None
                for i, j, causal in attended_pairs(mine, theirs):
                    o, lse = _block_forward(_part(q, i, len(mine)), _part(kv[0], j, len(theirs)),
                                            _part(kv[1], j, len(theirs)), causal)
                    outs[i], lses[i] = (o, lse) if outs[i] is None else _merge(outs[i], lses[i], o, lse)
                if incoming is not None:
                    kv = incoming.wait()
        out = outs[0] if len(mine) == 1 else torch.cat(outs, -2)
        lse = lses[0] if len(mine) == 1 else torch.cat(lses, -1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.layout = ring, layout
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        mine = ctx.layout[ring.rank]
        m = len(mine)
        delta = (dout * out).sum(-1)  # D = rowsum(dO * O)
        dq, kv, grads = torch.zeros_like(q), torch.stack([k, v]), None
        with tagged(BACKWARD_TAG):
            for step in range(ring.size):
                theirs = ctx.layout[(ring.rank - step) % ring.size]
                incoming_kv = ring.shift(kv, _KV) if step < ring.size - 1 else None
                parts = [(i, j, _block_backward(_part(q, i, m), _part(kv[0], j, len(theirs)),
                                                _part(kv[1], j, len(theirs)), _part(dout, i, m),
                                                _part(lse, i, m, -1), _part(delta, i, m, -1), causal))
                         for i, j, causal in attended_pairs(mine, theirs)]
                # The owner's dK/dV as summed so far by the ranks before this one (none yet at step 0).
                grads = torch.zeros_like(kv) if grads is None else grads.wait()
                for i, j, (dqi, dki, dvi) in parts:
                    _part(dq, i, m).add_(dqi)
                    _part(grads[0], j, len(theirs)).add_(dki)
                    _part(grads[1], j, len(theirs)).add_(dvi)
                grads = ring.shift(grads, _GRAD)  # follows its block: rank r+1 holds it next step
                if incoming_kv is not None:
                    kv = incoming_kv.wait()
            dkv = grads.wait()  # n hops: this rank's own block, with every rank's share
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring | None = None,
                   layout: Layout | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=True)`` of the whole sequence, where each rank
    passes its positions of q, k and v and gets its positions of the output. ``layout``: every rank's chunks
    (``cp_layout.layout``); None: one contiguous chunk per rank, in rank order."""
    ring = ring if ring is not None else Ring()
    layout = layout if layout is not None else tuple((r,) for r in range(ring.size))
    return RingAttention.apply(q, k, v, ring, layout)
