"""The built-in ``moe`` model: the charformer with a mixture of experts in place of each block's MLP.

Each token's router (a Linear to ``experts`` logits, softmax) picks its ``top_k``
experts; every expert is the charformer's MLP; the token's output is the sum of its
experts' outputs, each weighted by its router probability (not renormalised over the
k, as Switch Transformer weights its one expert, so the router learns from the task
loss for every k). Dropless by default: every token reaches its k experts. With
``capacity_factor > 0`` each expert takes at most ``ceil(capacity_factor * tokens * k
/ experts)`` assignments per forward, first choices before second ones (GShard's
order); the rest are dropped (that expert adds nothing to the token; the residual
carries it) and counted.

The load-balancing loss is Switch Transformer's ``E * sum_e f_e * P_e`` (Fedus et al.
2021, eq. 4): ``f_e`` the share of the k-way assignments that go to expert e, ``P_e``
the mean router probability of e; 1 when the load is even, up to E when it is not.
It is computed per sequence and averaged over the batch (DeepSeek-V3's sequence-wise
variant), so that, like the cross-entropy, it is a mean over samples: any
data-parallel split of a batch then averages to the same loss and gradient as the
single device. It enters the loss times ``RunConfig.aux_loss_coef`` (default 0.01,
Switch's alpha), through the auxiliary-loss protocol of ``dtlab.core.models``.

The data-dependent part of routing (who goes where, how many) is ``MoE.assign``; how
the assigned tokens reach their experts is ``MoE.dispatch`` (``None``: here, one
expert after another). Expert parallelism (``dtlab.tiers.ep``) sets ``dispatch`` to
an all-to-all exchange and keeps only its own experts in ``MoE.experts``, keyed by
their global index so parameter names do not change.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.core.charformer import CharFormer
from dtlab.core.compat import in_backward

__all__ = ["MoE", "MoEFormer", "Routing", "balance_loss", "even_assign", "expert_mlp", "routing_of"]

Dispatch = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class Routing:
    """The mixture's knobs (``RunConfig.experts``, ``top_k``, ``capacity_factor``, ``aux_loss_coef``)."""

    experts: int = 4
    top_k: int = 2
    capacity_factor: float = 0.0  # 0: dropless
    aux_loss_coef: float = 0.01


def expert_mlp(width: int) -> nn.Module:
    """One expert: the charformer's MLP (``dtlab.core.charformer.Block.mlp``)."""
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def even_assign(r: Routing, expert_of: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``MoE.assign`` for a router that shares the assignments out evenly (capped at the capacity): what the
    memory and FLOP predictions use, since fake tensors hold no router decisions."""
    n = expert_of.numel()
    counts = [n // r.experts + (e < n % r.experts) for e in range(r.experts)]
    if r.capacity_factor > 0:
        counts = [min(c, math.ceil(r.capacity_factor * n / r.experts)) for c in counts]
    return torch.arange(sum(counts), device=expert_of.device), counts


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's ``E * sum_e f_e * P_e`` per sequence, averaged over the sequences.

    ``probs``: (batch, tokens, experts) router probabilities; ``chosen``: (batch, tokens, k)
    the experts each token picked. ``f_e`` counts the picks before any capacity drop.
    """
    experts, k = probs.shape[-1], chosen.shape[-1]
    picks = torch.zeros_like(probs).scatter_add_(-1, chosen, torch.ones_like(chosen, dtype=probs.dtype))
    share = picks.mean(1) / k  # (batch, experts): each row sums to 1
    return experts * (share * probs.mean(1)).sum(-1).mean()


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (see the module's docstring)."""

    def __init__(self, width: int, routing: Routing) -> None:
        super().__init__()
        self.routing = routing
        self.router = nn.Linear(width, routing.experts, bias=False)
        self.experts = nn.ModuleDict({str(e): expert_mlp(width) for e in range(routing.experts)})
        self.dispatch: Dispatch | None = None
        self.aux_loss: torch.Tensor | None = None  # the auxiliary-loss protocol (dtlab.core.models)
        self._tokens = [0] * routing.experts
        self._dropped = 0
        self._aux: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        k = self.routing.top_k
        probs = F.softmax(self.router(x), dim=-1)
        weights, chosen = probs.topk(k, dim=-1)
        aux = balance_loss(probs, chosen)
        self.aux_loss = self.routing.aux_loss_coef * aux
        # Assignments in k-major order: every token's first choice, then every second choice.
        expert_of = chosen.reshape(b * t, k).t().reshape(-1)
        order, counts = self.assign(expert_of)
        token = torch.arange(b * t, device=x.device).repeat(k)[order]
        flat = x.reshape(b * t, width)
        run = self.dispatch if self.dispatch is not None else self.run_experts
        y = run(flat[token], counts)
        out = torch.zeros_like(flat).index_add(0, token, y * weights.reshape(b * t, k).t().reshape(-1)[order, None])
        if not in_backward():  # a checkpointed block runs again in backward: count its tokens once
            self._count(counts, len(expert_of), aux)
        return out.view(b, t, width)

    def assign(self, expert_of: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The kept assignments' positions in ``expert_of``, grouped by expert (stable), and each expert's count."""
        n, experts = expert_of.numel(), self.routing.experts
        kept = torch.arange(n, device=expert_of.device)
        if self.routing.capacity_factor > 0:
            capacity = math.ceil(self.routing.capacity_factor * n / experts)
            onehot = torch.zeros(n, experts, dtype=torch.long, device=expert_of.device)
            onehot.scatter_(1, expert_of[:, None], 1)
            position = (onehot.cumsum(0) * onehot).sum(1) - 1  # how many went to the same expert before
            kept = kept[position < capacity]
        order = kept[torch.argsort(expert_of[kept], stable=True)]
        return order, torch.bincount(expert_of[kept], minlength=experts).tolist()

    def run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert on its rows of ``x`` (grouped by expert, ``counts`` rows each), one after another.

        An expert runs on no rows too: its gradient is then zero rather than None, so every tier steps
        every parameter alike (and DDP finds a gradient for each)."""
        return torch.cat([self.experts[str(e)](chunk) for e, chunk in enumerate(x.split(counts))])

    def _count(self, counts: list[int], assignments: int, aux: torch.Tensor) -> None:
        self._tokens = [a + c for a, c in zip(self._tokens, counts)]
        self._dropped += assignments - sum(counts)
        self._aux.append(aux.detach())

    def pop_step_stats(self) -> dict[str, float]:
        """What this layer routed since the last call (the step-statistics protocol of ``dtlab.core.models``):
        ``tokens_e{i}`` assignments kept per expert, ``dropped_tokens``, ``balance_loss`` (unscaled)."""
        out = {f"tokens_e{e}": float(n) for e, n in enumerate(self._tokens)}
        out["dropped_tokens"] = float(self._dropped)
        out["balance_loss"] = float(torch.stack(self._aux).mean()) if self._aux else 0.0
        self._tokens, self._dropped, self._aux = [0] * self.routing.experts, 0, []
        return out


class MoEFormer(CharFormer):
    """The charformer whose blocks' MLPs are ``MoE`` layers (parameter names ``blocks.i.mlp.router.weight``,
    ``blocks.i.mlp.experts.e.0.weight``, ...)."""

    def __init__(self, vocab: int, seq_len: int, width: int, layers: int, routing: Routing, heads: int = 2) -> None:
        super().__init__(vocab, seq_len, width, layers, heads)
        for block in self.blocks:
            block.mlp = MoE(width, routing)


def routing_of(model: nn.Module) -> list[MoE]:
    """The model's MoE layers, in forward order."""
    return [m for m in model.modules() if isinstance(m, MoE)]
