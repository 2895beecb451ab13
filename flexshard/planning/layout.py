"""Pure planning of a bucket's bytes: where each rank's piece of each parameter lives.

No process group is needed here: every rank computes the same plan from the
same inputs. A bucket has up to three layouts over the same slots: storage
(original dtypes), gather (param_dtype on the wire) and reduce (one reduce
dtype). Each rank owns one segment of `segment_bytes`; the gathered buffer is
the world's segments back to back (rank-major). A rank's own pieces end at
`used_bytes(rank)`, which may be short of the segment (whole Owned tensors do
not split evenly): its storage buffer holds only that much, and the rest of the
segment is padding that only the gather input and output carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch

from ..placements.contract import Placement
from ..placements.shard import Shard


class SlotPlan(NamedTuple):
    """One parameter of a bucket, with its placement bound."""

    fqn: str
    shape: torch.Size
    dtype: torch.dtype
    placement: Placement
    local_shapes: tuple  # torch.Size per rank
    subclass: Optional[object] = None  # a SubclassGather: the param's tensor subclass gathers itself


class Region(NamedTuple):
    """Where one slot's pieces sit in a layout, per rank."""

    dtype: torch.dtype
    offsets: tuple  # byte offset of rank r's piece inside rank r's segment
    nbytes: tuple  # byte size of rank r's piece
    rank_major: bool = True  # the placement's pieces, back to back, are the full tensor
    padded: bool = False  # uneven torch.chunk pieces, each given the largest one's bytes
    group: int = 0  # the gather group (BucketLayout.groups) its pieces lie in
    uneven: bool = False  # alone in an uneven gather group: its unequal pieces back to back


@dataclass(frozen=True)
class BucketLayout:
    """The byte plan of one buffer kind of a bucket.

    A segment is cut into *gather groups*, contiguous byte ranges (start, stop)
    of it, each gathered (and reduced) by a collective of its own, coalesced:
    the gathered buffer is the groups' blocks back to back, each block its
    ranks' ranges rank-major ([world, stop - start]). A solo group holds one
    parameter's equal pieces (Shard(0)), so its block is the full tensor;
    the packed group holds the rest (see plan_layout). `groups` empty: one
    group, the whole segment (the gathered buffer is [world, segment]).
    An *uneven* group (a Region with `uneven`) holds one parameter's unequal
    pieces: its block is those pieces back to back, each rank's at the sum of
    the previous ranks' sizes (no padding), so it is the full tensor too; its
    range of a segment is as wide as the largest piece (the gather input).

    The sizes a step reads (`spans`, `wire_bytes`, `ideal_bytes`) are fields,
    computed once here: a step reads them, it runs no planning code."""

    regions: tuple
    segment_bytes: int
    world_size: int
    groups: tuple = ()  # (start, stop) byte ranges of the segment, in order
    # each rank's bytes of the last group when it is uneven though it holds several
    # regions (a reduce layout of whole tensors, `plan_layout`'s `owners_uneven`), else None
    last_uneven: Optional[tuple] = None
    # the gather groups, (start, stop) each: `groups`, or the whole segment
    spans: tuple = field(init=False, compare=False, repr=False)
    # bytes a collective over this layout moves (padding included): the gathered buffer's size
    wire_bytes: int = field(init=False, compare=False, repr=False)
    # bytes that must move: the sum of every rank's pieces
    ideal_bytes: int = field(init=False, compare=False, repr=False)
    # per gather group: None, or each rank's bytes of an uneven group (its region's pieces)
    uneven: tuple = field(init=False, compare=False, repr=False)
    # per gather group: bytes of its block in the gathered buffer, and where the block starts
    block_bytes: tuple = field(init=False, compare=False, repr=False)
    bases: tuple = field(init=False, compare=False, repr=False)
    # whether a rank's segment is several ranges of the gathered buffer (several gather
    # groups, or an uneven one), not one: a copy-in then writes those ranges (or its own)
    split_segment: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        spans = self.groups or ((0, self.segment_bytes),)
        uneven = [None] * len(spans)
        for reg in self.regions:
            if reg.uneven:
                uneven[reg.group] = reg.nbytes
        if self.last_uneven is not None:
            uneven[-1] = self.last_uneven
        sizes = tuple((stop - start) * self.world_size if uneven[g] is None else sum(uneven[g])
                      for g, (start, stop) in enumerate(spans))
        derived = (("spans", spans), ("uneven", tuple(uneven)), ("block_bytes", sizes),
                   ("bases", tuple(sum(sizes[:g]) for g in range(len(sizes)))),
                   ("split_segment", len(spans) > 1 or any(uneven)),
                   ("wire_bytes", sum(sizes)),
                   ("ideal_bytes", sum(sum(reg.nbytes) for reg in self.regions)))
        for name, value in derived:
            object.__setattr__(self, name, value)

    def block(self, group: int) -> tuple:
        """(start, stop) of `group`'s block in the gathered buffer."""
        return self.bases[group], self.bases[group] + self.block_bytes[group]

    def rank_part(self, group: int, rank: int) -> tuple:
        """(start, stop) of `rank`'s range of `group`'s block, bytes from the block's start."""
        sizes = self.uneven[group]
        if sizes is None:
            start, stop = self.spans[group]
            return rank * (stop - start), (rank + 1) * (stop - start)
        return sum(sizes[:rank]), sum(sizes[:rank + 1])

    def stride(self, slot: int) -> int:
        """Bytes between consecutive ranks' pieces of `slot` in the gathered buffer."""
        start, stop = self.spans[self.regions[slot].group]
        return stop - start

    def gathered_at(self, rank: int, offset: int, group: int) -> int:
        """Byte of the gathered buffer holding byte `offset` of `rank`'s segment,
        which lies in `group`."""
        return self.bases[group] + self.rank_part(group, rank)[0] + offset - self.spans[group][0]

    def piece_start(self, slot: int, rank: int) -> int:
        """Byte offset of `rank`'s piece of `slot` in the gathered buffer."""
        reg = self.regions[slot]
        return self.gathered_at(rank, reg.offsets[rank], reg.group)

    def gathered_range(self, slot: int) -> Optional[tuple]:
        """(start, end) when the slot's pieces are back to back in the gathered
        buffer, so the parameter is a view of it; None when it needs a copy."""
        ranks = [r for r in range(self.world_size) if self.regions[slot].nbytes[r]]
        if not ranks:
            return (0, 0)
        if not self.regions[slot].rank_major:  # e.g. Shard(1): adjacent bytes, wrong order
            return None
        start = self.piece_start(slot, ranks[0])
        end = start
        for r in ranks:
            if self.piece_start(slot, r) != end:
                return None
            end += self.regions[slot].nbytes[r]
        return (start, end)

    def output_bytes(self, rank: int) -> int:
        """Bytes of `rank`'s reduce-scatter output over this layout: its segment, or
        where the layout is one uneven group (whole tensors: `_owners_sizes`) only
        its own range, so its reduced grads hold no padding."""
        if len(self.spans) == 1 and self.uneven[0] is not None:
            return self.uneven[0][rank]
        return self.segment_bytes

    def used_bytes(self, rank: int) -> int:
        """Bytes of `rank`'s segment up to the end of its last piece, aligned as the
        segment is: what its storage buffer holds (at most `segment_bytes`)."""
        end = max((reg.offsets[rank] + reg.nbytes[rank] for reg in self.regions
                   if reg.nbytes[rank]), default=0)
        widest = max((_piece_align(reg.dtype) for reg in self.regions), default=ALIGN)
        return min(_align(end, widest), self.segment_bytes)

    def gaps(self) -> tuple:
        """(start, stop) byte ranges of the gathered buffer that no piece covers,
        adjacent ones merged: padding and alignment."""
        out: list = []
        for group, (first, _) in enumerate(self.spans):
            for rank in range(self.world_size):
                base, at = self.gathered_at(rank, first, group), first
                lo, hi = self.rank_part(group, rank)
                pieces = sorted((reg.offsets[rank], reg.nbytes[rank]) for reg in self.regions
                                if reg.nbytes[rank] and reg.group == group)
                for start, nbytes in pieces + [(first + hi - lo, 0)]:
                    if start > at:
                        lo, hi = base + at - first, base + start - first
                        if out and out[-1][1] == lo:
                            out[-1] = (out[-1][0], hi)
                        else:
                            out.append((lo, hi))
                    at = max(at, start + nbytes)
        return tuple(out)

    def storage_bytes(self, rank: int) -> int:
        """Bytes of `rank`'s storage buffer: `used_bytes(rank)` when the rest of
        the segment (padding) is more than 1/16 of it, else the whole segment.
        A buffer short of the segment needs a copy-in per gather (into the
        gather output, see BucketGather._buffers); a full one is the gather
        input itself. So whole tensors that do not split evenly (an Owned
        bucket's light ranks) hold no padding, and the last rows Shard(0) or
        RaggedShard leave short (FSDP2 pads its shards the same) cost no copy."""
        used = self.used_bytes(rank)
        return used if _heavy(self.segment_bytes - used, self.segment_bytes) else self.segment_bytes

    @property
    def keeps_views(self) -> bool:
        """Whether the bucket hands out views of the gathered buffer. A view pins
        the whole buffer, so when the params that need copies anyway exceed
        1/16 of the bucket, copying everything out saves more memory than the
        views save copies, and the bucket copies every param. With gather groups
        the views are the large params (solo groups) and what they pin beyond
        themselves is the packed block, copied out anyway: they are kept while
        that block is no larger than they are (the memory pinned is at most the
        copy avoided)."""
        copied = sum(sum(self.regions[i].nbytes) for i in range(len(self.regions))
                     if self.gathered_range(i) is None)
        if self.groups:
            return copied <= self.ideal_bytes - copied
        return not _heavy(copied, self.ideal_bytes)

    def hands_out_views(self, reshard_after_forward) -> bool:
        """Whether a gather over this layout hands out views of its output
        (keeps_views): not for a bucket that keeps its unsharded params through
        backward (reshard_after_forward False: the root's) over heavy padding
        (pins_padding): its params are copied out."""
        return self.keeps_views and not (self.pins_padding and reshard_after_forward is False)

    @property
    def pins_padding(self) -> bool:
        """Whether more than 1/16 of the gathered buffer is padding (whole tensors
        that do not split evenly over the ranks: Owned). Views of it pin the
        padding with the params, so a bucket that keeps its unsharded params
        through backward copies them out instead (see BucketGather.gather)."""
        return _heavy(self.wire_bytes - self.ideal_bytes, self.wire_bytes)

    @property
    def dense(self) -> bool:
        """Whether the pieces cover every byte of every segment (no padding, no
        alignment gaps): a buffer every piece is written into needs no zeroing."""
        return self.ideal_bytes == self.wire_bytes


def bind_placements(entries: Sequence[tuple], world_size: int,
                    rank_bytes: Optional[list] = None) -> list:
    """Bind each (shape, itemsize, placement) entry, largest first, balancing
    bytes across ranks. Returns the bound placements in input order.
    `rank_bytes`: bytes each rank already holds (the buckets planned before
    this one), updated in place; balancing over the whole model keeps one rank
    from being the heavy one of every bucket."""
    order = sorted(range(len(entries)),
                   key=lambda i: -math.prod(entries[i][0]) * entries[i][1])
    if rank_bytes is None:
        rank_bytes = [0] * world_size
    bound: list = [None] * len(entries)
    for i in order:
        shape, itemsize, placement = entries[i]
        bound[i] = placement.bind(shape, itemsize, world_size, tuple(rank_bytes))
        for r in range(world_size):
            rank_bytes[r] += math.prod(bound[i].local_shape(shape, r, world_size)) * itemsize
    return bound


def typed_view(buffer: torch.Tensor, start: int, dtype: torch.dtype,
               shape: torch.Size) -> torch.Tensor:
    """A `dtype` tensor of `shape` over `buffer`'s bytes from `start`: how a
    planned region is read (storage, gather and reduce buffers, wire parts)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[start:start + nbytes].view(dtype).view(shape)


def piece_bytes(slot: SlotPlan, rank: int) -> int:
    """Bytes rank `rank`'s piece of `slot` takes in a segment of its own
    dtype, alignment included (what the piece adds to the rank's storage)."""
    nbytes = math.prod(slot.local_shapes[rank]) * slot.dtype.itemsize
    return _align(nbytes, _piece_align(slot.dtype))


def _heavy(part: int, whole: int) -> bool:
    """Whether `part` is over 1/16 of `whole`: the one threshold at which a layout
    trades a copy for bytes (copy-out against pinned views, short storage against
    a copy-in, copied-out kept params against pinned padding)."""
    return part * 16 > whole


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


# Every piece starts on a multiple of ALIGN bytes (and of its itemsize), and
# segments are multiples of it: vectorised kernels (16-byte loads on GPUs,
# fused optimizers) then see aligned parameter views in every layout, given a
# buffer base aligned at least as much (torch's allocators give 64+ bytes).
ALIGN = 16


def _piece_align(dtype: torch.dtype) -> int:
    return max(ALIGN, dtype.itemsize)


# Zero-copy chains. A rank-major parameter split over ranks a..b is a view of
# the gathered buffer when its piece on a ENDS segment a, its pieces on a+1..b-1
# fill their whole segments and its piece on b STARTS segment b (FSDP1's flat
# parameter is one long chain). So each rank boundary carries at most one
# chained parameter, and each segment reads
#   [piece continuing from rank r-1][other pieces][padding][piece continuing to rank r+1].


class _Chain(NamedTuple):
    slot: int
    first: int  # first rank with a non-empty piece
    last: int  # last rank with a non-empty piece


def _chain_candidates(slots: Sequence[SlotPlan], nbytes: list) -> list:
    """Rank-major slots whose non-empty pieces sit on 2+ consecutive ranks, largest first.
    The piece ending a segment starts at segment - its size, so it stays aligned
    only when its size is a multiple of ALIGN: other slots cannot chain."""
    out = []
    for i, slot in enumerate(slots):
        ranks = [r for r, b in enumerate(nbytes[i]) if b]
        if (len(ranks) > 1 and ranks[-1] - ranks[0] == len(ranks) - 1
                and all(nbytes[i][r] % ALIGN == 0 for r in ranks[:-1])
                and slot.placement.rank_major(slot.shape)):
            out.append(_Chain(i, ranks[0], ranks[-1]))
    return sorted(out, key=lambda c: (-sum(nbytes[c.slot]), c.slot))


def _pick_chains(candidates: Sequence[_Chain], nbytes: list, rejected: set) -> list:
    """Greedily give each rank boundary to the largest candidate that crosses it.
    A chain over 3+ ranks needs its middle ranks to hold nothing else."""
    taken, picked = set(), []
    for c in candidates:
        bounds = set(range(c.first, c.last))
        middle = range(c.first + 1, c.last)
        crowded = any(nbytes[j][r] for r in middle for j in range(len(nbytes)) if j != c.slot)
        if c.slot in rejected or bounds & taken or crowded:
            continue
        taken |= bounds
        picked.append(c)
    return picked


def _columnar(slot: SlotPlan, pieces: Sequence[int]) -> bool:
    """Whether `slot`'s pieces (bytes per rank) can be a column of the gathered
    [world, segment] (fused.py): rank-major, split, and equal or padded to rank 0's."""
    return (slot.placement.rank_major(slot.shape) and len(pieces) > 1 and pieces[0] > 0
            and (len(set(pieces)) == 1 or _chunk_width(slot, pieces) is not None))


def _chunk_width(slot: SlotPlan, pieces: Sequence[int]) -> Optional[int]:
    """Rank 0's piece bytes (the largest) when `slot` is Shard-placed and its
    `pieces` (bytes per rank) are uneven (torch.chunk's: full ones, at most one
    shorter, then empty ones); else None."""
    if not isinstance(slot.placement, Shard) or len(set(pieces)) == 1:
        return None
    return pieces[0]


def _segments(nbytes: list, sizes: list, chains: Sequence[_Chain], world_size: int,
              widths: Sequence[Optional[int]]) -> tuple:
    """(offsets per slot per rank, segment bytes) with `chains` at segment ends;
    a slot with a width takes that many bytes on every rank (see plan_layout)."""
    head = {c.first + k: c for c in chains for k in range(c.last - c.first)}  # piece ends segment
    tail = {r: c for c in chains for r in range(c.first + 1, c.last + 1)}  # piece starts segment
    offsets = [[0] * world_size for _ in nbytes]
    need = []
    for r in range(world_size):
        cursor = nbytes[tail[r].slot][r] if r in tail else 0
        for i in range(len(nbytes)):
            if (r in tail and tail[r].slot == i) or (r in head and head[r].slot == i):
                continue
            cursor = offsets[i][r] = _align(cursor, sizes[i])
            cursor += nbytes[i][r] if widths[i] is None else widths[i]
        if r in head and head.get(r) != tail.get(r):
            cursor = _align(cursor, sizes[head[r].slot]) + nbytes[head[r].slot][r]
        need.append(cursor)
    segment = _align(max(need, default=0), max(sizes, default=1))
    for r, c in head.items():
        offsets[c.slot][r] = segment - nbytes[c.slot][r]
    return offsets, segment


# A parameter whose pieces are a column of the gathered buffer (Shard(0): equal
# or torch.chunk's pieces, padded to the largest) and whose full tensor is at least
# SOLO_MIN_BYTES gets a gather group of its own: its block of the gathered buffer
# is the full tensor, so it is a view (no copy-out), and its grad packs into the
# reduce input by a cast-copy into a view. The rest share one packed group, copied
# out by one split-copy: below this size a collective of its own costs more than
# its copy (a coalesced collective's per-op setup; design.md, "Gather groups").
SOLO_MIN_BYTES = 64 << 10


def _solo(slot: SlotPlan, pieces: Sequence[int]) -> bool:
    """Whether `slot`, of `pieces` bytes per rank, gets a gather group of its own."""
    return (_columnar(slot, pieces) and pieces[0] % ALIGN == 0
            and sum(pieces) >= SOLO_MIN_BYTES)


def _uneven_solo(slot: SlotPlan, pieces: Sequence[int]) -> bool:
    """Whether `slot` gets an uneven gather group of its own: large, rank-major, no
    column (a balanced RaggedShard over a world not dividing its rows: 171, 171,
    170 ...), on 2+ ranks, each piece a multiple of ALIGN (so the next one, right
    after it in the block, stays aligned)."""
    return (slot.placement.rank_major(slot.shape) and not _columnar(slot, pieces)
            and sum(1 for b in pieces if b) > 1 and all(b % ALIGN == 0 for b in pieces)
            and sum(pieces) >= SOLO_MIN_BYTES)


def plan_layout(slots: Sequence[SlotPlan], dtypes: Sequence[torch.dtype],
                world_size: int, uneven: bool = False,
                owners_uneven: bool = False) -> BucketLayout:
    """Lay each rank's pieces of `slots`, typed as `dtypes`, into its segment.

    Large column params (`_solo`) come first, a gather group each; with `uneven`
    (a gather layout whose bucket can gather so: bucket_plan.gathers_uneven), so
    do large uneven rank-major params (`_uneven_solo`), each an uneven group. The
    rest follow in the packed group (`plan_packed`). One group when there is no
    solo param (or at world size 1, where every param is a view anyway). With
    `owners_uneven` (a reduce layout) a packed group of whole tensors (each on one
    rank: Owned) whose ranks hold unequal bytes is uneven too (`_owners_sizes`)."""
    layout = _plan_groups(slots, dtypes, world_size, uneven)
    sizes = _owners_sizes(layout) if owners_uneven else None
    if sizes is None:
        return layout
    return BucketLayout(layout.regions, layout.segment_bytes, world_size, layout.groups, sizes)


def _owners_sizes(layout: BucketLayout) -> Optional[tuple]:
    """Each rank's bytes of `layout`'s last group (through its last piece, aligned)
    when every region in it is on one rank and the ranks' bytes differ; else None.
    Such a group's pieces back to back are the whole tensors with no padding: its
    reduce is one list reduce_scatter (NCCL: one reduce per owner) and a rank's
    output is its own tensors."""
    group, (first, _) = len(layout.spans) - 1, layout.spans[-1]
    members = [reg for reg in layout.regions if reg.group == group]
    if layout.world_size == 1 or not members or layout.uneven[group] is not None or \
            any(sum(1 for b in reg.nbytes if b) > 1 for reg in members):
        return None
    widest = max(_piece_align(reg.dtype) for reg in layout.regions)
    sizes = tuple(_align(max((reg.offsets[r] + reg.nbytes[r] - first for reg in members
                              if reg.nbytes[r]), default=0), widest)
                  for r in range(layout.world_size))
    return None if len(set(sizes)) == 1 else sizes


def _plan_groups(slots: Sequence[SlotPlan], dtypes: Sequence[torch.dtype],
                 world_size: int, uneven: bool) -> BucketLayout:
    """plan_layout's groups: the solo ones, then the packed one."""
    nbytes = [[math.prod(s.local_shapes[r]) * d.itemsize for r in range(world_size)]
              for s, d in zip(slots, dtypes)]
    ragged = {i for i, (s, b) in enumerate(zip(slots, nbytes))
              if uneven and world_size > 1 and _uneven_solo(s, b)}
    solo = [i for i, (s, b) in enumerate(zip(slots, nbytes))
            if world_size > 1 and (_solo(s, b) or i in ragged)]
    if not solo:
        return plan_packed(slots, dtypes, world_size)
    rest = [i for i in range(len(slots)) if i not in solo]
    packed = plan_packed([slots[i] for i in rest], [dtypes[i] for i in rest], world_size)
    regions: list = [None] * len(slots)
    groups, at = [], 0
    for g, i in enumerate(solo):
        width = max(nbytes[i])  # rank 0's, but for an uneven group's
        regions[i] = Region(dtypes[i], (at,) * world_size, tuple(nbytes[i]), True,
                            i not in ragged and len(set(nbytes[i])) > 1, g, i in ragged)
        groups.append((at, at + width))
        at += width
    for k, i in enumerate(rest):
        reg = packed.regions[k]
        regions[i] = reg._replace(offsets=tuple(o + at for o in reg.offsets), group=len(solo))
    if rest:
        groups.append((at, at + packed.segment_bytes))
    return BucketLayout(tuple(regions), at + packed.segment_bytes, world_size, tuple(groups))


def plan_packed(slots: Sequence[SlotPlan], dtypes: Sequence[torch.dtype],
                world_size: int) -> BucketLayout:
    """Lay each rank's pieces of `slots` into one segment (one gather group).

    Each piece is aligned to ALIGN bytes (16, or its itemsize if larger) and
    the segment to the largest, so every typed view of the gathered buffer is
    aligned as well. Where the
    placements allow it and at most one parameter could be a column (below), split
    parameters are chained across rank boundaries so that they are views of the
    gathered buffer (no copy-out). A Shard
    parameter split unevenly (a dim the world does not divide) takes its largest
    piece's bytes on every rank, as FSDP2 pads it, so the regions after it keep
    one offset on every rank; a rank-major one (Shard(0)) is then a column of
    the gathered [world, segment], copied out by the bucket's one split-copy and
    packed by its one chunk-cat (fused.py) instead of one copy per param.
    """
    sizes = [_piece_align(d) for d in dtypes]
    nbytes = [[math.prod(s.local_shapes[r]) * d.itemsize for r in range(world_size)]
              for s, d in zip(slots, dtypes)]
    uneven = [_chunk_width(s, b) for s, b in zip(slots, nbytes)]
    # Columns beat a chain: a chain shifts every other piece, so two or more params that
    # would be columns of [world, segment] (one split-copy out, one chunk-cat in) would
    # each be copied on their own instead. Chains are for a bucket's only split param.
    columns = sum(_columnar(s, b) for s, b in zip(slots, nbytes))
    candidates, rejected = ([] if columns > 1 else _chain_candidates(slots, nbytes)), set()
    while True:
        chains = _pick_chains(candidates, nbytes, rejected)
        chained = {c.slot for c in chains}  # a chain places its pieces itself: never padded
        widths = [None if i in chained else w for i, w in enumerate(uneven)]
        offsets, segment = _segments(nbytes, sizes, chains, world_size, widths)
        short = [c.slot for c in chains for r in range(c.first + 1, c.last)
                 if nbytes[c.slot][r] != segment]
        if not short:
            break
        rejected.update(short)
    regions = tuple(Region(d, tuple(o), tuple(b), s.placement.rank_major(s.shape), w is not None)
                    for s, d, o, b, w in zip(slots, dtypes, offsets, nbytes, widths))
    return BucketLayout(regions, segment, world_size)
