"""Tier 1: one device, no data parallelism. The baseline every tier must match."""

from __future__ import annotations

from dtlab.core.config import RunConfig
from dtlab.core.registry import TierSpec
from dtlab.tiers.parts.base import NoOptions as Options
from dtlab.tiers.parts.base import Strategy

__all__ = ["Options", "SPEC", "Strategy", "validate"]


def validate(cfg: RunConfig) -> None:
    if cfg.world_size != 1:
        raise ValueError(f"RunConfig.world_size={cfg.world_size} is invalid for tier 'single': it runs one rank (1)")


SPEC = TierSpec(name="single", summary="one device, no data parallelism: the baseline every tier must match",
                options=Options, validate=validate, strategy=Strategy, optimizers=("sgd", "adam", "muon"))
