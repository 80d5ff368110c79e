"""What tiers whose parameters are DTensors (fsdp, tp, fsdp-tp) share: a plain twin to evaluate with.

A sharded model cannot run a forward on rank 0 alone (every layer would wait
for the other ranks), so ``finish`` gathers the full parameters on every rank
and rank 0 loads them into an ordinary copy of the model made before sharding.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["meta_copy", "plain_copy"]


def meta_copy(model: nn.Module) -> nn.Module:
    """The model's structure with parameters and buffers on the meta device (no memory)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def plain_copy(template: nn.Module, state: dict[str, torch.Tensor], live: nn.Module,
               device: torch.device, tier: str) -> nn.Module:
    """An ordinary module built from ``template`` holding the full parameters in ``state``.

    Buffers come from ``live`` (the running model): non-persistent ones are not in a state dict.
    """
    plain = copy.deepcopy(template).to_empty(device=device)
    plain.load_state_dict(state, strict=False)
    buffers = dict(live.named_buffers())
    with torch.no_grad():
        for name, buf in plain.named_buffers():
            local = buffers[name]
            buf.copy_(local.full_tensor() if hasattr(local, "full_tensor") else local)
    missing = set(dict(plain.named_parameters())) - set(state)
    if missing:
        raise RuntimeError(f"{tier}: the gathered state lacks {sorted(missing)}")
    return plain.train(live.training)
