"""Owned(rank): the whole parameter lives on one rank; the others hold an empty piece."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .contract import Placement


def _empty_shape(shape: torch.Size) -> torch.Size:
    """An empty piece keeps the parameter's rank (a (0, n) matrix), so code that
    reads `.ndim` (Muon, weight-decay filters) sees the same on every rank."""
    return torch.Size((0, *shape[1:])) if len(shape) else torch.Size((0,))


@dataclass(frozen=True)
class Owned(Placement):
    """The whole parameter on rank `rank`; `None` lets flex_shard pick the owner
    so that per-rank bytes are balanced (largest parameter first onto the
    least-loaded rank)."""

    rank: Optional[int] = None

    def __post_init__(self) -> None:
        if self.rank is None:
            return
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise TypeError(f"Owned(rank={self.rank!r}): rank must be an int or None")
        if self.rank < 0:
            raise ValueError(f"Owned(rank={self.rank}): rank must be >= 0 "
                             "(or None to let flex_shard balance owners)")

    def check(self, shape: torch.Size, world_size: int) -> None:
        if self.rank is not None and self.rank >= world_size:
            raise ValueError(f"Owned(rank={self.rank}) is outside the world of {world_size} "
                             f"rank(s); use a rank in [0, {world_size - 1}] or Owned() to "
                             "let flex_shard pick the owner")

    def bind(self, shape, itemsize, world_size, rank_bytes) -> "Owned":
        if self.rank is not None:
            return self
        return Owned(min(range(world_size), key=lambda r: (rank_bytes[r], r)))

    def local_shape(self, shape, rank, world_size) -> torch.Size:
        return torch.Size(shape) if rank == self._owner() else _empty_shape(shape)

    def shard(self, full, rank, world_size) -> torch.Tensor:
        if rank == self._owner():
            return full
        return full.narrow(0, 0, 0) if full.dim() else full.reshape(1)[:0]  # views, no copy

    def unshard(self, pieces: Sequence[torch.Tensor], shape) -> torch.Tensor:
        return pieces[self._owner()].reshape(shape).clone()

    def rank_major(self, shape) -> bool:
        return True

    def _owner(self) -> int:
        if self.rank is None:
            raise AssertionError("Owned() must be bound (bind picks the owner) before use")
        return self.rank
