"""Collectives that send quantised bytes (``dtlab.core.quantise``): FSDP2's all-gather and reduce-scatter, DDP's
all-reduce.

gloo (and NCCL) can move int8 or fp8 bytes but cannot add them, and adding two int8 codes with their own
scales would not mean anything anyway. So a quantised *reduction* is made of a collective that only moves
bytes, then a local sum in float32, as ZeRO++'s quantised gradients (qgZ) do:

* reduce-scatter: each rank encodes the chunk meant for each other rank, an ``all_to_all`` hands every rank
  all ranks' encodings of its own chunk, and it decodes and sums them (in rank order) in float32;
* all-reduce (DDP's comm hook): each rank encodes its bucket, an ``all_gather`` hands every rank everyone's
  encoding, and each rank decodes and sums all of them in rank order: every rank computes the same sum;
* all-gather (parameters, ZeRO++'s qwZ): each rank encodes its shard; everyone decodes everyone's, its own
  included, so every rank computes with the same (dequantised) parameters.

A rank's own contribution goes through the code too: what the ranks sum or compute with is identical.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects (dist.GradBucket).
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtlab.core.quantise import decode, encode, encoded_bytes

__all__ = ["QuantState", "quantised_all_gather", "quantised_allreduce_hook", "quantised_reduce_scatter"]


def quantised_all_gather(output: torch.Tensor, shard: torch.Tensor, group: Any, dtype: str, block: int) -> None:
    """``output`` = every rank's ``shard`` in rank order, sent as ``dtype`` codes (decoded into output's dtype)."""
    world = dist.get_world_size(group)
    sent = encode(shard, dtype, block)
    received = torch.empty(world * sent.numel(), dtype=torch.uint8, device=shard.device)
    dist.all_gather_single(received, sent, group=group)
    numel = shard.numel()
    for r, piece in enumerate(received.view(world, -1)):
        output[r * numel:(r + 1) * numel] = decode(piece, numel, dtype, block, output.dtype)


def quantised_reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: Any, dtype: str, block: int,
                             average: bool) -> None:
    """``output`` = the sum (``average``: the mean) over ranks of chunk ``rank`` of their ``full``, each chunk
    sent as ``dtype`` codes and summed in float32 here."""
    world = dist.get_world_size(group)
    numel = output.numel()
    sent = torch.cat([encode(chunk, dtype, block) for chunk in full.view(world, numel)])
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    total = torch.zeros(numel, dtype=torch.float32, device=output.device)
    for piece in received.view(world, -1):
        total += decode(piece, numel, dtype, block)
    output.copy_(total / world if average else total)


class QuantState:
    """What the DDP comm hook needs: the code, the block, and the group (None: the default group)."""

    def __init__(self, dtype: str, block: int, group: Any = None) -> None:
        self.dtype, self.block, self.group = dtype, block, group

    def bytes_per_bucket(self, numel: int) -> int:
        return encoded_bytes(numel, self.dtype, self.block)


def quantised_allreduce_hook(state: QuantState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients averaged over ranks, each rank's sent once as ``state.dtype`` codes.

    torch's fp16 and bf16 hooks cast and all-reduce, which needs a backend that adds that dtype (gloo adds no
    bf16); this one gathers codes and adds their decoded values in float32, so it runs on gloo in any code.
    """
    flat = bucket.buffer()
    world = dist.get_world_size(state.group)
    sent = encode(flat, state.dtype, state.block)
    received = torch.empty(world * sent.numel(), dtype=torch.uint8, device=flat.device)
    work = dist.all_gather_single(received, sent, group=state.group, async_op=True)

    def decode_and_average(_: Any) -> torch.Tensor:
        total = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        for piece in received.view(world, -1):
            total += decode(piece, flat.numel(), state.dtype, state.block)
        flat.copy_(total / world)
        return flat

    return work.get_future().then(decode_and_average)


def hook_for(dtype: str, block: int) -> "tuple[QuantState, Callable[[QuantState, Any], Any]]":
    """The (state, hook) pair DDP registers for a quantised ``comm_dtype``."""
    return QuantState(dtype, block), quantised_allreduce_hook
