"""Which positions of the sequence each rank of context parallelism holds: contiguous or zig-zag chunks.

``contiguous``: the sequence is cut into n chunks and rank r holds chunk r. Under a causal
mask the ranks' work is unequal: rank r's queries see r + 1 chunks of keys, so rank n-1
computes n times rank 0's attention. ``zigzag``: the sequence is cut into 2n chunks and rank
r holds chunks r and 2n-1-r, an early one and a late one, so every rank's queries see
2n + 1 chunks of keys (the Llama 3 paper, sec. 3.3.2; torchtitan's load balancer for causal
context parallelism; ring-flash-attention's ``zigzag_ring``). A rank keeps its chunks in
increasing position order, so within one rank a causal mask on its own positions is the
plain lower triangle.
"""

from __future__ import annotations

import torch

__all__ = ["BACKWARD_TAG", "BALANCES", "FORWARD_TAG", "chunk_count", "chunks_of", "layout", "local_batch",
           "natural_order", "positions"]

BALANCES = ("contiguous", "zigzag")
# The recorder's tags on the attention's communication, either method's: which pass of the step sent it.
FORWARD_TAG, BACKWARD_TAG = "cp:forward", "cp:backward"


def chunk_count(n: int, balance: str) -> int:
    """How many equal chunks the sequence is cut into for ``n`` ranks."""
    return 2 * n if balance == "zigzag" else n


def chunks_of(rank: int, n: int, balance: str) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in increasing position order."""
    return (rank, 2 * n - 1 - rank) if balance == "zigzag" else (rank,)


def layout(n: int, balance: str) -> tuple[tuple[int, ...], ...]:
    """Every rank's chunks, in rank order (what a ring needs to know of the block it receives)."""
    return tuple(chunks_of(r, n, balance) for r in range(n))


def positions(rank: int, n: int, balance: str, seq_len: int) -> list[int]:
    """The positions rank ``rank`` holds, in the order it holds them."""
    c = seq_len // chunk_count(n, balance)
    return [p for chunk in chunks_of(rank, n, balance) for p in range(chunk * c, (chunk + 1) * c)]


def local_batch(x: torch.Tensor, rank: int, n: int, balance: str) -> torch.Tensor:
    """Rank ``rank``'s positions of a batch (dim 1: the sequence). Contiguous: a view of the batch."""
    c = x.shape[1] // chunk_count(n, balance)
    parts = [x[:, chunk * c:(chunk + 1) * c] for chunk in chunks_of(rank, n, balance)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def natural_order(n: int, balance: str, seq_len: int) -> list[int] | None:
    """For the whole sequence put together in rank order (rank 0's positions, then rank 1's, ...), the index
    that sorts it into position order; None when it is in position order already (contiguous)."""
    if balance != "zigzag":
        return None
    held = [p for r in range(n) for p in positions(r, n, balance, seq_len)]
    return sorted(range(seq_len), key=held.__getitem__)
