"""Tier registry: one module per tier, each a small diff of its predecessor.

A tier module provides ``Options`` (a frozen dataclass of its knobs),
``validate(cfg)`` (raises ValueError before any process starts),
``processes(cfg)`` (how many OS processes to launch) and ``Strategy``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

TIERS: dict[str, str] = {
    "single": "dtlab.tiers.single",
    "dp": "dtlab.tiers.dp",
    "ddp-naive": "dtlab.tiers.ddp_naive",
    "ddp": "dtlab.tiers.ddp",
    "zero": "dtlab.tiers.zero",
    "rpc": "dtlab.tiers.rpc",
    "pipeline": "dtlab.tiers.pipeline",
    "fsdp": "dtlab.tiers.fsdp",
    "multinode": "dtlab.tiers.multinode",
    "elastic": "dtlab.tiers.elastic",
}


def get(name: str) -> ModuleType:
    if name not in TIERS:
        raise ValueError(f"unknown tier {name!r}: choose one of {', '.join(TIERS)}")
    return importlib.import_module(TIERS[name])
