"""Tier: expert parallelism -- the moe model's experts shared out over the ranks, the tokens sent to them.

Where ddp replicates the whole model, ep gives each rank ``experts / world_size`` of
every MoE layer's experts (rank r holds experts r*m .. r*m + m - 1) and replicates
the rest: embeddings, attention, norms, routers, the head. Like ddp each rank trains
on its share of the global batch, so the replicated parameters' gradients are
averaged after backward (one flat all-reduce, as the cp tier does).

In each MoE layer every rank routes its own tokens, then (GShard, Lepikhin et al.
2020, sec. 2.2; Megatron-LM's and torchtitan's token dispatch):

1. ``all_to_all_single`` of the counts: rank s tells rank r how many of its tokens go
   to each of r's experts (an even split: ``experts`` int64 per rank);
2. ``all_to_all_single`` of the tokens with those uneven splits (dispatch);
3. each local expert runs on the tokens of every rank that picked it;
4. ``all_to_all_single`` back with the splits reversed (combine); the MoE layer
   weights and adds up each token's outputs.

The exchanges are an autograd Function whose backward is the same all-to-all with
the splits swapped, so each token's gradient flows back to the rank that owns the
expert. That makes an expert's gradient the sum over all ranks' losses; each rank's
loss is the mean over its 1/n of the batch, so the expert gradients are divided by
n to give the single device's gradient of the global mean. Every exchange goes
through ``torch.distributed``, so the CommRecorder records each one with its split
sizes (``input_splits``, ``output_splits``), tagged ``ep:counts|dispatch|combine:<layer>``.

An expert that many tokens pick makes its rank the straggler: the others wait for it
in the combine. ``hot_expert`` forces that (every token's first choice, by a router
bias) to show it; it changes the model, so such a run does not match ``single``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.core.config import RunConfig
from dtlab.core.data import Dataset
from dtlab.core.models import evaluate
from dtlab.core.moe import MoE
from dtlab.core.registry import TierSpec
from dtlab.instrument.recorder import tagged
from dtlab.tiers.parts import base
from dtlab.tiers.parts.sharded import meta_copy, plain_copy

__all__ = ["Exchange", "HOT_BIAS", "Options", "SPEC", "Strategy", "expert_names", "overload", "shard_experts",
           "validate"]

HOT_BIAS = 10.0  # added to the hot expert's router logit: it becomes every token's first choice


@dataclass(frozen=True)
class Options:
    hot_expert: int = -1  # >= 0: every token picks this expert first (an overloaded expert, for the straggler)


def validate(cfg: RunConfig) -> None:
    if cfg.model != "moe":
        raise ValueError(f"RunConfig.model={cfg.model!r} is invalid for tier 'ep': it shares out the experts of "
                         f"the built-in mixture of experts; use model='moe'")
    if cfg.experts % cfg.world_size:
        raise ValueError(f"RunConfig.experts={cfg.experts} is invalid for tier 'ep': the experts must divide evenly "
                         f"over world_size={cfg.world_size} ranks")
    hot = cfg.tier_options.hot_expert
    if isinstance(hot, bool) or not isinstance(hot, int) or not -1 <= hot < cfg.experts:
        raise ValueError(f"ep tier_options.hot_expert={hot!r} is invalid: an expert 0..{cfg.experts - 1}, "
                         f"or -1 for none")


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, received: list[int], sent: list[int], tag: str) -> torch.Tensor:
        ctx.received, ctx.sent, ctx.tag = received, sent, tag
        out = x.new_empty((sum(received), *x.shape[1:]))
        with tagged(tag):
            dist.all_to_all_single(out, x.contiguous(), received, sent)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        with tagged(f"{ctx.tag} (backward)"):
            dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.received)
        return back, None, None, None


class Exchange:
    """One MoE layer's ``dispatch`` on this rank: counts, tokens out, local experts, tokens back."""

    def __init__(self, layer: MoE, name: str, rank: int, world: int) -> None:
        self.layer, self.name, self.world = layer, name, world
        self.local = layer.routing.experts // world
        self.first = rank * self.local  # this rank's first expert
        self.tokens = [0] * self.local  # rows each local expert ran on since the last harvest
        self.seconds = 0.0  # forward compute in the local experts since the last harvest

    def __call__(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        m = self.local
        sent = [sum(counts[r * m:(r + 1) * m]) for r in range(self.world)]
        got = self.exchange_counts(counts)  # got[s * m + j]: rank s's rows for local expert j
        received = [sum(got[s * m:(s + 1) * m]) for s in range(self.world)]
        arrived = self.all_to_all(x, received, sent, "dispatch")
        start = time.perf_counter()
        done = self.run_local(arrived, got)
        self.seconds += time.perf_counter() - start
        return self.all_to_all(done, sent, received, "combine")

    def exchange_counts(self, counts: list[int]) -> list[int]:
        mine = torch.tensor(counts, dtype=torch.int64)
        theirs = torch.empty_like(mine)
        with tagged(f"ep:counts:{self.name}"):
            dist.all_to_all_single(theirs, mine)
        return theirs.tolist()

    def all_to_all(self, x: torch.Tensor, received: list[int], sent: list[int], what: str) -> torch.Tensor:
        return _AllToAll.apply(x, received, sent, f"ep:{what}:{self.name}")

    def run_local(self, x: torch.Tensor, got: list[int]) -> torch.Tensor:
        """Each local expert on the rows every rank sent it (rank-major in ``x``), back in ``x``'s order."""
        m, chunks = self.local, list(x.split(got))
        for j in range(m):
            mine = [s * m + j for s in range(self.world)]
            # every expert runs, on no rows too: its gradient is then zero (not None), as on one device
            out = self.layer.experts[str(self.first + j)](torch.cat([chunks[i] for i in mine]))
            for i, part in zip(mine, out.split([got[i] for i in mine])):
                chunks[i] = part
            self.tokens[j] += sum(got[i] for i in mine)
        return torch.cat(chunks)

    def harvest(self) -> tuple[list[int], float]:
        out = (self.tokens, self.seconds)
        self.tokens, self.seconds = [0] * self.local, 0.0
        return out


def shard_experts(model: nn.Module, rank: int, world: int, exchange: type[Exchange] = Exchange) -> list[Exchange]:
    """Keep only rank ``rank``'s experts in every MoE layer and route through an ``exchange`` (in place)."""
    out = []
    for name, layer in model.named_modules():
        if not isinstance(layer, MoE):
            continue
        ex = exchange(layer, name, rank, world)
        for key in list(layer.experts.keys()):
            if not ex.first <= int(key) < ex.first + ex.local:
                del layer.experts[key]
        layer.dispatch = ex
        out.append(ex)
    return out


def overload(hot_expert: int, _module: nn.Module, _args: Any, logits: torch.Tensor) -> torch.Tensor:
    """A router's forward hook that makes ``hot_expert`` every token's first choice (``Options.hot_expert``)."""
    bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    bias[hot_expert] = HOT_BIAS
    return logits + bias


def expert_names(model: nn.Module) -> list[str]:
    """The state-dict names of the experts' parameters this rank holds."""
    return [n for n, _ in model.named_parameters() if ".experts." in n]


class Strategy(base.Strategy):
    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        self.options: Options = cfg.tier_options
        self.exchanges: list[Exchange] = []
        self.expert_ids: set[int] = set()
        self._template: nn.Module | None = None
        self.expert_tokens: list[list[int]] = []  # per step: rows each local expert ran on, all layers
        self.expert_seconds: list[float] = []  # per step: forward seconds in the local experts

    def wrap(self, model: nn.Module) -> nn.Module:
        self._template = meta_copy(model)  # every expert: rank 0 evaluates the whole model in finish()
        self.exchanges = shard_experts(model, self.info.rank, self.info.world_size)
        for exchange in self.exchanges:
            if self.options.hot_expert >= 0:
                exchange.layer.router.register_forward_hook(self._overload)
        self.expert_ids = {id(p) for e in self.exchanges for p in e.layer.experts.parameters()}
        return model

    def _overload(self, _module: nn.Module, args: Any, logits: torch.Tensor) -> torch.Tensor:
        return overload(self.options.hot_expert, _module, args, logits)

    def sync_gradients(self, model: nn.Module) -> None:
        """Average the replicated parameters' gradients; scale the experts' (already summed over ranks)."""
        n = self.info.world_size
        replicated = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in self.expert_ids]
        flat = torch.cat([g.reshape(-1) for g in replicated])  # one collective, not one per tensor
        with tagged("ep:replicated"):
            dist.all_reduce(flat)
        flat.div_(n)
        for grad, synced in zip(replicated, flat.split([g.numel() for g in replicated])):
            grad.copy_(synced.view_as(grad))
        for p in model.parameters():
            if p.grad is not None and id(p) in self.expert_ids:
                p.grad.div_(n)

    def on_step_end(self, step: int) -> None:
        harvested = [e.harvest() for e in self.exchanges]
        self.expert_tokens.append([sum(col) for col in zip(*(tokens for tokens, _ in harvested))])
        self.expert_seconds.append(sum(seconds for _, seconds in harvested))

    def finish(self, model: nn.Module, data: Dataset) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Every rank's experts gathered onto every rank (so the checksums agree); rank 0 evaluates."""
        state = model.state_dict()
        mine = {k: state[k] for k in expert_names(model)}
        every: list[Any] = [None] * self.info.world_size
        with tagged("ep:gather"):
            dist.all_gather_object(every, mine)
        assert self._template is not None, "wrap() first"
        full = {k: v for k, v in state.items() if ".experts." not in k}
        for part in every:
            full.update(part)
        full = {k: full[k] for k in self._template.state_dict()}  # the single device's order
        if not self.info.is_main:
            return full, {}
        plain = plain_copy(self._template, full, model, self.info.device, self.cfg.tier)
        return full, evaluate(plain, data, self.info.device)

    def describe(self) -> dict[str, Any]:
        first = self.info.rank * (self.cfg.experts // self.info.world_size)
        return {"ep_size": self.info.world_size,
                "local_experts": list(range(first, first + self.cfg.experts // self.info.world_size)),
                "hot_expert": self.options.hot_expert, "expert_tokens": self.expert_tokens,
                "expert_forward_s": self.expert_seconds}


SPEC = TierSpec(name="ep", summary="expert parallel: the experts shared out, tokens sent to them with all-to-all",
                options=Options, validate=validate, strategy=Strategy, autocast=False,
                activation_checkpointing=False, models=("moe",))
