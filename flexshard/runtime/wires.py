"""A bucket's copies as tensor work, as planning/ planned them: each param's way
through a gather layout (`ParamWire`: its encode into the gather input, its
decode out of the gather output, batched where formats batch: `BucketWires`,
`WireBatch`) and the fused split-copies of the copy-out (`ColumnCopy`, one
`split_with_sizes_copy` per run of uniform columns: planning/fused.py's
`SplitCopyOut`). Made once per layout at wrap time; every gather of a param goes
through them: the copy-in (also from an offloaded storage's staged copy), the
copy-out (forward, the regather in backward and an int reshard's gather from its
kept slice alike) and the whole-step graph's gather (runtime/traced.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch

from ..placements.contract import WireFormat
from ..placements.wire import Cast
from ..planning.copyplan import CopyPlan
from ..planning.fused import SplitCopyOut, TypedSplit
from ..planning.layout import typed_view
from ..planning.wire_plan import WirePlan


def split_views(buffer: torch.Tensor, split: TypedSplit) -> list:
    """The flat typed pieces of `buffer` (`split.nbytes` long: uint8, or already of
    a group's dtype, which then takes no view), in piece order."""
    out: list = [None] * split.count
    for dtype, sizes, picks in split.groups:
        chunks = (buffer if buffer.dtype == dtype else buffer.view(dtype)).split(sizes)
        for chunk, k in picks:
            out[k] = chunks[chunk]
    return out


class ColumnCopy(NamedTuple):
    """One run's split-copy: `rows` (its columns of the gathered buffer, [world, n])
    into `chunks` (views of a buffer of its own), split at `sizes`."""

    rows: torch.Tensor
    sizes: list
    chunks: list

    def run(self) -> None:
        torch.split_with_sizes_copy(self.rows, self.sizes, dim=1, out=self.chunks)


def column_copies(gathered: torch.Tensor, plan: SplitCopyOut, world_size: int) -> tuple:
    """(a ColumnCopy per run of `plan`, {region: its full tensor as [world, n]}), over
    `gathered` and new buffers, nothing copied yet: per run one buffer of its own,
    which one split_with_sizes_copy fills (the out= form: CUDA's one fused kernel,
    where the functional form clones chunk by chunk). An uneven region's column
    is padded: its full tensor is the column's first numel elements."""
    copies, out, typed = [], {}, {}
    for run in plan.runs:
        key = (run.dtype, run.base)
        if key not in typed:
            size = run.dtype.itemsize
            block = gathered[run.base:run.base + world_size * run.width * size]
            typed[key] = block.view(run.dtype).view(world_size, run.width)
        rows = typed[key]
        if run.start or run.stop != rows.shape[1]:
            rows = rows[:, run.start:run.stop]
        flat = torch.empty(world_size * (run.stop - run.start), dtype=run.dtype,
                           device=gathered.device)
        chunks = [c.view(world_size, n) for c, n in
                  zip(flat.split([world_size * n for n in run.sizes]), run.sizes)]
        copies.append(ColumnCopy(rows, list(run.sizes), chunks))
        for chunk, j in run.picks:
            out[j] = chunks[chunk]
    return copies, out


def copy_out_columns(gathered: torch.Tensor, plan: SplitCopyOut, world_size: int) -> dict:
    """{region: its full tensor as [world, n]} for the regions of `plan`'s runs,
    copied out of `gathered` into new buffers (column_copies, run)."""
    copies, out = column_copies(gathered, plan, world_size)
    for copy in copies:
        copy.run()
    return out


def column_full(column: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The full tensor of `shape` in a column of copy_out_columns: all of it, or (torch.chunk's
    uneven pieces, padded to the largest) its first elements."""
    numel = math.prod(shape)
    if column.numel() == numel:
        return column.view(shape)
    return column.view(-1)[:numel].view(shape)


class ParamWire:
    """One parameter's parts in one layout, for one rank: where its piece goes
    in the gather input (encode) and how the gathered parts become it (decode).
    Holds what its last encode returned for decode (a subclass's scale): a
    gather from an int reshard's kept slice decodes with its forward's."""

    def __init__(self, layout, wire: WirePlan, slot: int, rank: int) -> None:
        self.format = wire.formats[slot]
        regions = wire.regions(slot)
        self.region = regions[0]  # its first part's region in the layout
        self.copies = tuple(CopyPlan(layout, wire.slots[j], j) for j in regions)
        # (offset, dtype, shape) of this rank's piece of each part in its segment
        self._sends = tuple((layout.regions[j].offsets[rank], layout.regions[j].dtype,
                             wire.slots[j].local_shapes[rank]) for j in regions)
        self.cast = isinstance(self.format, Cast)
        self.meta = None

    def encode(self, send: torch.Tensor, piece: torch.Tensor, mesh=None) -> None:
        """Write this rank's sharded `piece` into the gather input `send` (its segment)."""
        self.meta = self.format.encode(piece, self.part_views(send), mesh)

    def part_views(self, send: torch.Tensor) -> list:
        """This rank's piece of each part in the gather input `send`, typed and shaped."""
        return [typed_view(send, start, dtype, shape) for start, dtype, shape in self._sends]

    def decode(self, gathered: torch.Tensor, view_ok: bool = True,
               columns: Optional[dict] = None) -> tuple:
        """(unsharded param, bytes copied out): a view of `gathered` when the
        format returns its part as is, the part's pieces lie back to back and
        `view_ok`; else a tensor of its own (from `columns` where they hold
        its parts: see fulls)."""
        first = self.copies[0]
        if self.cast:  # the common case, kept to one branch
            if first.span is not None and view_ok:
                return first.full(gathered), 0
            full = first.full(gathered, copy=True)
            return full, full.numel() * full.element_size()
        fulls = self.fulls(gathered, columns)
        return self.counted(self.format.decode(fulls, self.meta), fulls, gathered)

    def fulls(self, gathered: torch.Tensor, columns: Optional[dict] = None) -> list:
        """Each part's full tensor out of `gathered` (views where they can be),
        or out of its column where the bucket's fused copy-out made one
        (copy_out_columns: {region: column})."""
        columns = columns or {}
        return [column_full(columns[plan.region], plan.shape) if plan.region in columns
                else plan.full(gathered) for plan in self.copies]

    def counted(self, out: torch.Tensor, fulls: Sequence[torch.Tensor],
                gathered: torch.Tensor) -> tuple:
        """(out, bytes copied out to make it from `gathered` through `fulls`)."""
        if type(out) is not torch.Tensor:  # a subclass over the parts: count the parts copied
            return out, sum(f.numel() * f.element_size()
                            for f, plan in zip(fulls, self.copies) if plan.span is None)
        if out.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr():
            return out, 0  # the format handed back a view
        return out, math.prod(out.shape) * out.element_size()

    def traced(self, gathered: torch.Tensor) -> torch.Tensor:
        """decode for a traced region (no views, no counts)."""
        return self.format.decode([plan.traced_full(gathered) for plan in self.copies],
                                  self.meta)


def plan_param_wires(layout, wire: WirePlan, rank: int) -> "BucketWires":
    """A ParamWire per slot of `wire` over `layout`, batched where their
    formats allow (made at wrap time)."""
    params = tuple(ParamWire(layout, wire, i, rank) for i in range(len(wire.formats)))
    groups: dict = {}
    for i, fmt in enumerate(wire.formats):
        key = fmt.batch_key()
        if key is not None and type(fmt).encode_batch is WireFormat.encode_batch:
            raise NotImplementedError(
                f"parameter {wire.slots[wire.first[i]].fqn!r}: its wire format "
                f"{type(fmt).__name__} returns a batch_key but defines no encode_batch; "
                "define encode_batch (see fs.WireFormat), or return None from batch_key "
                "to encode each param alone")
        if key is not None:  # pieces of one dtype: a batch joins them in one op
            groups.setdefault((key, wire.dtypes[i] if wire.dtypes else None), []).append(i)
    batches = tuple(WireBatch(layout, wire, members, rank) for members in groups.values())
    return BucketWires(params, batches)


class BucketWires:
    """A bucket's ParamWires over one layout (iterable as them) and its batches:
    the encode of every param into the gather input and the decode of every
    unsharded param, a batch at a time where formats batch."""

    def __init__(self, params: tuple, batches: tuple) -> None:
        self.params, self.batches = params, batches
        batched = {i for b in batches for i in b.members}
        self.alone = tuple(i for i in range(len(params)) if i not in batched)

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def __getitem__(self, i: int) -> ParamWire:
        return self.params[i]

    def encode(self, send: torch.Tensor, pieces: Sequence[torch.Tensor], mesh=None,
               casts: bool = True) -> None:
        """Write this rank's sharded `pieces` (one per param) into `send`; not the
        Cast params' unless `casts` (the bucket copies those in one foreach copy:
        planning/fused.py's CopyInPlan)."""
        for i in self.alone:
            if casts or not self.params[i].cast:
                self.params[i].encode(send, pieces[i], mesh)
        for batch in self.batches:
            batch.encode(self.params, send, pieces, mesh)

    @property
    def encodes(self) -> bool:
        """Whether a param's format encodes itself (not a Cast)."""
        return bool(self.batches) or any(not self.params[i].cast for i in self.alone)

    def decode(self, gathered: torch.Tensor, view_ok: bool = True,
               done: Optional[dict] = None, columns: Optional[dict] = None) -> list:
        """(unsharded param, bytes copied out) per param, in order; those in
        `done` (param -> its pair, copied out by the bucket) as given; parts in
        `columns` (region -> column, copied out by the bucket) decoded from them."""
        out: list = [None] * len(self.params)
        for i in self.alone:
            out[i] = done[i] if done and i in done else \
                self.params[i].decode(gathered, view_ok, columns)
        for batch in self.batches:
            for i, done in zip(batch.members, batch.decode(self.params, gathered, columns)):
                out[i] = done
        return out


class WireBatch:
    """Params of one bucket whose formats encode together, for one rank: one
    encode_batch makes their parts as flat tensors, and each flat part goes
    into its pieces' places in the gather input in at most three ops
    (`_Scatter`), whatever the number of params."""

    def __init__(self, layout, wire: WirePlan, members: Sequence[int], rank: int) -> None:
        self.members = tuple(members)
        self.formats = tuple(wire.formats[i] for i in members)
        # params with bytes to send from this rank (an empty piece sends none)
        self.live = tuple(i for i in members
                          if any(layout.regions[j].nbytes[rank] for j in wire.regions(i)))
        parts = {len(wire.regions(i)) for i in members}
        if len(parts) != 1:
            raise AssertionError(f"a wire batch's formats make different numbers of parts: {parts}")
        self.writers = tuple(
            _Scatter([(layout.regions[j].offsets[rank], layout.regions[j].nbytes[rank])
                      for j in (wire.first[i] + k for i in self.live)])
            for k in range(parts.pop()))
        self.cache: dict = {}  # the format's index tensors, per device

    def encode(self, params: Sequence[ParamWire], send: torch.Tensor,
               pieces: Sequence[torch.Tensor], mesh) -> None:
        if not self.live:
            return
        live = [params[i].format for i in self.live]
        metas = None
        if send.device.type != "cpu":  # fused kernels are CUDA's: no views made for nothing
            metas = live[0].encode_batch_into(live, [pieces[i] for i in self.live],
                                              [params[i].part_views(send) for i in self.live],
                                              mesh, self.cache)
        if metas is not None:
            for i, meta in zip(self.live, metas):
                params[i].meta = meta
            return
        flats, metas = live[0].encode_batch(live, [pieces[i] for i in self.live], mesh, self.cache)
        for writer, flat in zip(self.writers, flats):
            writer.write(send, flat)
        for i, meta in zip(self.live, metas):
            params[i].meta = meta

    @property
    def decodes_into(self) -> bool:
        """Whether its format decodes into a buffer made once (make_out)."""
        return self.formats[0].decodes_into

    def make_out(self, params: Sequence[ParamWire], device: torch.device) -> tuple:
        """(flat buffer, each member's param viewing it) for decode's `out`."""
        shapes = [params[i].copies[0].shape for i in self.members]
        return self.formats[0].batch_out(self.formats, shapes, device)

    def decode(self, params: Sequence[ParamWire], gathered: torch.Tensor,
               columns: Optional[dict] = None, out: Optional[torch.Tensor] = None) -> list:
        """(param, bytes copied out) per member; into `out` (make_out's) if given."""
        wires = [params[i] for i in self.members]
        fulls = [w.fulls(gathered, columns) for w in wires]
        kwargs = {} if out is None else {"out": out}
        outs = self.formats[0].decode_batch(self.formats, fulls, [w.meta for w in wires],
                                            self.cache, **kwargs)
        return [w.counted(out, parts, gathered) for w, out, parts in zip(wires, outs, fulls)]


class _Scatter:
    """Writes a flat tensor's bytes into spans of a gather input, in order:
    one copy when the spans lie back to back, else one split of the bytes
    they cover (gaps included) and one split_with_sizes_copy into theirs."""

    def __init__(self, spans: Sequence[tuple]) -> None:
        spans = [(start, n) for start, n in spans if n]
        self.sizes = [n for _, n in spans]
        self.lo = min((s for s, _ in spans), default=0)
        self.hi = max((s + n for s, n in spans), default=0)
        by_start = sorted(range(len(spans)), key=lambda i: spans[i][0])
        self.chunks: Optional[list] = None  # byte sizes of [lo, hi) cut at every span
        if by_start != list(range(len(spans))) or sum(self.sizes) != self.hi - self.lo:
            self.chunks, self.index, at = [], [0] * len(spans), self.lo
            for i in by_start:
                start, n = spans[i]
                if start > at:
                    self.chunks.append(start - at)
                self.index[i] = len(self.chunks)
                self.chunks.append(n)
                at = start + n

    def write(self, send: torch.Tensor, flat: torch.Tensor) -> None:
        if not self.sizes:
            return
        data, region = flat.view(torch.uint8), send[self.lo:self.hi]
        if self.chunks is None:
            region.copy_(data)
            return
        views = region.split(self.chunks)
        torch.split_with_sizes_copy(data, self.sizes, out=[views[i] for i in self.index])
