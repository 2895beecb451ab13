"""Pure planning of a bucket's bytes: where each rank's piece of each parameter lives.

No process group is needed here: every rank computes the same plan from the
same inputs. A bucket has up to three layouts over the same slots: storage
(original dtypes), gather (param_dtype on the wire) and reduce (one reduce
dtype). Each rank owns one segment of `segment_bytes`; the gathered buffer is
the world's segments back to back (rank-major).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from .placements.contract import Placement


class SlotPlan(NamedTuple):
    """One parameter of a bucket, with its placement bound."""

    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    placement: Placement
    local_shapes: tuple  # torch.Size per rank


class Region(NamedTuple):
    """Where one slot's pieces sit in a layout, per rank."""

    dtype: torch.dtype
    offsets: tuple  # byte offset of rank r's piece inside rank r's segment
    nbytes: tuple  # byte size of rank r's piece


class BucketLayout(NamedTuple):
    """The byte plan of one buffer kind of a bucket."""

    regions: tuple
    segment_bytes: int
    world_size: int

    def piece_start(self, slot: int, rank: int) -> int:
        """Byte offset of `rank`'s piece of `slot` in the gathered buffer."""
        return rank * self.segment_bytes + self.regions[slot].offsets[rank]

    def gathered_range(self, slot: int) -> Optional[tuple]:
        """(start, end) when the slot's pieces are back to back in the gathered
        buffer, so the parameter is a view of it; None when it needs a copy."""
        ranks = [r for r in range(self.world_size) if self.regions[slot].nbytes[r]]
        if not ranks:
            return (0, 0)
        start = self.piece_start(slot, ranks[0])
        end = start
        for r in ranks:
            if self.piece_start(slot, r) != end:
                return None
            end += self.regions[slot].nbytes[r]
        return (start, end)

    @property
    def ideal_bytes(self) -> int:
        """Bytes that must move: the sum of every rank's pieces."""
        return sum(sum(reg.nbytes) for reg in self.regions)

    @property
    def wire_bytes(self) -> int:
        """Bytes a rank-major collective over this layout moves (padding included)."""
        return self.segment_bytes * self.world_size


def bind_placements(entries: Sequence[tuple], world_size: int) -> list:
    """Bind each (shape, itemsize, placement) entry, largest first, balancing
    bytes across ranks. Returns the bound placements in input order."""
    order = sorted(range(len(entries)),
                   key=lambda i: -math.prod(entries[i][0]) * entries[i][1])
    rank_bytes = [0] * world_size
    bound: list = [None] * len(entries)
    for i in order:
        shape, itemsize, placement = entries[i]
        bound[i] = placement.bind(shape, itemsize, world_size, tuple(rank_bytes))
        for r in range(world_size):
            rank_bytes[r] += math.prod(bound[i].local_shape(shape, r, world_size)) * itemsize
    return bound


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def plan_layout(slots: Sequence[SlotPlan], dtypes: Sequence[torch.dtype],
                world_size: int) -> BucketLayout:
    """Pack each rank's pieces of `slots`, typed as `dtypes`, into its segment.

    Each piece is aligned to its dtype's size and the segment to the largest,
    so every typed view of the gathered buffer is aligned as well.
    """
    cursor = [0] * world_size
    regions = []
    for slot, dtype in zip(slots, dtypes):
        size = dtype.itemsize
        offsets, nbytes = [], []
        for r in range(world_size):
            cursor[r] = _align(cursor[r], size)
            offsets.append(cursor[r])
            nbytes.append(math.prod(slot.local_shapes[r]) * size)
            cursor[r] += nbytes[-1]
        regions.append(Region(dtype, tuple(offsets), tuple(nbytes)))
    widest = max((d.itemsize for d in dtypes), default=1)
    return BucketLayout(tuple(regions), _align(max(cursor, default=0), widest), world_size)
