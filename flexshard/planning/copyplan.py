"""Copy plans: how one parameter moves between its full tensor and a rank-major
buffer (gather output, reduce input) in a number of ops that does not grow
with the world size.

Made once per layout at wrap time, where looping over ranks is fine. Each
step then runs one of three plans per parameter:
- a *view*: the pieces lie back to back (a zero-copy chain, Owned, world 1):
  the full tensor is one typed view of the buffer;
- *runs*: groups of consecutive ranks holding equal pieces at equal offsets
  (Shard(0) over a world dividing the rows, torch.chunk's short tail) are
  2-D strided views (rows = ranks, stride = its gather group's width): one copy per run,
  at most MAX_RUNS per parameter;
- an *index*: any other placement (Shard(d>0), ragged rows at uneven
  offsets) reads or writes through one precomputed index of the parameter's
  elements in the buffer (built by the placement's own unshard on index
  tensors, so user placements work unchanged), in blocks of `block` elements
  that stay together in both (the gcd of the contiguous stretches: a row of
  a Shard(1) piece, whole ragged pieces): 8 bytes per block on the device,
  made on first use per device.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from .layout import BucketLayout, SlotPlan

MAX_RUNS = 8  # beyond this many strided runs a parameter uses its index


class Run(NamedTuple):
    """Pieces of `rows` consecutive ranks, `length` elements each, every one at
    `start + k * stride` (elements of the typed buffer); they fill the full
    tensor's flat elements from `flat_start` on."""

    start: int
    rows: int
    length: int
    stride: int
    flat_start: int


class CopyPlan:
    """How one slot's full tensor maps onto a rank-major buffer of a layout."""

    def __init__(self, layout: BucketLayout, slot: SlotPlan, index: int) -> None:
        self.region = index  # in the layout
        self.dtype = layout.regions[index].dtype
        self.shape = slot.shape
        self.numel = math.prod(slot.shape)
        self.span: Optional[tuple] = layout.gathered_range(index)  # bytes, when a view
        self.runs: Optional[tuple] = None
        self._index_args = (layout, slot, index)
        self._index: dict = {}  # device -> (block, the block index tensor)
        if self.span is None and layout.regions[index].rank_major:
            runs = _runs(layout, slot, index)
            self.runs = runs if len(runs) <= MAX_RUNS else None

    @property
    def kind(self) -> str:
        return "view" if self.span is not None else "runs" if self.runs is not None else "index"

    def full(self, buffer: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """The full tensor from `buffer` (uint8): a view when the plan allows
        and not `copy`, else a new tensor (the copy-out)."""
        if self.span is not None:
            view = _typed(buffer, self.dtype)[self.span[0] // self.dtype.itemsize:][:self.numel]
            view = view.view(self.shape)
            return view.clone() if copy else view
        if self.runs is None:
            block, index = self.index(buffer.device)
            return _blocks(_typed(buffer, self.dtype), block)[index].view(self.shape)
        out = torch.empty(self.shape, dtype=self.dtype, device=buffer.device)
        self.full_into(buffer, out)
        return out

    def full_into(self, buffer: torch.Tensor, out: torch.Tensor) -> None:
        """Write the full tensor from `buffer` (uint8) into `out` (contiguous, of
        the plan's shape and dtype): a param made once, refilled (runtime/unsharded.py)."""
        typed, flat = _typed(buffer, self.dtype), out.view(-1)
        if self.span is not None:
            start = self.span[0] // self.dtype.itemsize
            flat.copy_(typed[start:start + self.numel])
        elif self.runs is None:
            block, index = self.index(buffer.device)
            torch.index_select(_blocks(typed, block), 0, index, out=flat.view(-1, block))
        else:
            for run in self.runs:
                _flat_rows(flat, run).copy_(_strided(typed, run))

    def traced_full(self, typed: torch.Tensor, base: int = 0,
                    index: Optional[tuple] = None) -> torch.Tensor:
        """The full tensor from `typed` (the rank-major buffer, or the part of it
        from element `base` on: a gather group's output; typed as the plan's dtype)
        by out-of-place ops only, for a traced graph (runtime/traced.py): a view
        when the plan is one, else a new tensor. An index plan reads `index`,
        its `index(device, base)` made beforehand, the positions a tensor of the
        graph (an input: a tensor of the plan's own would be a constant of the
        graph, which inductor's fake tensor pass refuses)."""
        if self.span is not None:
            start = self.span[0] // self.dtype.itemsize - base
            if start == 0 and typed.numel() == self.numel:  # its own gather group, whole:
                return typed.view(self.shape)  # no slice, whose backward would copy
            return typed[start:start + self.numel].view(self.shape)
        if self.runs is None:
            if index is None:
                raise AssertionError("a traced index plan reads positions passed in, not its own")
            # as_strided from the tensor's own offset: dynamo cannot trace storage_offset()
            block, index = index
            blocks = typed.as_strided((typed.numel() // block, block), (block, 1))
            return blocks[index].view(self.shape)
        # runs fill the flat tensor in order (flat_start ascending, no gaps)
        return torch.cat([typed[run.start - base:].as_strided((run.rows, run.length),
                                                               (run.stride, 1))
                          .reshape(-1) for run in self.runs]).view(self.shape)

    def traced_full_regrouped(self, typed: torch.Tensor, base: int, seg: int,
                              size: int) -> Optional[torch.Tensor]:
        """As traced_full from a gather group's output whose ranks' segments (`seg`
        elements each) lie position-major: rank k * size + i's at position
        i * (world / size) + k (an int reshard's gather in two steps,
        runtime/traced.py). None where the plan does not read whole segments or
        whole groups of `size` consecutive ranks: the caller puts the buffer in rank
        order first."""
        if not self.numel:
            return typed[:0].view(self.shape)
        across = typed.numel() // seg // size
        if self.span is not None:
            rank, within = divmod(self.span[0] // self.dtype.itemsize - base, seg)
            if within + self.numel > seg:  # not one rank's: across segments
                return None
            start = ((rank % size) * across + rank // size) * seg + within
            return typed[start:start + self.numel].view(self.shape)
        if self.runs is None or any(run.stride != seg for run in self.runs):
            return None
        parts = []
        for run in self.runs:
            first, within = divmod(run.start - base, seg)
            if first % size or run.rows % size:
                return None
            parts.append(typed[first // size * seg + within:].as_strided(
                (run.rows // size, size, run.length), (seg, across * seg, 1)).reshape(-1))
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(self.shape)

    def pack(self, buffer: torch.Tensor, full: torch.Tensor) -> None:
        """Write `full` (any dtype, cast on copy) into its pieces in `buffer` (uint8)."""
        typed = _typed(buffer, self.dtype)
        if self.span is not None:
            start = self.span[0] // self.dtype.itemsize
            typed[start:start + self.numel].view(self.shape).copy_(full)
            return
        flat = full.reshape(-1)
        if self.runs is None:
            block, index = self.index(buffer.device)
            _blocks(typed, block).index_copy_(0, index, flat.to(self.dtype).view(-1, block))
            return
        for run in self.runs:
            _strided(typed, run).copy_(_flat_rows(flat, run))

    def index(self, device: torch.device, base: int = 0, within: int = 0) -> tuple:
        """(block, positions): the full tensor's elements in row-major order are
        blocks of `block` elements, and block k sits at block `positions[k]` of
        the typed buffer from element `base` on (a gather group's part of it);
        `within`, if given, a multiple of `block` (the part's length)."""
        key = (device, base, within)
        if key not in self._index:
            block, positions = _block_index(_element_index(*self._index_args) - base, within)
            self._index[key] = (block, positions.to(device))
        return self._index[key]


def plan_copies(layout: BucketLayout, slots: Sequence[SlotPlan]) -> tuple:
    """One CopyPlan per slot of `layout` (made at wrap time)."""
    return tuple(CopyPlan(layout, slot, i) for i, slot in enumerate(slots))


def _typed(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Every layout's total bytes are a multiple of its widest itemsize (segments are).
    return buffer.view(dtype)


def _blocks(typed: torch.Tensor, block: int) -> torch.Tensor:
    """The typed buffer as rows of `block` elements (a tail shorter than a block is left out)."""
    return typed.as_strided((typed.numel() // block, block), (block, 1), typed.storage_offset())


def _block_index(positions: torch.Tensor, within: int = 0) -> tuple:
    """(block, block positions) for element `positions`: the largest block
    dividing every stretch of consecutive positions, where it starts and `within`."""
    if positions.numel() == 0:
        return 1, positions
    breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks])
    lengths = torch.diff(torch.cat([starts, torch.tensor([positions.numel()])]))
    block = within
    for value in torch.cat([lengths, positions[starts]]).unique().tolist():
        block = math.gcd(block, value)
    return block, positions[::block] // block


def _strided(typed: torch.Tensor, run: Run) -> torch.Tensor:
    return typed.as_strided((run.rows, run.length), (run.stride, 1),
                            typed.storage_offset() + run.start)


def _flat_rows(flat: torch.Tensor, run: Run) -> torch.Tensor:
    return flat[run.flat_start:run.flat_start + run.rows * run.length].view(run.rows, run.length)


def _runs(layout: BucketLayout, slot: SlotPlan, index: int) -> tuple:
    """Maximal groups of consecutive ranks with equal piece sizes and offsets."""
    reg, size = layout.regions[index], layout.regions[index].dtype.itemsize
    seg = layout.stride(index) // size
    runs, flat = [], 0
    for r in range(layout.world_size):
        n = reg.nbytes[r] // size
        if not n:
            continue
        last = runs[-1] if runs else None
        if (last is not None and last.length == n
                and last.start + last.rows * seg == layout.piece_start(index, r) // size):
            runs[-1] = last._replace(rows=last.rows + 1)
        else:
            runs.append(Run(layout.piece_start(index, r) // size, 1, n, seg, flat))
        flat += n
    return tuple(runs)


def _element_index(layout: BucketLayout, slot: SlotPlan, index: int) -> torch.Tensor:
    """The placement joins index pieces as it joins value pieces, so the
    joined tensor says where each full element sits in the buffer."""
    size = layout.regions[index].dtype.itemsize
    pieces = [torch.arange(layout.piece_start(index, r) // size,
                           layout.piece_start(index, r) // size + math.prod(shape))
              .view(shape) for r, shape in enumerate(slot.local_shapes)]
    return slot.placement.unshard(pieces, slot.shape).reshape(-1)
