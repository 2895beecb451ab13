"""The transformer the benchmark trains: one GPT shape with even sizes, one with odd."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelShape(NamedTuple):
    """Sizes of one benchmark transformer and of its batches."""

    vocab: int
    dim: int
    heads: int
    hidden: int
    layers: int
    seq: int
    batch: int


# "odd" divides by neither 2 nor 4 where it matters (rows of every matrix and
# vector), so Shard(0) pads at every world size; "even" divides by 4 everywhere.
SHAPES = {
    "odd": ModelShape(vocab=251, dim=99, heads=3, hidden=389, layers=4, seq=63, batch=8),
    "even": ModelShape(vocab=256, dim=96, heads=3, hidden=384, layers=4, seq=64, batch=8),
}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
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


class BenchGPT(nn.Module):
    """A GPT: token and position embeddings, `layers` blocks in a ModuleList, a head."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab, shape.dim)
        self.pos = nn.Parameter(torch.randn(shape.seq, shape.dim) * 0.02)
        self.layers = nn.ModuleList(Block(shape.dim, shape.heads, shape.hidden)
                                    for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model(name: str, seed: int = 0) -> BenchGPT:
    """The `name` shape ("odd" or "even"), initialised from `seed` (same on every rank)."""
    torch.manual_seed(seed)
    return BenchGPT(SHAPES[name])


def batch(name: str, step: int, rank: int, device) -> tuple:
    """Deterministic (inputs, targets) for one rank at one step."""
    shape = SHAPES[name]
    g = torch.Generator().manual_seed(100_003 * step + rank)
    data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
