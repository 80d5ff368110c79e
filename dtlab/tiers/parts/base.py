"""What every tier shares: a Strategy that changes nothing.

The training loop calls only these methods, so it never knows which tier
runs. A tier overrides the few it needs. In order, per rank:

    wrap -> make_optimizer -> for each step: on_step_start, (no_sync) forward/backward
    or run_step, sync_gradients, optimizer step, on_step_end, next_step -> memory, finish;
    on_error if anything raised.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtlab.core.config import RunConfig
from dtlab.core.data import Dataset
from dtlab.core.env import DistInfo
from dtlab.core.job import OptimizerFactory, optimizer_params
from dtlab.core.models import evaluate


@dataclass(frozen=True)
class NoOptions:
    """This tier has no knobs."""


class Strategy:
    accumulation_steps = 1
    start_step = 0  # the loop runs steps start_step .. cfg.steps - 1 (a resumed run starts later)
    custom_step = False  # True: the loop calls run_step() instead of forward, loss, backward
    # Channels of the instrument layer this tier declares (dtlab.instrument.channels): "modules", "ddp_buckets"
    # and "fsdp_units" name its calls; "fsdp_gathered" measures what it holds gathered
    comm_channels: tuple[str, ...] = ()
    # True: every rank returns its parameters, not rank 0 alone, so that a run of replica groups can check that
    # every rank of every group ended with the same ones (dtlab.train.ft.replica_agreement)
    params_on_every_rank = False

    def __init__(self, cfg: RunConfig, info: DistInfo) -> None:
        self.cfg, self.info = cfg, info
        # Which share of each global batch this rank trains on: data-parallel tiers
        # split it over all ranks; a pipeline feeds the whole batch through every stage.
        self.data_rank, self.data_world = info.rank, info.world_size

    def wrap(self, model: nn.Module) -> nn.Module:
        """Apply the strategy to the unchanged model."""
        return model

    def make_optimizer(self, model: nn.Module, build: OptimizerFactory) -> torch.optim.Optimizer:
        return build(optimizer_params(model, build))

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context for micro-batches whose gradients are not yet reduced."""
        return contextlib.nullcontext()

    def step_context(self) -> contextlib.AbstractContextManager[Any]:
        """Context around each micro-batch's forward, loss and backward (e.g. tensor-parallel loss)."""
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

    def split_step(self, seconds: float) -> dict[str, float]:
        """How a ``run_step`` of ``seconds`` divides into forward, backward and comm (waiting for peers)."""
        return {"forward": seconds, "backward": 0.0, "comm": 0.0}

    def on_step_start(self, step: int) -> None:
        """Before step ``step`` (0-based) reads its batch."""

    def on_step_end(self, step: int) -> None:
        """After step ``step``'s optimizer step: ``step + 1`` steps are done."""

    def next_step(self, step: int) -> int:
        """The step the loop runs after ``step``: the next one, unless the tier could not commit this one
        (a fault-tolerant tier runs it again) or has caught up with its peers (it jumps to their step)."""
        return step + 1

    def on_error(self, exc: BaseException) -> None:
        """Anything raised on this rank, before it propagates (e.g. to shrink the next attempt's batch)."""

    def memory(self) -> dict[str, int]:
        """Memory kinds (bytes) this strategy measured itself, after the last step; the loop merges them
        into ``RankResult.memory``, over its own figure for the same kind. See ``dtlab.core.memory``."""
        return {}

    def finish(self, model: nn.Module, data: Dataset) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The whole model's state (complete at least on rank 0) and rank 0's held-out evaluation.

        Called once, on every rank: a sharded tier gathers its state here (a collective).
        """
        state = self.unwrap(model).state_dict()
        return state, evaluate(self.unwrap(model), data, self.info.device) if self.info.is_main else {}

    def describe(self) -> dict[str, Any]:
        """Facts about what ran, for the result (e.g. real or emulated DP)."""
        return {}
