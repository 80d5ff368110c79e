"""A decomposed tensor-parallel MLP: the GEMM split into row chunks whose partial sums travel the ring while the
next chunk computes (the idea of async tensor parallelism, Wang et al. 2022; torchtitan's async TP).

Megatron's pair (column-split ``Linear``, activation, row-split ``Linear``) ends in an all-reduce of the whole
output, which waits for the whole GEMM. Here the row-split GEMM ``a @ W2ᵀ`` is cut into ``n`` chunks of rows:
at each of ``n`` steps a rank computes one chunk's partial product while ``batch_isend_irecv`` passes the
previous running sum to the next rank, so each transfer runs under a GEMM (a ring reduce-scatter: after ``n``
steps rank r holds chunk r summed over ranks); a ring all-gather then makes the output whole on every rank.
In backward, the column-split ``Linear``'s input gradient ``dy @ W1`` is summed the same way, chunk by chunk.
The bytes are the all-reduce's (a reduce-scatter and an all-gather); what changes is what runs under them.

The pair's weights are plain tensors holding this rank's slice (rows of ``W1`` and ``b1``, columns of
``W2``); ``b2`` is whole. ``decompose`` installs it on an ``nn.Sequential`` of ``Linear, act, Linear`` pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.instrument.recorder import tagged

__all__ = ["Ring", "decompose", "gather_slices", "ring_all_gather", "ring_reduce_scatter"]


class Ring:
    """This rank's place in a process group seen as a ring: who it sends to and receives from."""

    def __init__(self, group: Any, overlap: bool = True) -> None:
        self.group, self.overlap = group, overlap  # overlap=False: the control, see ring_reduce_scatter
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def shift(self, outgoing: torch.Tensor) -> tuple[list[Any], torch.Tensor]:
        """Start sending ``outgoing`` to the next rank and receiving the previous rank's: (works, buffer)."""
        incoming = torch.empty_like(outgoing)
        ops = [dist.P2POp(dist.isend, outgoing, self.next, self.group),
               dist.P2POp(dist.irecv, incoming, self.prev, self.group)]
        return dist.batch_isend_irecv(ops), incoming


def ring_reduce_scatter(partial: Callable[[int], torch.Tensor], ring: Ring) -> torch.Tensor:
    """Chunk ``ring.rank`` of ``sum over ranks of partial(chunk)``: each step's ``partial`` runs while the previous
    running sum travels to the next rank.

    With ``ring.overlap`` False each transfer is waited for before the chunk computes (issue, wait, compute):
    the same sums, nothing under the transfers.
    """
    n, r = ring.world, ring.rank
    running = partial((r - 1) % n)
    for s in range(1, n):
        works, incoming = ring.shift(running)
        if not ring.overlap:  # the control: the transfer is over before the chunk computes
            _wait(works)
        mine = partial((r - s - 1) % n)  # computes while the transfer is in flight (unless waited for above)
        if ring.overlap:
            _wait(works)
        running = mine + incoming
    return running


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def ring_all_gather(chunk: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Every rank's ``chunk`` stacked along rows, in rank order, passed round the ring."""
    pieces: list[torch.Tensor] = [chunk] * ring.world
    current = chunk
    for s in range(1, ring.world):
        works, current = ring.shift(current)
        for w in works:
            w.wait()
        pieces[(ring.rank - s) % ring.world] = current
    return torch.cat(pieces)


def _rows(t: torch.Tensor, n: int, j: int) -> torch.Tensor:
    m = t.shape[0] // n
    return t[j * m:(j + 1) * m]


class ColumnLinear(torch.autograd.Function):
    """``x @ W1ᵀ + b1`` on this rank's output columns; backward sums the input gradient over the ring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, ring: Ring, tag: str) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.ring, ctx.tag = ring, tag
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = None
        if ctx.needs_input_grad[0]:  # the partial input gradients of every rank's columns, summed chunk by chunk
            ring = ctx.ring
            with tagged(f"tp_ring:backward:{ctx.tag}"):
                mine = ring_reduce_scatter(lambda j: _rows(dy2, ring.world, j) @ weight, ring)
                dx = ring_all_gather(mine, ring).view(x.shape)
        return dx, dy2.T @ x2, dy2.sum(0), None, None


class RowLinear(torch.autograd.Function):
    """``a @ W2ᵀ`` summed over ranks chunk by chunk round the ring, plus ``b2``; whole on every rank."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, ring: Ring, tag: str) -> Any:
        ctx.save_for_backward(a, weight)
        a2 = a.reshape(-1, a.shape[-1])
        with tagged(f"tp_ring:forward:{tag}"):
            mine = ring_reduce_scatter(lambda j: _rows(a2, ring.world, j) @ weight.T, ring) + bias
            out = ring_all_gather(mine, ring)
        return out.view(*a.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        # The output is whole on every rank and so is its gradient (every rank computes the same loss): local.
        a, weight = ctx.saved_tensors
        d2, a2 = dout.reshape(-1, dout.shape[-1]), a.reshape(-1, a.shape[-1])
        da = (d2 @ weight).view(a.shape) if ctx.needs_input_grad[0] else None
        return da, d2.T @ a2, d2.sum(0), None, None


class DecomposedForward:
    """An ``nn.Sequential``'s forward with its (column, row) Linear pairs decomposed (an instance ``forward``,
    so parameter names and the state dict stay the module's own)."""

    def __init__(self, seq: nn.Sequential, pairs: list[tuple[str, str]], ring: Ring, prefix: str) -> None:
        self.seq, self.ring, self.prefix = seq, ring, prefix
        self.columns = {c for c, _ in pairs}
        self.rows = {r for _, r in pairs}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for name, child in self.seq.named_children():
            if name in self.columns:
                x = ColumnLinear.apply(x, child.weight, child.bias, self.ring, f"{self.prefix}{name}")
            elif name in self.rows:
                x = RowLinear.apply(x, child.weight, child.bias, self.ring, f"{self.prefix}{name}")
            else:
                x = child(x)
        return x


def decompose(seq: nn.Sequential, pairs: list[tuple[str, str]], ring: Ring, prefix: str = "") -> dict[str, int]:
    """Keep this rank's slices of each pair in ``seq`` and decompose its forward; returns each sliced parameter's
    name (under ``prefix``) and the dimension it was cut along."""
    sliced: dict[str, int] = {}
    n, r = ring.world, ring.rank
    with torch.no_grad():
        for col_name, row_name in pairs:
            col, row = seq.get_submodule(col_name), seq.get_submodule(row_name)
            k = col.out_features // n
            cut = slice(r * k, (r + 1) * k)
            col.weight = nn.Parameter(col.weight[cut].clone())
            col.bias = nn.Parameter(col.bias[cut].clone())
            row.weight = nn.Parameter(row.weight[:, cut].clone())
            sliced.update({f"{prefix}{col_name}.weight": 0, f"{prefix}{col_name}.bias": 0,
                           f"{prefix}{row_name}.weight": 1})
    seq.forward = DecomposedForward(seq, pairs, ring, prefix)
    return sliced


def gather_slices(model: nn.Module, sliced: dict[str, int], group: Any) -> dict[str, torch.Tensor]:
    """The whole parameters of ``sliced`` (a collective: every rank calls it), in rank order along their cut."""
    world = dist.get_world_size(group)
    out = {}
    for name, dim in sliced.items():
        mine = model.get_parameter(name).detach().contiguous()
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        out[name] = torch.cat(parts, dim=dim)
    return out
