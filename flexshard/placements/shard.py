"""Shard(dim): torch.chunk semantics along one dim, as DTensor and FSDP2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .contract import Placement


def chunk_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, length) of torch.chunk(n rows, world_size)[rank]; empty past the end."""
    chunk = -(-n // world_size) if n else 0
    start = min(n, rank * chunk)
    return start, min(n, start + chunk) - start


@dataclass(frozen=True)
class Shard(Placement):
    """Even chunks along `dim` (torch.chunk): trailing ranks may hold less or nothing."""

    dim: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard(dim={self.dim!r}): dim must be an int")

    def check(self, shape: torch.Size, world_size: int) -> None:
        if not -len(shape) <= self.dim < len(shape):
            hint = (f"use a dim in [{-len(shape)}, {len(shape) - 1}]" if len(shape)
                    else "a 0-dim tensor cannot be sharded; use Owned() for it")
            raise ValueError(f"Shard(dim={self.dim}) is out of range for shape "
                             f"{tuple(shape)}; {hint}")

    def bind(self, shape, itemsize, world_size, rank_bytes) -> "Shard":
        return Shard(self.dim % len(shape))

    def local_shape(self, shape, rank, world_size) -> torch.Size:
        dim = self.dim % len(shape)
        _, length = chunk_bounds(shape[dim], rank, world_size)
        return torch.Size((*shape[:dim], length, *shape[dim + 1:]))

    def shard(self, full, rank, world_size) -> torch.Tensor:
        dim = self.dim % full.dim()
        start, length = chunk_bounds(full.shape[dim], rank, world_size)
        return full.narrow(dim, start, length)

    def unshard(self, pieces: Sequence[torch.Tensor], shape) -> torch.Tensor:
        return torch.cat(list(pieces), dim=self.dim % len(shape))

    def rank_major(self, shape) -> bool:
        return all(s == 1 for s in shape[: self.dim % len(shape)])
