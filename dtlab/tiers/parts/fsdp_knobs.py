"""FSDP2's own knobs, which every FSDP-based tier has (``UnitOptions``), and their checks.

``reshard_after_forward``, ``mixed_precision`` and ``cpu_offload`` are what ``fully_shard`` takes for each unit;
``check`` names a value that cannot run before any process starts, ``check_dtype`` the mixed precision a float64
job cannot have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtlab.core.config import RunConfig
from dtlab.core.env import resolve_backend

__all__ = ["MIXED_PRECISION", "UnitOptions", "check", "check_dtype"]

MIXED_PRECISION = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class UnitOptions:
    """How ``fully_shard`` treats each unit."""

    # Free each unit's gathered parameters after its forward (and gather them again
    # for backward): less memory, one more all-gather per unit and step.
    reshard_after_forward: bool = True
    # "bf16"/"fp16": all-gather and compute in that dtype; gradients are reduced and
    # the sharded parameters kept in fp32.
    mixed_precision: str = "none"
    cpu_offload: bool = False  # sharded parameters, gradients and the optimizer step live on the CPU


def check(cfg: RunConfig, name: str) -> None:
    """The ``UnitOptions`` of ``cfg.tier_options``; ``name`` prefixes the errors."""
    o = cfg.tier_options
    for field in ("reshard_after_forward", "cpu_offload"):
        if not isinstance(getattr(o, field), bool):
            raise ValueError(f"{name}.{field}={getattr(o, field)!r} is invalid: must be True or False")
    if o.mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"{name}.mixed_precision={o.mixed_precision!r} is invalid: choose one of "
                         f"{', '.join(MIXED_PRECISION)}")
    check_dtype(cfg, name)
    _, device = resolve_backend(cfg.backend, cfg.device)
    if o.mixed_precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{name}.mixed_precision='bf16' is invalid: this GPU has no bf16 support; use 'fp16'")


def check_dtype(cfg: RunConfig, name: str) -> None:
    """Mixed precision casts to 16 bits and reduces in float32: it has no float64 version."""
    mixed = cfg.tier_options.mixed_precision
    if mixed != "none" and cfg.dtype != "float32":
        raise ValueError(f"{name}.mixed_precision={mixed!r} is invalid with RunConfig.dtype={cfg.dtype!r}: it "
                         f"computes in 16 bits and reduces in float32; use mixed_precision='none'")
