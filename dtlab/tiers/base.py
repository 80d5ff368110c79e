"""What every tier shares: a Strategy that changes nothing.

The training loop calls only these methods, so it never knows which tier
runs. A tier overrides the few it needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtlab.config import RunConfig
from dtlab.data import Dataset
from dtlab.env import DistInfo
from dtlab.models import evaluate

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class NoOptions:
    """This tier has no knobs."""


class Strategy:
    accumulation_steps = 1
    start_step = 0  # the loop runs steps start_step .. cfg.steps - 1 (a resumed run starts later)
    custom_step = False  # True: the loop calls run_step() instead of forward, loss, backward

    def __init__(self, cfg: RunConfig, info: DistInfo) -> None:
        self.cfg, self.info = cfg, info
        # Which share of each global batch this rank trains on: data-parallel tiers
        # split it over all ranks; a pipeline feeds the whole batch through every stage.
        self.data_rank, self.data_world = info.rank, info.world_size

    def wrap(self, model: nn.Module) -> nn.Module:
        """Apply the strategy to the unchanged model."""
        return model

    def make_optimizer(self, model: nn.Module, build: OptimizerFactory) -> torch.optim.Optimizer:
        return build(model.parameters())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context for micro-batches whose gradients are not yet reduced."""
        return contextlib.nullcontext()

    def sync_gradients(self, model: nn.Module) -> None:
        """Communication after backward (a hand-written DDP does it here)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module, for evaluation and the final parameters."""
        return model

    def run_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of a whole step, for tiers that set ``custom_step``.

        Returns this rank's loss (a 0-d tensor; NaN where the rank computes none).
        """
        raise NotImplementedError

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state, complete at least on rank 0. Called on every rank."""
        return self.unwrap(model).state_dict()

    def evaluate(self, model: nn.Module, data: Dataset) -> dict[str, float]:
        """Held-out loss and accuracy, reported by rank 0. Called on every rank."""
        if not self.info.is_main:
            return {}
        return evaluate(self.unwrap(model), data, self.info.device)

    def describe(self) -> dict[str, Any]:
        """Facts about what ran, for the result (e.g. real or emulated DP)."""
        return {}


def processes(cfg: RunConfig) -> int:
    return cfg.world_size
