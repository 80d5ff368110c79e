"""Tier: DDP from scratch -- the single tier plus two collectives.

1. ``wrap``: broadcast rank 0's parameters, so every replica starts equal.
2. ``sync_gradients``: after backward, one ``all_reduce`` per parameter, then
   divide by the world size: every rank now holds the global-batch gradient.

No buckets and no overlap with backward: compare it with ``ddp`` to see what
DistributedDataParallel's bucketing buys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dtlab.core.config import RunConfig
from dtlab.core.registry import TierSpec
from dtlab.tiers.parts import base
from dtlab.tiers.parts.base import NoOptions as Options

__all__ = ["Options", "SPEC", "Strategy", "validate"]


def validate(cfg: RunConfig) -> None:
    """Nothing beyond RunConfig's own checks."""


class Strategy(base.Strategy):
    def wrap(self, model: nn.Module) -> nn.Module:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        return model

    def sync_gradients(self, model: nn.Module) -> None:
        world = self.info.world_size
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)  # SUM over ranks ...
                p.grad.div_(world)  # ... / world = mean over the global batch


SPEC = TierSpec(name="ddp-naive", summary="DDP from scratch: broadcast, then one all_reduce per parameter",
                options=Options, validate=validate, strategy=Strategy)
