"""Muon on whole matrices, AdamW on shards, with flex_shard.

The blocks' weight matrices go in Owned buckets: each lives whole on one rank
(owners balanced by bytes), so that rank runs torch.optim.Muon on it with no
collective in the optimizer step. Norms, biases and embeddings stay balanced
RaggedShard rows for AdamW. Both kinds share each bucket's one all-gather and
one reduce-scatter.

    torchrun --standalone --nproc-per-node 2 examples/muon.py
    python examples/muon.py          # one rank
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flexshard from a checkout

import flexshard as fs  # noqa: E402
from flexshard.optim import split_for_muon  # noqa: E402


class Net(nn.Module):
    """A small residual MLP: one bucket per block, plus a root bucket."""

    def __init__(self, dim: int = 24, hidden: int = 40, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(),
                          nn.Linear(hidden, dim))
            for _ in range(depth))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def is_matrix(fqn: str, shape: torch.Size) -> bool:
    """Muon takes the hidden weight matrices; input and output layers stay on AdamW."""
    return fqn.startswith("blocks.") and len(shape) == 2


def placement(fqn: str, param: torch.Tensor) -> fs.Placement:
    return fs.Owned() if is_matrix(fqn, param.shape) else fs.RaggedShard()


class Optimizers:
    """Steps several optimizers as one."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()


def make_optimizer(model: nn.Module, lr: float = 1e-2) -> Optimizers:
    """Muon on the matrices (each whole on the rank that owns it, empty on the
    others), AdamW on every other shard."""
    split = split_for_muon(model, is_matrix)
    opts = [torch.optim.AdamW(split.others, lr=lr)]
    if split.matrices:  # a model may have no matrix
        opts.append(torch.optim.Muon(split.matrices, lr=lr))
    return Optimizers(*opts)


def data(step: int, rank: int, size: int = 16) -> tuple:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(size, 5, generator=g)
    return x, x.sin().sum(dim=1, keepdim=True)


def train(steps: int = 30) -> list:
    """Mean loss per step."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = fs.flex_shard(Net(), placement=placement)
    opt = make_optimizer(model)
    losses = []
    for step in range(steps):
        x, y = data(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def main() -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    try:
        losses = train()
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"Muon + AdamW: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        if dist.is_initialized():
            dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,  # --help, and no silent run on a typo
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
