"""The memory rule for expert parallelism (``ep``), in ``memory.RULES``' signature: ``(cfg, model, s)``.

Rank r holds the replicated part of the ``moe`` model (embeddings, attention, norms, routers, head)
and its ``experts / n`` experts of each layer: parameters, gradients and Adam's state of exactly
those. Its activations come from the tier's own forward (``ep.shard_experts``) on fake tensors, with
an exchange that stands in for the all-to-alls: the counts come back as if every rank routed as this
one does, the tokens in a fresh buffer of the size they would have. The router is taken to share the
tokens out evenly (fake tensors carry no values), so each rank's experts run on its own tokens x k
rows. A real router is uneven: a rank's activations then differ from the prediction by its experts'
rows above or below that share, but the ranks' sum does not (every assignment runs on some rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.analysis.estimate import activations as acts
from dtlab.analysis.estimate import memory as mem  # the module: memory.py imports RULES from here
from dtlab.core.config import RunConfig
from dtlab.tiers import ep as ep_tier

__all__ = ["RULES", "expert_parallel"]


class _Solo(ep_tier.Exchange):
    """An exchange seen from one rank alone: every rank sends it what it sends each of them."""

    def exchange_counts(self, counts: list[int]) -> list[int]:
        m = self.local
        return [counts[self.first + j] for _ in range(self.world) for j in range(m)]

    def all_to_all(self, x: torch.Tensor, received: list[int], sent: list[int], what: str) -> Any:
        # a receive lands in a fresh buffer, the output of an autograd Function (it requires grad)
        return x.new_empty((sum(received), *x.shape[1:])).requires_grad_()


def local_model(cfg: RunConfig, s: acts.Shapes, rank: int, mode: FakeTensorMode) -> nn.Module:
    """Rank ``rank``'s model under ep, on fake tensors: its own experts, the exchange stood in for."""
    model = acts.fake_model(cfg, s, mode)
    ep_tier.shard_experts(model, rank, cfg.world_size, _Solo)
    return model


def expert_parallel(cfg: RunConfig, model: nn.Module, s: acts.Shapes) -> list[mem.RankMemory]:
    """ep: the replicated part and this rank's experts; the rank's batch through them (an even router)."""
    n = cfg.world_size
    notes = [f"parameters, gradients and optimizer state: the replicated part and {cfg.experts // n} of the "
             f"{cfg.experts} experts of each layer", f"activations: a rank's {cfg.per_rank_batch} samples, the "
             "router sharing the tokens out evenly (a real router's imbalance moves its experts' rows between "
             "ranks; their sum over the ranks is exact)", "comm_buffers: none kept (the all-to-all buffers are "
             "activations; the gradients' flat all-reduce is freed)"]
    out = []
    for rank in range(n):
        mode = FakeTensorMode()
        local = local_model(cfg, s, rank, mode)
        params = list(local.parameters())
        p = sum(mem.nbytes(t) for t in params)
        x, y = acts.batch(s, cfg.per_rank_batch, mode)
        saved, _ = acts.forward_saved(cfg, mode, local, [x], [y])
        memory = {"parameters": p, "gradients": p, "optimizer_state": mem.optimizer_bytes(cfg, params),
                  "activations": saved, "comm_buffers": 0}
        out.append(mem.RankMemory(rank, memory, notes))
    return out


RULES: dict[str, Callable[..., list[mem.RankMemory]]] = {"ep": expert_parallel}
