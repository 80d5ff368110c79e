"""The charformer: a tiny decoder-only transformer over characters, and its blocks (``moe`` builds on them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "CausalSelfAttention", "CharFormer"]


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width)
        # No bias on the key projection: softmax is invariant to it, so its true
        # gradient is zero, and Adam would turn rounding noise there into
        # full-size updates that differ between tiers.
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1, not width // heads: under tensor parallelism a rank holds only its heads' columns
        q, k, v = (proj(x).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharFormer(nn.Module):
    """A tiny decoder-only transformer over characters."""

    def __init__(self, vocab: int, seq_len: int, width: int = 64, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"model_size={width} must be divisible by the {heads} attention heads")
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq_len, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))
