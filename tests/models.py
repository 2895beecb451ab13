"""Small models the tests train: a GPT-style transformer with awkward sizes."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has a zero gradient: noise under AdamW
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    """Sizes chosen so nothing divides evenly by 2, 3 or 4 ranks."""

    def __init__(self, vocab: int = 37, dim: int = 30, heads: int = 3, hidden: int = 50,
                 layers: int = 2, seq: int = 11, tied: bool = False,
                 logit_scale: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.tok.weight
        # a 0-dim param, as CLIP's temperature
        self.logit_scale = nn.Parameter(torch.tensor(0.3)) if logit_scale else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return logits if self.logit_scale is None else logits * self.logit_scale.exp()


def batch(step: int, rank: int, size: int = 4, seq: int = 11, vocab: int = 37):
    """Deterministic (inputs, targets) for one rank at one step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    data = torch.randint(0, vocab, (size, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
