"""The memory rule for expert parallelism (``ep``), in ``memory.RULES``' signature: ``(cfg, model, s)``.

Rank r holds the replicated part of the ``moe`` model (embeddings, attention, norms, routers, head)
and its ``experts / n`` experts of each layer: parameters, gradients and Adam's state of exactly
those. Its activations come from the tier's own forward (``ep.shard_experts``) on fake tensors, with
an exchange that stands in for the all-to-alls. What a rank saves depends on the routing: its
experts run on the rows every rank sends them, and a router is uneven, so the busiest rank (the one
memory is sized by) holds more than the mean. The routing is the first step's, the step a run
measures activations in: the job's seeded model runs each rank's first batch for real (``routing``),
and the fake forward takes each layer's counts from it. A model over ``REAL_ROUTING_MAX_BYTES`` is
not run; each rank then gets the mean (an even router), exact in the ranks' sum only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.core.config import RunConfig
from dtlab.core.data import ShardedBatches
from dtlab.core.job import build_job
from dtlab.core.moe import MoE
from dtlab.cost.estimate import activations as acts
from dtlab.cost.estimate.rank import RankMemory, nbytes, optimizer_bytes
from dtlab.tiers import ep as ep_tier

__all__ = ["REAL_ROUTING_MAX_BYTES", "RULES", "expert_parallel", "routing"]

REAL_ROUTING_MAX_BYTES = 256 * 2**20  # parameters a model may have to be run here for its routing

Counts = dict[str, list[list[int]]]  # MoE layer's name -> per rank, the assignments it keeps per expert


def routing(cfg: RunConfig) -> Counts:
    """Each MoE layer's kept assignments per expert on each rank's first batch, from the job's seeded model
    (the ep tier routes each rank's tokens with the same replicated routers, so its counts are these)."""
    with torch.random.fork_rng(devices=[]):  # build_job seeds torch: leave the caller's generator as it was
        model, data = build_job(cfg, torch.device("cpu"))
    counts: Counts = {}
    for name, layer in model.named_modules():
        if isinstance(layer, MoE):
            counts[name] = []
            layer.assign = functools.partial(_recorded, layer.assign, counts[name])
            if cfg.tier_options.hot_expert >= 0:
                layer.router.register_forward_hook(functools.partial(ep_tier.overload, cfg.tier_options.hot_expert))
    with torch.no_grad():
        for rank in range(cfg.world_size):
            idx = ShardedBatches(len(data), cfg.global_batch_size, rank, cfg.world_size, cfg.seed).indices(0)
            model(data.train_x[idx])
    return counts


def _recorded(assign: Callable[[torch.Tensor], tuple[torch.Tensor, list[int]]], into: list[list[int]],
              expert_of: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    order, counts = assign(expert_of)
    into.append(counts)
    return order, counts


def _given(counts: list[int], expert_of: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``MoE.assign`` on fake tensors with the counts a real router gave."""
    return torch.arange(sum(counts), device=expert_of.device), counts


class _Solo(ep_tier.Exchange):
    """An exchange seen from one rank alone: the counts every rank sends it come from ``table`` (the first
    step's routing) or, without one, as if every rank routed as this one does."""

    table: Counts | None = None

    def exchange_counts(self, counts: list[int]) -> list[int]:
        m = self.local
        if self.table is None:
            return [counts[self.first + j] for _ in range(self.world) for j in range(m)]
        return [sent[self.first + j] for sent in self.table[self.name] for j in range(m)]

    def all_to_all(self, x: torch.Tensor, received: list[int], sent: list[int], what: str) -> Any:
        # a receive lands in a fresh buffer, the output of an autograd Function (it requires grad)
        return x.new_empty((sum(received), *x.shape[1:])).requires_grad_()


def local_model(cfg: RunConfig, s: acts.Shapes, rank: int, mode: FakeTensorMode,
                table: Counts | None = None) -> nn.Module:
    """Rank ``rank``'s model under ep, on fake tensors: its own experts, the exchange stood in for, routed as
    ``table`` says (None: an even router)."""
    model = acts.fake_model(cfg, s, mode)
    exchange = type("_Routed", (_Solo,), {"table": table})
    for ex in ep_tier.shard_experts(model, rank, cfg.world_size, exchange):
        if table is not None:
            ex.layer.assign = functools.partial(_given, table[ex.name][rank])
    return model


def expert_parallel(cfg: RunConfig, model: nn.Module, s: acts.Shapes) -> list[RankMemory]:
    """ep: the replicated part and this rank's experts; the rank's batch through them, routed as the first step."""
    n = cfg.world_size
    small = sum(nbytes(p) for p in model.parameters()) <= REAL_ROUTING_MAX_BYTES
    table = routing(cfg) if small else None
    how = ("routed as the seeded model routes each rank's first batch (the step a run measures)" if small else
           "the router sharing the tokens out evenly: the mean over the ranks, the model too large to run here for "
           "its routing (a busier rank holds its experts' rows above the mean more)")
    notes = [f"parameters, gradients and optimizer state: the replicated part and {cfg.experts // n} of the "
             f"{cfg.experts} experts of each layer", f"activations: a rank's {cfg.per_rank_batch} samples, {how}",
             "comm_buffers: none kept (the all-to-all buffers are activations; the gradients' flat all-reduce is "
             "freed)"]
    out = []
    for rank in range(n):
        mode = FakeTensorMode()
        local = local_model(cfg, s, rank, mode, table)
        params = list(local.parameters())
        p = sum(nbytes(t) for t in params)
        x, y = acts.batch(s, cfg.per_rank_batch, mode)
        saved, _ = acts.forward_saved(cfg, mode, local, [x], [y])
        memory = {"parameters": p, "gradients": p, "optimizer_state": optimizer_bytes(cfg, params),
                  "activations": saved, "comm_buffers": 0}
        out.append(RankMemory(rank, memory, notes))
    return out


RULES: dict[str, Callable[..., list[RankMemory]]] = {"ep": expert_parallel}
