"""Tier: context parallelism -- the sequence split over the ranks; attention by a ring or by Ulysses.

Each rank holds some positions of every sequence (dim 1 of every batch) and computes the
logits and loss of those positions only. Everything but attention is per-position, so it
needs no communication. Attention needs every earlier key; two ways to get it
(``Options.method``):

* ``ring`` (``cp_ring``): each rank keeps its queries and the ranks pass their K/V blocks
  around a ring with ``batch_isend_irecv``, merging partial softmaxes exactly (ring
  attention, Liu et al. 2023; written as picotron does, forward and backward by hand).
* ``ulysses`` (``cp_ulysses``): an all-to-all trades the sequence shards for head shards,
  each rank runs ordinary attention on its heads over the whole sequence, and a second
  all-to-all trades back (DeepSpeed-Ulysses, Jacobs et al. 2023). Needs the heads to
  divide over the ranks.

Which positions a rank holds (``Options.balance``, ``cp_layout``): ``contiguous``, one chunk
per rank, leaves causal attention's work uneven (rank n-1 attends to n chunks, rank 0 to
one); ``zigzag``, chunks r and 2n-1-r of 2n, evens it (the Llama 3 paper, sec. 3.3.2).

Like DDP, every rank holds all parameters (they start equal: the model is seeded) and
all-reduces the gradients after backward, averaging them. Each rank's loss is the mean
over its equally many tokens, so the average is the single device's gradient of the
global-batch mean. On a CUDA device PyTorch's own
``torch.distributed.tensor.experimental.context_parallel`` shards the sequence the same
way, but it runs only on the CUDA flash / memory-efficient attention kernels; on this
CPU we build the exchanges ourselves.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.core.data import SEQ_LEN
from dtlab.core.memory import SavedActivations
from dtlab.core.registry import TierSpec
from dtlab.instrument.recorder import timed_phase
from dtlab.tiers.parts import base, cp_layout
from dtlab.tiers.parts.cp_layout import BACKWARD_TAG, BALANCES, FORWARD_TAG
from dtlab.tiers.parts.cp_ring import Ring, RingAttention, ring_attention, ring_hops_per_block
from dtlab.tiers.parts.cp_ulysses import ALL_TO_ALLS_PER_BLOCK, HeadSwap, ulysses_attention

__all__ = ["Attention", "BACKWARD_TAG", "BALANCES", "FORWARD_TAG", "METHODS", "Options", "Ring", "RingAttention",
           "SPEC", "Strategy", "attention", "chunk_forward", "ring_attention", "ring_hops_per_block", "validate"]

METHODS = ("ring", "ulysses")
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Options:
    method: str = "ring"  # "ring": K/V blocks around a ring; "ulysses": all-to-all to head shards and back
    balance: str = "contiguous"  # "contiguous": chunk r on rank r; "zigzag": chunks r and 2n-1-r of 2n


def validate(cfg: RunConfig) -> None:
    o, n, name = cfg.tier_options, cfg.world_size, "cp tier_options"
    if cfg.model != "charformer":
        raise ValueError(f"RunConfig.model={cfg.model!r} is invalid for tier 'cp': it runs the built-in "
                         "charformer's attention split over the sequence; use model='charformer'")
    if o.method not in METHODS:
        raise ValueError(f"{name}.method={o.method!r} is invalid: choose one of {', '.join(METHODS)}")
    if o.balance not in BALANCES:
        raise ValueError(f"{name}.balance={o.balance!r} is invalid: choose one of {', '.join(BALANCES)}")
    if o.balance == "zigzag" and SEQ_LEN % (2 * n):
        raise ValueError(f"{name}.balance='zigzag' is invalid at world_size={n}: the text's sequences of "
                         f"{SEQ_LEN} positions must split into 2 x world_size = {2 * n} equal chunks")
    if SEQ_LEN % n:
        raise ValueError(f"RunConfig.world_size={n} is invalid for tier 'cp': the text's sequences of "
                         f"{SEQ_LEN} positions must split into world_size equal chunks")
    h = cfg.model_heads
    if o.method == "ulysses" and h % n:
        why = (f"fewer heads than the {n} ranks" if h < n else f"{h} heads do not divide over {n} ranks")
        raise ValueError(f"RunConfig.model_heads={h} is invalid for tier 'cp' with method='ulysses': {why} (each "
                         f"rank attends with model_heads / world_size whole heads); use a multiple of {n}")


def attention(o: Options, n: int, comm: Ring | HeadSwap, seq_len: int = SEQ_LEN) -> Attention:
    """The attention each rank runs on its positions' q, k, v (of sequences ``seq_len`` long): ``comm`` is a
    ``Ring`` for ``ring``, a ``HeadSwap`` for ``ulysses`` (or their solo stand-ins, for a prediction)."""
    if o.method == "ring":
        return functools.partial(ring_attention, ring=comm, layout=cp_layout.layout(n, o.balance))
    return functools.partial(ulysses_attention, swap=comm, order=cp_layout.natural_order(n, o.balance, seq_len))


# -- the model's forward on one rank's positions --------------------------------------------
def _attention(attn: models.CausalSelfAttention, x: torch.Tensor, attend: Attention) -> torch.Tensor:
    """``CausalSelfAttention.forward`` with the split attention in place of SDPA."""
    b, t, _ = x.shape
    q, k, v = (proj(x).view(b, t, attn.heads, -1).transpose(1, 2) for proj in (attn.q, attn.k, attn.v))
    y = attend(q, k, v)
    return attn.out(y.transpose(1, 2).reshape(b, t, -1))


def chunk_forward(model: models.CharFormer, x: torch.Tensor, positions: torch.Tensor,
                  attend: Attention) -> torch.Tensor:
    """``CharFormer.forward`` of one rank's ``positions`` of the sequence (``x``: those positions' tokens)."""
    h = model.tok(x) + model.pos(positions)
    for block in model.blocks:
        h = h + _attention(block.attn, block.ln1(h), attend)
        h = h + block.mlp(block.ln2(h))
    return model.head(model.ln(h))


# -- the strategy -----------------------------------------------------------------------
class Strategy(base.Strategy):
    custom_step = True

    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        self.data_rank, self.data_world = 0, 1  # every rank reads the whole global batch, and cuts its positions
        self.options: Options = cfg.tier_options
        self.positions = cp_layout.positions(info.rank, info.world_size, self.options.balance, SEQ_LEN)
        self.times = {"forward": 0.0, "backward": 0.0, "forward_wait": 0.0, "backward_wait": 0.0}
        # What the first step's forward saves for backward (the loop cannot see inside run_step)
        self.activations: int | None = None

    def run_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rank, n, balance = self.info.rank, self.info.world_size, self.options.balance
        x, y = cp_layout.local_batch(x, rank, n, balance), cp_layout.local_batch(y, rank, n, balance)
        comm = Ring() if self.options.method == "ring" else HeadSwap()
        attend = attention(self.options, n, comm)
        start = time.perf_counter()
        counting = SavedActivations() if self.activations is None else contextlib.nullcontext()
        with timed_phase("cp_forward"), counting as acts:
            positions = torch.tensor(self.positions, device=x.device)
            loss = models.loss(chunk_forward(model, x, positions, attend), y)
        if acts is not None:  # counted as the loop counts other tiers: parameters left out
            self.activations = acts.bytes(exclude=model.parameters())
        middle, forward_wait = time.perf_counter(), comm.waited_s
        with timed_phase("cp_backward"):
            loss.backward()
        end = time.perf_counter()
        self.times = {"forward": middle - start, "backward": end - middle, "forward_wait": forward_wait,
                      "backward_wait": comm.waited_s - forward_wait}
        reported = loss.detach().clone()
        dist.all_reduce(reported)  # 4 bytes, so every rank reports the global mean, not its positions'
        return reported / self.info.world_size

    def sync_gradients(self, model: nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for the whole model, not one per tensor
        dist.all_reduce(flat)
        flat.div_(self.info.world_size)  # each rank's loss is a mean over equally many tokens
        for grad, synced in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(synced.view_as(grad))

    def memory(self) -> dict[str, int]:
        return {} if self.activations is None else {"activations": self.activations}

    def split_step(self, seconds: float) -> dict[str, float]:
        """Compute of the forward and backward passes; waiting on the ring or the all-to-alls (and the loss's
        all-reduce, and the rest of the step) counts as communication."""
        t = self.times
        forward, backward = t["forward"] - t["forward_wait"], t["backward"] - t["backward_wait"]
        return {"forward": forward, "backward": backward, "comm": max(0.0, seconds - forward - backward)}

    def describe(self) -> dict[str, Any]:
        o, n = self.options, self.info.world_size
        out = {"method": o.method, "balance": o.balance, "sequence_chunk": len(self.positions),
               "chunks": list(cp_layout.chunks_of(self.info.rank, n, o.balance))}
        if o.method == "ring":
            return out | {"ring_steps": n, "isends_per_block": ring_hops_per_block(n)}
        return out | {"heads_per_rank": self.cfg.model_heads // n,
                      "all_to_alls_per_block": ALL_TO_ALLS_PER_BLOCK if n > 1 else 0}


SPEC = TierSpec(name="cp", summary="context parallel: the sequence split, attention by a ring or by Ulysses",
                options=Options, validate=validate, strategy=Strategy,
                autocast=False, activation_checkpointing=False, models=("charformer",),
                choices={"method": METHODS, "balance": BALANCES})
