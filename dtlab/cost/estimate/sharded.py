"""FSDP's row shards and its gathered units: the counts the fsdp, tensor-parallel and mesh rules share.

Apart from ``memory`` so that the rules ``memory.RULES`` gathers (``tensor_parallel``, ``mesh``) import
these without importing ``memory``, which imports them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dtlab.core.config import RunConfig
from dtlab.cost.estimate.rank import nbytes
from dtlab.tiers import fsdp as fsdp_tier

__all__ = ["fsdp_units", "gathered_peak", "local_rows", "shard_rows"]


def shard_rows(t: torch.Tensor, world: int) -> int:
    """FSDP2's padded dim-0 shard of ``t``: ceil(rows / world) rows on every rank."""
    rows = t.shape[0] if t.dim() else 1
    return math.ceil(rows / world) * (t.numel() // max(rows, 1)) * t.element_size()


def local_rows(t: torch.Tensor, world: int, rank: int) -> int:
    """Bytes of ``t``'s unpadded dim-0 chunk on ``rank`` (torch.chunk's split: the last ranks may hold less)."""
    rows = t.shape[0] if t.dim() else 1
    chunk = math.ceil(rows / world)
    return max(0, min(chunk, rows - rank * chunk)) * (t.numel() // max(rows, 1)) * t.element_size()


def fsdp_units(model: nn.Module) -> list[list[nn.Parameter]]:
    """The fsdp tier's units in forward order (``fsdp.shard_units``), then the root with what is left."""
    units = [list(m.parameters()) for _, m in fsdp_tier.shard_units(model)]
    inside = {id(p) for unit in units for p in unit}
    return [*units, [p for p in model.parameters() if id(p) not in inside]]


def gathered_peak(cfg: RunConfig, model: nn.Module) -> int:
    """Unsharded bytes held at once: the root unit, and one block with the next one prefetched
    (with ``reshard_after_forward=False``, every block once the forward has run)."""
    units = [sum(nbytes(p) for p in unit) for unit in fsdp_units(model)]
    blocks, root = units[:-1], units[-1]
    if not getattr(cfg.tier_options, "reshard_after_forward", True):
        return root + sum(blocks)
    pairs = [a + b for a, b in zip(blocks, blocks[1:])] or blocks or [0]
    return root + max(pairs)
