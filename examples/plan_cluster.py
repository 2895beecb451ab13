"""Size a job before you have the machines: flexshard's plan of Llama-3 8B and
70B on (replicate, shard) meshes of 16 x 8 and 128 x 8 GPUs, per placement.

The models are built on the meta device (no memory) and planned with
`fs.describe(model, mesh_shape=(R, S), ...)`, which needs no process group:

    python examples/plan_cluster.py                # the README's table (markdown)
    python examples/plan_cluster.py --summary      # each plan's totals, in words

Mixed precision as usual for these models: fp32 master weights, bf16 on the
wire and in compute, gradients reduced in fp32; reshard after forward.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import flexshard as fs
from flexshard.planning.report import human


class LlamaShape(NamedTuple):
    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int  # the feed-forward's intermediate size
    vocab: int


# Meta's published Llama-3 configurations (params.json / config.json).
LLAMA3 = {
    "8B": LlamaShape(dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336, vocab=128256),
    "70B": LlamaShape(dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672, vocab=128256),
}
MESHES = ((16, 8), (128, 8))
PLACEMENTS = {"Shard(0)": fs.Shard(0), "Owned": fs.Owned(), "RaggedShard": fs.RaggedShard()}
MP = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Attention(nn.Module):
    """Grouped-query attention (rotary embeddings left out: they hold no parameters)."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.dim // s.heads
        self.wq = nn.Linear(s.dim, s.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * self.head_dim, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = (w(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
                for w in (self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(s.dim, s.hidden, bias=False)
        self.w2 = nn.Linear(s.hidden, s.dim, bias=False)
        self.w3 = nn.Linear(s.dim, s.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(s.dim, eps=1e-5)
        self.attention = Attention(s)
        self.ffn_norm = nn.RMSNorm(s.dim, eps=1e-5)
        self.feed_forward = FeedForward(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama-3's parameters under torchtitan's names (untied output projection)."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.dim, eps=1e-5)
        self.output = nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def meta_llama(name: str) -> Llama:
    """The model on the meta device: shapes and dtypes only, no memory."""
    with torch.device("meta"):
        return Llama(LLAMA3[name])


def plan(model: nn.Module, mesh_shape: tuple, placement) -> fs.ShardingPlan:
    return fs.describe(model, mesh_shape=mesh_shape, placement=placement, mp_policy=MP,
                       reshard_after_forward=True)


def _span(pair: tuple) -> str:
    low, high = pair
    return human(low) if low == high else f"{human(low)} .. {human(high)}"


def table_row(name: str, mesh_shape: tuple, placement: str, p: fs.ShardingPlan) -> str:
    replicas, shards = mesh_shape
    # A ring moves (S-1)/S of an all-gather's or reduce-scatter's buffer through
    # each rank's link, and 2(R-1)/R of an all-reduce's.
    shard_sent = p.shard_wire_bytes * (shards - 1) // shards
    replicate_sent = p.replicate_wire_bytes * 2 * (replicas - 1) // replicas
    cells = (f"Llama-3 {name}", f"({replicas}, {shards})", placement, _span(p.param_bytes),
             _span(p.grad_bytes), _span(p.adamw_bytes), human(p.shard_wire_bytes),
             human(shard_sent), human(p.replicate_wire_bytes), human(replicate_sent))
    return "| " + " | ".join(cells) + " |"


HEADER = ("| model | mesh (R, S) | placement | params/rank | grads/rank | AdamW/rank "
          "| shard-dim wire/step | sent/rank (ring) | replicate-dim wire/step | sent/rank (ring) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def markdown_table(models=tuple(LLAMA3), meshes=MESHES, placements=tuple(PLACEMENTS)) -> str:
    """One row per (model, mesh, placement)."""
    rows = [HEADER]
    for name in models:
        model = meta_llama(name)
        for mesh_shape in meshes:
            for placement in placements:
                rows.append(table_row(name, mesh_shape, placement,
                                      plan(model, mesh_shape, PLACEMENTS[placement])))
    return "\n".join(rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true",
                        help="print each plan's totals instead of the markdown table")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.summary:
        print(markdown_table())
        return
    for name in LLAMA3:
        model = meta_llama(name)
        params = sum(p.numel() for p in model.parameters())
        for mesh_shape in MESHES:
            for placement, value in PLACEMENTS.items():
                print(f"Llama-3 {name} ({params:,} params), {placement}:")
                print(plan(model, mesh_shape, value).summary(), end="\n\n")


if __name__ == "__main__":
    main()
