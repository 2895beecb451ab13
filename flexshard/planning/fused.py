"""A bucket's copies as one fused op each, planned once per layout at wrap time.

FSDP2 copies a group's params with one kernel per direction
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): `_foreach_copy_`
into the all-gather input, `split_with_sizes_copy` out of the output,
`_chunk_cat` (with the cast) into the reduce-scatter input. A bucket here is a
flat byte buffer, so each of those is one op over typed views of it, and the
views themselves come from one `split` per dtype, not one slice per param:

- `TypedSplit`: a byte range of a buffer cut into the pieces of some regions
  (typed `view` + `split`, the gaps between pieces left out): the copy-in's
  destinations (and an offloaded storage's staged sources), the reduce input's
  destinations where every grad is one contiguous span (Owned);
- `SplitCopyOut`: params whose pieces have one size and one offset on every
  rank are the columns of the gathered buffer seen as [world, segment]: one
  `split_with_sizes_copy` per run of such columns copies them all out;
- `ChunkCatPack`: grads split as torch.chunk splits their dim 0 (Shard(0),
  an even RaggedShard) laid out back to back in slot order are exactly what
  `torch._chunk_cat(grads, 0, world)` writes (zero padding included), cast to
  the reduce dtype on the way.

A layout these do not fit keeps the per-param copy plans (copyplan.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from ..placements.wire import Cast
from .layout import BucketLayout, SlotPlan


class TypedSplit(NamedTuple):
    """Pieces of one byte range of a buffer: for each dtype, `torch.split` of the
    range typed as it (`sizes`, gaps included) and which chunk is which piece."""

    groups: tuple  # (dtype, sizes, picks): picks[k] = (chunk index, piece position)
    count: int  # pieces in all
    nbytes: int  # bytes of the range


def plan_split(nbytes: int, pieces: Sequence[tuple]) -> TypedSplit:
    """A split of a range of `nbytes` bytes into `pieces`, each (byte start,
    dtype, numel); non-overlapping, aligned to their itemsize. An empty piece
    is an empty chunk at the end."""
    groups = []
    for dtype in dict.fromkeys(p[1] for p in pieces):
        size = dtype.itemsize
        mine = sorted((start // size, numel, k) for k, (start, d, numel) in enumerate(pieces)
                      if d == dtype and numel)
        sizes, picks, at = [], [], 0
        for start, numel, k in mine:
            if start > at:
                sizes.append(start - at)
            picks.append((len(sizes), k))
            sizes.append(numel)
            at = start + numel
        if nbytes // size > at:
            sizes.append(nbytes // size - at)
        for k, (_, d, numel) in enumerate(pieces):
            if d == dtype and not numel:
                picks.append((len(sizes), k))
                sizes.append(0)
        groups.append((dtype, tuple(sizes), tuple(picks)))
    return TypedSplit(tuple(groups), len(pieces), nbytes)


def segment_split(layout: BucketLayout, rank: int, regions: Sequence[int],
                  nbytes: Optional[int] = None) -> TypedSplit:
    """`rank`'s pieces of `regions` in its segment of `layout` (or in its first
    `nbytes` bytes, which hold them: a storage buffer short of the segment)."""
    pieces = [(layout.regions[j].offsets[rank], layout.regions[j].dtype,
               layout.regions[j].nbytes[rank] // layout.regions[j].dtype.itemsize)
              for j in regions]
    return plan_split(layout.segment_bytes if nbytes is None else nbytes, pieces)


def span_split(layout: BucketLayout, regions: Sequence[int]) -> Optional[TypedSplit]:
    """The full tensors of `regions` in the gathered buffer when each is one
    span of it (layout.gathered_range); None when one is not."""
    pieces = []
    for j in regions:
        span = layout.gathered_range(j)
        if span is None:
            return None
        dtype = layout.regions[j].dtype
        pieces.append((span[0], dtype, (span[1] - span[0]) // dtype.itemsize))
    return plan_split(layout.wire_bytes, pieces)


# Copy-out: columns of [world, segment].


class ColumnRun(NamedTuple):
    """Columns [start, stop) of one gather group's block of the gathered buffer,
    typed as `dtype` and seen as [world, width]: split into `sizes`, chunk
    picks[k][0] is region picks[k][1]."""

    dtype: torch.dtype
    start: int
    stop: int
    sizes: tuple
    picks: tuple
    base: int = 0  # the group's block: first byte in the gathered buffer
    width: int = 0  # the group's width in elements of `dtype`


class SplitCopyOut(NamedTuple):
    """The copy-out of the `regions` that fit columns (`runs`); the rest copy one by one."""

    runs: tuple
    columns: frozenset  # regions copied by the runs


def _uniform(layout: BucketLayout, j: int) -> bool:
    """Region j's pieces are rows of [world, n]: rank-major, at one offset, non-empty on
    rank 0, and equal or padded to rank 0's (layout.py: torch.chunk's uneven pieces)."""
    reg = layout.regions[j]
    return (reg.rank_major and reg.nbytes[0] > 0 and len(set(reg.offsets)) == 1
            and (reg.padded or len(set(reg.nbytes)) == 1))


def plan_copy_out(layout: BucketLayout, regions: Sequence[int]) -> SplitCopyOut:
    """Runs of uniform `regions` of one gather group with no other region's bytes
    (on any rank) between them."""
    uniform = [j for j in regions if _uniform(layout, j)]
    chosen = set(uniform)
    foreign = [(reg.offsets[r], reg.offsets[r] + reg.nbytes[r])
               for j, reg in enumerate(layout.regions) if j not in chosen
               for r in range(layout.world_size) if reg.nbytes[r]]
    runs = []
    for group, dtype in dict.fromkeys((layout.regions[j].group, layout.regions[j].dtype)
                                      for j in uniform):
        cols = sorted((layout.regions[j].offsets[0], layout.regions[j].nbytes[0], j)
                      for j in uniform
                      if (layout.regions[j].group, layout.regions[j].dtype) == (group, dtype))
        first, last = layout.spans[group]
        where = (layout.block(group)[0], (last - first) // dtype.itemsize)
        current: list = []
        for start, nbytes, j in cols:
            if current and any(a < start and b > current[-1][1] for a, b in foreign):
                runs.append(_run(dtype, current, first, where))
                current = []
            current.append((start, start + nbytes, j))
        if current:
            runs.append(_run(dtype, current, first, where))
    return SplitCopyOut(tuple(runs), frozenset(chosen))


class CopyOutPlans(NamedTuple):
    """A gather layout's two fused copy-outs. Both take the parts of other wire
    formats that are no view (the format decodes them from their columns)."""

    beside_views: SplitCopyOut  # the cast params that are no view (the rest view the output)
    every_cast: SplitCopyOut  # every cast param (none views the gather output)



def _run(dtype: torch.dtype, cols: list, first: int, where: tuple) -> ColumnRun:
    """The run of `cols` ((start, stop, region) bytes of the segment) in the group
    starting at segment byte `first`, whose block is `where` (base, width)."""
    size = dtype.itemsize
    sizes, picks, at = [], [], (cols[0][0] - first) // size
    for start, stop, j in cols:
        if (start - first) // size > at:
            sizes.append((start - first) // size - at)  # padding, copied into a chunk no one keeps
        picks.append((len(sizes), j))
        sizes.append((stop - start) // size)
        at = (stop - first) // size
    return ColumnRun(dtype, (cols[0][0] - first) // size, at, tuple(sizes), tuple(picks), *where)


# Reduce-scatter copy-in.


class ChunkCatPack(NamedTuple):
    """`torch._chunk_cat(grads of members, 0, world, out=the group's block as
    [world, group width][:, :width])` writes those grads' pieces where the reduce
    layout puts them."""

    width: int  # columns (elements) the chunk-cat writes; the rest of each row is zeroed
    seg_elems: int  # the group's width in elements
    base: int  # the group's block: first element in the reduce input
    members: tuple  # indices into the trainable slots, in slot order


def _chunk_rows(rows: int, rank: int, world_size: int) -> int:
    chunk = -(-rows // world_size)
    return max(0, min(chunk, rows - rank * chunk))


def plan_chunk_cat(layout: BucketLayout, slots: Sequence[SlotPlan]) -> Optional[ChunkCatPack]:
    """The chunk-cat pack of the reduce `layout`'s last gather group (its packed
    one) over its share of `slots` (the trainable ones), or None where that group
    is not what _chunk_cat writes."""
    group = len(layout.spans) - 1
    members = tuple(j for j in range(len(slots)) if layout.regions[j].group == group)
    if not members or len({reg.dtype for reg in layout.regions}) != 1 or \
            layout.uneven[group] is not None:  # an uneven block is no [world, width]
        return None
    first, last = layout.spans[group]
    size, col = layout.regions[0].dtype.itemsize, 0
    for j in members:
        slot = slots[j]
        if not len(slot.shape) or not math.prod(slot.shape) or \
                not slot.placement.rank_major(slot.shape):
            return None  # torch._chunk_cat refuses an empty tensor in its list
        rows, inner = slot.shape[0], math.prod(slot.shape[1:])
        for r in range(layout.world_size):
            expected = torch.Size((_chunk_rows(rows, r, layout.world_size), *slot.shape[1:]))
            if slot.local_shapes[r] != expected or \
                    layout.regions[j].offsets[r] != first + col * size:
                return None
        col += -(-rows // layout.world_size) * inner
    if col * size > last - first:
        return None
    return ChunkCatPack(col, (last - first) // size, layout.block(group)[0] // size, members)


# All-gather copy-in.


class CopyInPlan(NamedTuple):
    """The copy-in of one rank: one foreach copy (cast) of the `cast` slots'
    pieces from the storage into the gather input (other wire formats encode
    their pieces themselves: wire_plan.py)."""

    cast: tuple  # slots sent as they are (placements/wire.py Cast), non-empty here
    dst: TypedSplit  # their pieces in this rank's segment of the gather layout
    src: TypedSplit  # their pieces in the storage buffer (or its staged copy)
    in_output: TypedSplit  # their pieces where this rank's segment lies in the gather
    #                        output (the copy-in's views made once: runtime/unsharded.py)


def plan_copy_in(storage: BucketLayout, storage_bytes: int, gather: BucketLayout, wire,
                 rank: int) -> CopyInPlan:
    """The copy-in of `rank` from its storage (of `storage_bytes`) into the gather input."""
    cast = tuple(i for i, f in enumerate(wire.formats)
                 if isinstance(f, Cast) and storage.regions[i].nbytes[rank])
    regions = [wire.first[i] for i in cast]
    in_output = plan_split(gather.wire_bytes, [
        (gather.piece_start(j, rank), gather.regions[j].dtype,
         gather.regions[j].nbytes[rank] // gather.regions[j].dtype.itemsize) for j in regions])
    return CopyInPlan(cast, segment_split(gather, rank, regions),
                      segment_split(storage, rank, cast, storage_bytes), in_output)
