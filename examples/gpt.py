"""The training example's model and data: a small GPT over bytes of a shipped text.

Nothing here knows about flexshard: the same model trains unsharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
VOCAB = 256  # byte-level: every byte is a token, nothing to download or train


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the example model (defaults: about 0.8 M parameters)."""

    vocab: int = VOCAB
    seq: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 4
    hidden: int = 512

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"GPTConfig: dim={self.dim} must divide by heads={self.heads}")


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.hidden)
        self.down = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token and position embeddings, a stack of blocks, a final norm and an LM head."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        with torch.no_grad():
            for block in self.layers:  # GPT-2's scaled init of residual projections
                for lin in (block.proj, block.down):
                    lin.weight.mul_(1 / math.sqrt(2 * cfg.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (in fp32 whatever the logits' dtype)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def load_text(paths: Sequence[Path] = ()) -> torch.Tensor:
    """The shipped texts (data/*.txt, sorted) as one uint8 tensor of bytes."""
    paths = list(paths) or sorted(DATA_DIR.glob("*.txt"))
    if not paths:
        raise FileNotFoundError(f"no .txt files in {DATA_DIR}; the example trains on the "
                                "texts shipped in data/")
    data = b"\n\n".join(Path(p).read_bytes() for p in paths)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def batch(data: torch.Tensor, step: int, rank: int, size: int, seq: int, seed: int = 0):
    """Deterministic (inputs, targets) windows for one rank at one step.

    Depends only on (seed, step, rank), so a resumed run sees the same batches
    as an uninterrupted one without saving any data-loader state.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, len(data) - seq - 1, (size,), generator=g)
    rows = torch.stack([data[s: s + seq + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def decode(tokens: Sequence[int]) -> str:
    """Bytes back to text (invalid UTF-8 replaced)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
