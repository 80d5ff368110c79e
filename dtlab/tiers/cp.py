"""Tier: context parallelism -- the sequence split over the ranks, attention passed around a ring.

The sequence (dim 1 of every batch) is cut into ``world_size`` contiguous chunks of
``SEQ_LEN / world_size`` positions: rank r holds queries, keys and values of chunk r
and computes the logits and loss of chunk r only. Everything but attention is
per-position, so it needs no communication. Attention needs every earlier key, so the
ranks pass their K/V blocks around a ring (``batch_isend_irecv`` to rank r+1, from
rank r-1), one hop per step, while each rank attends to the block it holds; the
partial results merge exactly with the online softmax (log-sum-exp), as in flash
attention. The backward is a second ring pass: the K/V blocks travel again together
with their dK/dV, which each rank adds to and which arrive back at their owner after
n hops. Ring attention as picotron builds it, forward and backward written by hand as a
``torch.autograd.Function``.

Causal masking by block: for a K/V block from rank j, rank r attends fully if j < r,
causally within the block if j == r, and not at all if j > r (the block still passes
through on its way round the ring). So rank 0 computes one block and rank n-1 all n:
contiguous chunks leave the early ranks idle for much of each step. Zig-zag ordering
balances this (rank r holds chunks r and 2n-1-r of 2n; the Llama 3 paper, sec. 3.3.2,
splits sequences this way); we do not, to keep the lesson's index arithmetic simple.

Like DDP, every rank holds all parameters (they start equal: the model is seeded) and
all-reduces the gradients after backward, averaging them. Each rank's loss is the mean
over its equally many tokens, so the average is the single device's gradient of the
global-batch mean. On a CUDA device PyTorch's own
``torch.distributed.tensor.experimental.context_parallel`` shards the sequence the same
way, but it runs only on the CUDA flash / memory-efficient attention kernels; on this
CPU we build the ring ourselves.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.core import models
from dtlab.core.config import RunConfig
from dtlab.core.data import SEQ_LEN
from dtlab.core.memory import SavedActivations
from dtlab.core.registry import TierSpec
from dtlab.instrument.recorder import tagged, timed_phase
from dtlab.tiers import base
from dtlab.tiers.base import NoOptions as Options

__all__ = ["BACKWARD_TAG", "FORWARD_TAG", "Options", "Ring", "RingAttention", "SPEC", "Strategy", "chunk_forward",
           "ring_attention", "ring_hops_per_block", "validate"]

FORWARD_TAG, BACKWARD_TAG = "cp:forward", "cp:backward"
# Point-to-point tags: in backward a K/V block and a dK/dV block of the same size are in
# flight to the same peer at once, so each stream gets its own tag and they cannot swap.
_KV, _GRAD = 0, 1


def validate(cfg: RunConfig) -> None:
    if cfg.model != "charformer":
        raise ValueError(f"RunConfig.model={cfg.model!r} is invalid for tier 'cp': it runs the built-in "
                         "charformer's attention as ring attention; use model='charformer'")
    if SEQ_LEN % cfg.world_size:
        raise ValueError(f"RunConfig.world_size={cfg.world_size} is invalid for tier 'cp': the text's "
                         f"sequences of {SEQ_LEN} positions must split into world_size equal chunks")


def ring_hops_per_block(world_size: int) -> int:
    """The isends each rank issues per attention block and training step: n-1 K/V hops in forward;
    in backward n-1 K/V hops again and n dK/dV hops (the last brings them home)."""
    return 3 * world_size - 2 if world_size > 1 else 0


# -- the ring ---------------------------------------------------------------------------
class Ring:
    """Shifts a tensor one rank along the ring (to r+1, from r-1) and counts the seconds waited."""

    def __init__(self) -> None:
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.waited_s = 0.0

    def shift(self, tensor: torch.Tensor, tag: int) -> _Arrived | _InFlight:
        """Start sending ``tensor`` on; ``wait()`` on the result returns the neighbour's tensor."""
        if self.size == 1:  # the next rank is this one
            return _Arrived(tensor)
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), (self.rank + 1) % self.size, tag=tag),
               dist.P2POp(dist.irecv, received, (self.rank - 1) % self.size, tag=tag)]
        return _InFlight(dist.batch_isend_irecv(ops), received, self)


class _Arrived:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


class _InFlight:
    def __init__(self, works: list[Any], received: torch.Tensor, ring: Ring) -> None:
        self.works, self.received, self.ring = works, received, ring

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        self.ring.waited_s += time.perf_counter() - start
        return self.received


# -- attention on one block -------------------------------------------------------------
def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:  # the diagonal block: query i sees keys 0..i of it
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q to one K/V block, and each row's log-sum-exp of the scores."""
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: two partial attentions, each normalised over its own keys, as one over both."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = torch.exp(lse - new_lse).unsqueeze(-1) * out + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out
    return out, new_lse


def _block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dQ, dK, dV, from the full softmax's log-sum-exp (flash attention's backward)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    p = torch.exp(_scores(q, k, causal) - lse.unsqueeze(-1))  # the final attention weights on this block
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


# -- the autograd Function --------------------------------------------------------------
class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries to every rank's keys, the sequence split in rank order.

    Inputs (batch, heads, chunk, head_dim): rank r's chunk r of q, k and v. Every rank of
    the default process group calls it together, forward and backward.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        kv, out, lse = torch.stack([k, v]), None, None
        with tagged(FORWARD_TAG):
            for step in range(ring.size):
                owner = (ring.rank - step) % ring.size
                # Send the block on before using it: the transfer overlaps this step's compute.
                incoming = ring.shift(kv, _KV) if step < ring.size - 1 else None
                if owner <= ring.rank:  # later ranks' keys are in the future
                    block_out, block_lse = _block_forward(q, kv[0], kv[1], causal=owner == ring.rank)
                    out, lse = (block_out, block_lse) if out is None else _merge(out, lse, block_out, block_lse)
                if incoming is not None:
                    kv = incoming.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        delta = (dout * out).sum(-1)  # D = rowsum(dO * O)
        dq, kv, grads = torch.zeros_like(q), torch.stack([k, v]), None
        with tagged(BACKWARD_TAG):
            for step in range(ring.size):
                owner = (ring.rank - step) % ring.size
                incoming_kv = ring.shift(kv, _KV) if step < ring.size - 1 else None
                part = (_block_backward(q, kv[0], kv[1], dout, lse, delta, causal=owner == ring.rank)
                        if owner <= ring.rank else None)
                # The owner's dK/dV as summed so far by the ranks before this one (none yet at step 0).
                grads = torch.zeros_like(kv) if grads is None else grads.wait()
                if part is not None:
                    dq += part[0]
                    grads[0] += part[1]
                    grads[1] += part[2]
                grads = ring.shift(grads, _GRAD)  # follows its block: rank r+1 holds it next step
                if incoming_kv is not None:
                    kv = incoming_kv.wait()
            dkv = grads.wait()  # n hops: this rank's own block, with every rank's share
        return dq, dkv[0], dkv[1], None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, is_causal=True)`` of the whole sequence, where each rank
    passes its contiguous chunk (rank order) of q, k and v and gets its chunk of the output."""
    return RingAttention.apply(q, k, v, ring if ring is not None else Ring())


# -- the model's forward on one chunk -----------------------------------------------------
def _attention(attn: models.CausalSelfAttention, x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """``CausalSelfAttention.forward`` with ring attention in place of SDPA."""
    b, t, _ = x.shape
    q, k, v = (proj(x).view(b, t, attn.heads, -1).transpose(1, 2) for proj in (attn.q, attn.k, attn.v))
    y = ring_attention(q, k, v, ring)
    return attn.out(y.transpose(1, 2).reshape(b, t, -1))


def chunk_forward(model: models.CharFormer, x: torch.Tensor, offset: int, ring: Ring) -> torch.Tensor:
    """``CharFormer.forward`` of one chunk of the sequence that starts at position ``offset``."""
    h = model.tok(x) + model.pos(torch.arange(offset, offset + x.shape[1], device=x.device))
    for block in model.blocks:
        h = h + _attention(block.attn, block.ln1(h), ring)
        h = h + block.mlp(block.ln2(h))
    return model.head(model.ln(h))


# -- the strategy -----------------------------------------------------------------------
class Strategy(base.Strategy):
    custom_step = True

    def __init__(self, cfg: RunConfig, info: Any) -> None:
        super().__init__(cfg, info)
        self.data_rank, self.data_world = 0, 1  # every rank reads the whole global batch, and cuts its chunk
        self.chunk = SEQ_LEN // info.world_size
        self.times = {"forward": 0.0, "backward": 0.0, "forward_wait": 0.0, "backward_wait": 0.0}
        # What the first step's forward saves for backward (the loop cannot see inside run_step)
        self.activations: int | None = None

    def run_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        lo = self.info.rank * self.chunk
        x, y = x[:, lo:lo + self.chunk], y[:, lo:lo + self.chunk]
        ring = Ring()
        start = time.perf_counter()
        counting = SavedActivations() if self.activations is None else contextlib.nullcontext()
        with timed_phase("cp_forward"), counting as acts:
            loss = models.loss(chunk_forward(model, x, lo, ring), y)
        if acts is not None:  # counted as the loop counts other tiers: parameters left out
            self.activations = acts.bytes(exclude=model.parameters())
        middle, forward_wait = time.perf_counter(), ring.waited_s
        with timed_phase("cp_backward"):
            loss.backward()
        end = time.perf_counter()
        self.times = {"forward": middle - start, "backward": end - middle, "forward_wait": forward_wait,
                      "backward_wait": ring.waited_s - forward_wait}
        reported = loss.detach().clone()
        dist.all_reduce(reported)  # 4 bytes, so every rank reports the global mean, not its chunk's
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
        """Compute of the forward and backward passes; waiting on the ring (and the loss's
        all-reduce, and the rest of the step) counts as communication."""
        t = self.times
        forward, backward = t["forward"] - t["forward_wait"], t["backward"] - t["backward_wait"]
        return {"forward": forward, "backward": backward, "comm": max(0.0, seconds - forward - backward)}

    def describe(self) -> dict[str, Any]:
        return {"sequence_chunk": self.chunk, "ring_steps": self.info.world_size,
                "isends_per_block": ring_hops_per_block(self.info.world_size)}


SPEC = TierSpec(name="cp", summary="context parallel: ring attention over the sequence",
                options=Options, validate=validate, strategy=Strategy,
                autocast=False, activation_checkpointing=False, models=("charformer",))
