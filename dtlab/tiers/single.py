"""Tier 1: one device, no data parallelism. The baseline every tier must match."""

from __future__ import annotations

from dtlab.config import RunConfig
from dtlab.tiers.base import NoOptions as Options
from dtlab.tiers.base import Strategy, processes

__all__ = ["Options", "Strategy", "processes", "validate"]


def validate(cfg: RunConfig) -> None:
    if cfg.world_size != 1:
        raise ValueError(f"RunConfig.world_size={cfg.world_size} is invalid for tier 'single': it runs one rank (1)")
