"""A placement of your own: rows in whole blocks, written against fs.Placement alone.

Some tensors must not be cut inside a block of rows (a quantization scale
per 4 rows, a block-sparse layout, a fused weight whose halves belong
together). `BlockRows(block)` keeps every block of `block` rows on one rank and
balances whole blocks across ranks (the last block may be short). Because its
pieces are contiguous row blocks in rank order it is `rank_major`, so it shares
the bucket's one all-gather and one reduce-scatter with every other placement.

    torchrun --standalone --nproc-per-node 2 examples/custom_placement.py
    python examples/custom_placement.py          # one rank
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flexshard from a checkout

import flexshard as fs  # noqa: E402


@dataclass(frozen=True)
class BlockRows(fs.Placement):
    """Dim 0 in blocks of `block` rows, whole blocks balanced across ranks."""

    block: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"BlockRows(block={self.block!r}): block must be an int >= 1")

    def check(self, shape: torch.Size, world_size: int) -> None:
        if len(shape) == 0:
            raise ValueError("BlockRows cannot split a 0-dim tensor; use fs.Owned() for it")

    def bind(self, shape, itemsize, world_size, rank_bytes) -> "BlockRows":
        return self  # no free choice: the split depends on the shape alone

    def rows(self, shape: torch.Size, world_size: int) -> list:
        """(start, length) of each rank's rows."""
        n = shape[0]
        blocks = fs.shard_sizes(-(-n // self.block), world_size=world_size)
        out, start = [], 0
        for count in blocks:
            end = min(n, start + count * self.block)
            out.append((start, end - start))
            start = end
        return out

    def local_shape(self, shape, rank, world_size) -> torch.Size:
        return torch.Size((self.rows(shape, world_size)[rank][1], *shape[1:]))

    def shard(self, full, rank, world_size) -> torch.Tensor:
        start, length = self.rows(full.shape, world_size)[rank]
        return full.narrow(0, start, length)

    def unshard(self, pieces: Sequence[torch.Tensor], shape) -> torch.Tensor:
        return torch.cat(list(pieces), dim=0)

    def rank_major(self, shape) -> bool:
        return True  # row blocks in rank order, flattened, are the tensor flattened


class Net(nn.Module):
    """A small residual MLP: one bucket per block, plus a root bucket."""

    def __init__(self, dim: int = 18, hidden: int = 37, depth: int = 2) -> None:
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


def data(step: int, rank: int, size: int = 16) -> tuple:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(size, 5, generator=g)
    return x, x.sin().sum(dim=1, keepdim=True)


def train(steps: int = 20, block: int = 4) -> list:
    """Train Net with BlockRows on every parameter; returns the mean loss per step."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = fs.flex_shard(Net(), placement=BlockRows(block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
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
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"BlockRows(4): loss {losses[0]:.4f} -> {losses[-1]:.4f}")
            rows = BlockRows(4).rows(torch.Size((37,)), world)
            print(f"(start, rows) per rank of a 37-row weight: {rows}")
        if dist.is_initialized():
            dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,  # --help, and no silent run on a typo
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
