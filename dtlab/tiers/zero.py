"""Tier: DDP + ZeroRedundancyOptimizer -- ddp with the optimizer state sharded.

Each rank keeps optimizer state (Adam's two moments) only for the parameters
it owns, steps those, and broadcasts them to the others. Gradients are still
all-reduced by DDP exactly as in the ``ddp`` tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from dtlab.core.config import RunConfig
from dtlab.core.job import OptimizerFactory, optimizer_params
from dtlab.core.registry import TierSpec
from dtlab.tiers import ddp

__all__ = ["Options", "SPEC", "Strategy", "validate"]

SHARDABLE = {"sgd", "adam", "muon"}  # optimizers that step each parameter alone: whole parameters shard


@dataclass(frozen=True)
class Options(ddp.BucketOptions):
    # Pack each rank's parameters into one buffer, so the post-step broadcast is one
    # collective per rank instead of one per parameter tensor.
    parameters_as_bucket_view: bool = False


def validate(cfg: RunConfig) -> None:
    # No checkpoint knobs: DCP cannot save a ZeroRedundancyOptimizer (get_state_dict needs its state
    # consolidated on one rank); checkpoint with the ddp or fsdp tier.
    ddp.validate(cfg)
    if cfg.optimizer not in SHARDABLE:
        raise ValueError(f"RunConfig.optimizer={cfg.optimizer!r} cannot be sharded by the zero tier: "
                         f"use one of {', '.join(sorted(SHARDABLE))}")


class Strategy(ddp.Strategy):
    def make_optimizer(self, model: nn.Module, build: OptimizerFactory) -> torch.optim.Optimizer:
        # build is functools.partial(OptimizerClass, lr=...): ZeRO needs the class and its arguments.
        # under Muon its two groups: ZeRO deals out the first group, then the second (the estimate follows)
        return ZeroRedundancyOptimizer(optimizer_params(model, build), optimizer_class=build.func,
                                       parameters_as_bucket_view=self.options.parameters_as_bucket_view,
                                       **build.keywords)


SPEC = TierSpec(name="zero", summary="DDP with ZeroRedundancyOptimizer: optimizer state sharded over the ranks",
                options=Options, validate=validate, strategy=Strategy, optimizers=("sgd", "adam", "muon"),
                choices={"comm_hook": ddp.COMM_HOOKS})
