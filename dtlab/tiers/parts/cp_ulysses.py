"""Ulysses attention: an all-to-all trades sequence shards for head shards, and back after attention.

DeepSpeed-Ulysses (Jacobs et al. 2023): before attention every rank holds all heads of its
positions; one ``all_to_all_single`` sends head group g (heads g*h/n .. (g+1)*h/n - 1) of
its positions to rank g and receives its own head group's part of every other rank's
positions. Each rank then holds h/n whole heads over the whole sequence and runs ordinary
causal attention on them (``scaled_dot_product_attention``, no ring, no merging); a second
all-to-all, the inverse, brings every position's output back to the rank that holds it.
In backward the same two exchanges run in reverse order, on the gradients. q, k and v
travel stacked in one call.

Per attention block and step each rank exchanges 8 tensors of its positions' size (q, k,
v and the output in forward; their gradients in backward) whatever the degree, so its
bytes shrink as 1/n, while the ring's grow towards 6 blocks of the whole sequence's size.
The price: the degree cannot exceed the heads (each rank needs whole heads), and every
rank holds the whole sequence for its heads.

With zig-zag chunks the sequence arrives in rank order, not position order; it is sorted
into position order for the causal attention and back before the return trip.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlab.instrument.recorder import tagged
from dtlab.tiers.parts.cp_layout import BACKWARD_TAG, FORWARD_TAG

__all__ = ["ALL_TO_ALLS_PER_BLOCK", "HeadSwap", "SoloSwap", "heads_to_sequence", "sequence_to_heads",
           "ulysses_attention"]

ALL_TO_ALLS_PER_BLOCK = 4  # forward: q, k, v out and the output back; backward: the same two, reversed


class HeadSwap:
    """One all-to-all over the default group: dim 0 of what it sends is the destination rank, of what it
    returns the source rank. Counts the seconds spent in it."""

    def __init__(self) -> None:
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.waited_s = 0.0

    def swap(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        received = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        start = time.perf_counter()
        dist.all_to_all_single(received, tensor.contiguous())
        self.waited_s += time.perf_counter() - start
        return received


class SoloSwap(HeadSwap):
    """The all-to-all of ``size`` ranks seen from ``rank`` alone, without a process group: it hands back a fresh
    tensor of the shape it sends (every rank's part has this one's), so this rank's computation runs, and
    saves, as in the real exchange. For predictions on fake tensors and for counting one rank's work."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.waited_s = rank, size, 0.0

    def swap(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:  # as HeadSwap: nothing to exchange
            return tensor
        return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _to_heads(x: torch.Tensor, swap: HeadSwap) -> torch.Tensor:
    """(L, h, t, d), all heads of this rank's t positions -> (L, h/n, n*t, d), its heads of every position."""
    lead, h, t, d = x.shape
    n = swap.size
    got = swap.swap(x.reshape(lead, n, h // n, t, d).transpose(0, 1))  # [n destinations] -> [n sources]
    return got.permute(1, 2, 0, 3, 4).reshape(lead, h // n, n * t, d)


def _to_sequence(y: torch.Tensor, swap: HeadSwap) -> torch.Tensor:
    """The inverse of ``_to_heads``: (L, h/n, n*t, d) -> (L, h, t, d)."""
    lead, hn, seq, d = y.shape
    n = swap.size
    got = swap.swap(y.reshape(lead, hn, n, seq // n, d).permute(2, 0, 1, 3, 4))  # [n sources of the heads]
    return got.transpose(0, 1).reshape(lead, n * hn, seq // n, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, swap: HeadSwap) -> torch.Tensor:
        ctx.swap = swap
        with tagged(FORWARD_TAG):
            return _to_heads(x, swap)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        with tagged(BACKWARD_TAG):
            return _to_sequence(grad, ctx.swap), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, swap: HeadSwap) -> torch.Tensor:
        ctx.swap = swap
        with tagged(FORWARD_TAG):
            return _to_sequence(y, swap)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        with tagged(BACKWARD_TAG):
            return _to_heads(grad, ctx.swap), None


def sequence_to_heads(x: torch.Tensor, swap: HeadSwap) -> torch.Tensor:
    """Differentiable ``_to_heads``: its backward is the inverse all-to-all."""
    return _SequenceToHeads.apply(x, swap)


def heads_to_sequence(y: torch.Tensor, swap: HeadSwap) -> torch.Tensor:
    """Differentiable ``_to_sequence``: its backward is the inverse all-to-all."""
    return _HeadsToSequence.apply(y, swap)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, swap: HeadSwap | None = None,
                      order: list[int] | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=True)`` of the whole sequence, where each rank passes
    its positions of q, k and v, (batch, heads, positions, head_dim), and gets its positions of the output.
    ``order``: the index that sorts the sequence, put together in rank order, into position order
    (``cp_layout.natural_order``); None: it is in position order."""
    swap = swap if swap is not None else HeadSwap()
    b = q.shape[0]
    full = sequence_to_heads(torch.stack([q, k, v]).flatten(0, 1), swap)  # (3b, h/n, seq, d)
    if order is not None:
        index = torch.tensor(order, device=q.device)
        full = full.index_select(2, index)
    qh, kh, vh = full.unflatten(0, (3, b)).unbind(0)
    y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    if order is not None:
        y = y.index_select(2, torch.argsort(index))
    return heads_to_sequence(y, swap)
