"""The transformers the benchmark trains: an even GPT, an odd GPT and a Llama.

The transformers the benchmark trains: a GPT with even sizes, one with odd
sizes, and a Llama-shaped model (RMSNorm, SwiGLU MLP, rotary positions)."""

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
    # Llama's proportions at a size two shared CPU cores can train: hidden 384,
    # 6 heads of 64, SwiGLU width 1024, sequence 256 (7.9 M params); one sequence per
    # rank, because bf16 matmuls on these CPUs take 8x the fp32 time.
    "llama": ModelShape(vocab=1024, dim=384, heads=6, hidden=1024, layers=4, seq=256, batch=1),
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


def _rotary(seq: int, head_dim: int) -> tuple:
    """cos and sin of the rotary angles, (seq, head_dim / 2) each."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (first half, second half) of `x` (b, heads, t, d)."""
    a, b = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-5)
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos[:t], sin[:t]), apply_rotary(k, cos[:t], sin[:t])
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class BenchLlama(nn.Module):
    """A Llama: token embedding, `layers` blocks in a ModuleList, RMSNorm, an untied head."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab, shape.dim)
        self.layers = nn.ModuleList(LlamaBlock(shape.dim, shape.heads, shape.hidden)
                                    for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.dim, eps=1e-5)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False)
        cos, sin = _rotary(shape.seq, shape.dim // shape.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.head(self.norm(x))


ARCHITECTURES = {"odd": BenchGPT, "even": BenchGPT, "llama": BenchLlama}


def build_model(name: str, seed: int = 0) -> nn.Module:
    """The `name` model ("odd", "even" or "llama"), initialised from `seed`
    (same on every rank)."""
    torch.manual_seed(seed)
    return ARCHITECTURES[name](SHAPES[name])


def batch(name: str, step: int, rank: int, device) -> tuple:
    """Deterministic (inputs, targets) for one rank at one step."""
    shape = SHAPES[name]
    g = torch.Generator().manual_seed(100_003 * step + rank)
    data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    return data[:, :-1].to(device), data[:, 1:].to(device)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
