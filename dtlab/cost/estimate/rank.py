"""One rank's predicted bytes (``RankMemory``) and the counts every memory rule shares.

Apart from ``memory`` so that the rules ``memory.RULES`` gathers (``experts``, ``tensor_parallel``, ``mesh``)
import these without importing ``memory``, which imports them.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field

import torch

from dtlab.core.config import RunConfig

__all__ = ["ADAM_STEP_BYTES", "RankMemory", "nbytes", "optimizer_bytes"]

ADAM_STEP_BYTES = 4  # Adam's per-parameter ``step`` is a float32 scalar tensor


@dataclass
class RankMemory:
    """One rank's predicted bytes by kind, and the reasoning behind them."""

    rank: int
    memory: dict[str, int]
    assumptions: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.memory.values())


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def optimizer_bytes(cfg: RunConfig, params: Iterable[torch.Tensor], hidden: Container[int] = frozenset()) -> int:
    """Adam keeps two moments the size of each parameter and a step; plain SGD (no momentum) keeps nothing;
    Muon keeps one momentum per hidden matrix (``hidden``: their ids, ``muon.hidden_matrices``) and AdamW's
    moments and step for the rest."""
    if cfg.optimizer == "muon":
        return sum(nbytes(p) if id(p) in hidden else 2 * nbytes(p) + ADAM_STEP_BYTES for p in params)
    if cfg.optimizer != "adam":
        return 0
    return sum(2 * nbytes(p) + ADAM_STEP_BYTES for p in params)
