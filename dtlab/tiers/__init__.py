"""The tiers: one module per tier, each a small diff of its predecessor.

A tier module holds ``Options`` (a frozen dataclass of its knobs), ``validate(cfg)``
(pure: raises ValueError naming the field), its ``Strategy`` (the hooks the
training loop calls) and ``SPEC``, the ``TierSpec`` that declares them. Importing
this package registers every tier, in the order of the course.
"""

from __future__ import annotations

from dtlab.core import registry
from dtlab.core.registry import TierSpec
from dtlab.tiers import (
    cp,
    ddp,
    ddp_naive,
    diloco,
    dp,
    elastic,
    ep,
    fsdp,
    fsdp_tp,
    ft,
    multinode,
    nd,
    pipeline,
    rpc,
    single,
    tp,
    zero,
)

for _module in (single, dp, ddp_naive, ddp, zero, rpc, pipeline, fsdp, multinode, elastic, ft, diloco, tp, fsdp_tp,
                cp, ep, nd):
    registry.register(_module.SPEC)

TIERS: tuple[str, ...] = registry.names()


def get(name: str) -> TierSpec:
    """The tier called ``name`` (ValueError listing the tiers otherwise)."""
    return registry.get(name)


__all__ = ["TIERS", "get"]
