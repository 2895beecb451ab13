"""RaggedShard(dims, units): contiguous blocks of rows, sized in proportion to units."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .contract import Placement


def _check_units(units: Sequence[int], where: str) -> None:
    for u in units:
        if isinstance(u, bool) or not isinstance(u, int):
            raise TypeError(f"{where}: units must be ints, got {u!r}")
    if any(u < 0 for u in units):
        raise ValueError(f"{where}: units must be >= 0, got {tuple(units)}; "
                         "give each rank a non-negative share (0 = an empty shard)")
    if units and sum(units) == 0:
        raise ValueError(f"{where}: units are all 0; give at least one rank a "
                         "positive share")


def shard_sizes(n: int, units: Optional[Sequence[int]] = None, *,
                world_size: Optional[int] = None) -> list:
    """Per-rank sizes of `n` rows split in proportion to `units`, rounded by
    largest remainder (ties to the lower rank) so they sum to exactly `n`.

    `units=None` splits evenly over `world_size` ranks (default: the current
    process group's size): sizes differ by at most one, the first ranks
    holding the extra rows. A rank with 0 units gets 0 rows.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"shard_sizes: n must be an int >= 0, got {n!r}")
    if units is None:
        world_size = _world_size(world_size)
        return [n // world_size + (r < n % world_size) for r in range(world_size)]
    units = tuple(units)
    if not units:
        raise ValueError("shard_sizes: units is empty; give one share per rank")
    _check_units(units, "shard_sizes")
    if world_size is not None and world_size != len(units):
        raise ValueError(f"shard_sizes: {len(units)} units for world_size={world_size}; "
                         "give one unit per rank")
    total = sum(units)
    sizes = [n * u // total for u in units]
    order = sorted(range(len(units)), key=lambda r: (-(n * units[r] % total), r))
    for r in order[: n - sum(sizes)]:
        sizes[r] += 1
    return sizes


def _world_size(world_size: Optional[int]) -> int:
    if world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("shard_sizes(n, units=None) needs world_size= when no "
                             "process group is initialized")
        return dist.get_world_size()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"shard_sizes: world_size must be an int >= 1, got {world_size!r}")
    return world_size


@dataclass(frozen=True)
class RaggedShard(Placement):
    """The leading `dims` (a prefix such as (0,) or (0, 1)) flattened into rows;
    rank r holds one contiguous block of rows, `shard_sizes(rows, units)[r]` long.

    `units=None` is balanced: sizes differ by at most one row, and flex_shard
    gives the extra rows to the ranks holding the fewest bytes of the bucket.
    """

    dims: tuple = (0,)
    units: Optional[tuple] = None

    def __post_init__(self) -> None:
        dims = tuple(self.dims) if isinstance(self.dims, (tuple, list)) else self.dims
        if (not isinstance(dims, tuple) or not dims
                or any(isinstance(d, bool) or not isinstance(d, int) for d in dims)):
            raise TypeError(f"RaggedShard(dims={self.dims!r}): dims must be a non-empty "
                            "tuple of ints such as (0,) or (0, 1)")
        if dims != tuple(range(len(dims))):
            raise ValueError(f"RaggedShard(dims={dims}): dims must be a prefix of the "
                             f"tensor's dims, i.e. {tuple(range(len(dims)))}; move the dims "
                             "to split to the front (or use Shard(dim) for one inner dim)")
        object.__setattr__(self, "dims", dims)
        if self.units is not None:
            if not isinstance(self.units, (tuple, list)) or not self.units:
                raise TypeError(f"RaggedShard(units={self.units!r}): units must be None or a "
                                "non-empty sequence of ints, one per rank")
            _check_units(self.units, f"RaggedShard(units={tuple(self.units)})")
            object.__setattr__(self, "units", tuple(self.units))

    def check(self, shape: torch.Size, world_size: int) -> None:
        if len(self.dims) > len(shape):
            hint = ("a 0-dim tensor has no rows; use Owned() for it" if not len(shape)
                    else f"use dims={tuple(range(len(shape)))} or fewer")
            raise ValueError(f"RaggedShard(dims={self.dims}) cannot split rows of shape "
                             f"{tuple(shape)}: it has only {len(shape)} dim(s); {hint}")
        if self.units is not None and len(self.units) != world_size:
            raise ValueError(f"RaggedShard(units={self.units}) has {len(self.units)} units "
                             f"for a world of {world_size} ranks; give one unit per rank")

    def bind(self, shape, itemsize, world_size, rank_bytes) -> "RaggedShard":
        if self.units is not None:
            return self
        rows = self._rows(shape)
        extra = rows % world_size
        lightest = sorted(range(world_size), key=lambda r: (rank_bytes[r], r))[:extra]
        sizes = tuple(rows // world_size + (r in lightest) for r in range(world_size))
        if sum(sizes) == 0:  # no rows at all: any positive units say "empty everywhere"
            sizes = (1,) * world_size
        return RaggedShard(self.dims, sizes)

    def sizes(self, shape: torch.Size, world_size: int) -> list:
        """Rows held by each rank."""
        return shard_sizes(self._rows(shape), self.units, world_size=world_size)

    def local_shape(self, shape, rank, world_size) -> torch.Size:
        rows = self.sizes(shape, world_size)[rank]
        return torch.Size((rows, *shape[len(self.dims):]))

    def shard(self, full, rank, world_size) -> torch.Tensor:
        sizes = self.sizes(full.shape, world_size)
        return self._as_rows(full).narrow(0, sum(sizes[:rank]), sizes[rank])

    def unshard(self, pieces: Sequence[torch.Tensor], shape) -> torch.Tensor:
        return torch.cat(list(pieces), dim=0).reshape(shape)

    def rank_major(self, shape) -> bool:
        return True

    def _rows(self, shape: torch.Size) -> int:
        return math.prod(shape[: len(self.dims)])

    def _as_rows(self, full: torch.Tensor) -> torch.Tensor:
        return full.reshape(self._rows(full.shape), *full.shape[len(self.dims):])
