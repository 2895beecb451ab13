"""A bucket's params between shard and module: how each crosses the wire, and the
unsharded params, made once per gather layout and refilled in place.

The wire (`ParamWire`, batched where formats batch: `BucketWires`, `WireBatch`):
each param's encode into the gather input and decode out of the gather output,
and the fused split-copies of the copy-out (`ColumnCopy`, one
`split_with_sizes_copy` per run of uniform columns: planning/fused.py's
`SplitCopyOut`), as planning/ planned them. Made once per layout at wrap time;
every gather of a param goes through them: the copy-in (also from an offloaded
storage's staged copy), the copy-out (forward, the regather in backward and an int
reshard's gather from its kept slice alike) and the whole-step graph's gather
(runtime/traced.py).

The unsharded params follow FSDP2's design: the gather output, the fused copy-out's buffers (planning/fused.py),
a quantized gather's decode buffer (placements/quantized.py, `decodes_into`) and
the unsharded params as views of them are made on the bucket's first gather
and kept. Each gather writes into them; resharding frees their storages
(`resize_(0)`: the tensors, and every view of them autograd saved, stay) and the
next gather reallocates them. No view is made per gather.

So resharding after forward needs no saved-tensor hooks: autograd keeps what it
saved, over freed storage, and a hook on the block's forward outputs refills it
before the block's backward runs (runtime/hooks.py). Autograd's version check
does not see the refill: the copy-out writes under `preserve_versions`, and the
gather output's version is set back once its collective is waited for. Each
grad-enabled forward that backward may reach is a `Forward` here (the sharded
storage version it gathered, held by its graph's unshard node): backward refills
the version a forward needs or refuses a stale one, and the storages are freed
once no forward awaiting backward needs them.

Any other format's param is made by its first decode and renewed by each later
one (`WireFormat.refill`) from its parts' tensors made once (views of the gather
output or of a column, else buffers its copy plan writes): a tensor subclass's
(torchao's float8 weight) through FSDP2's fsdp_post_all_gather(out=), which renews
the scale only, any other decoded anew and copied into the first one's tensor. So
every resharding bucket refills params made once; a bucket that keeps its params
until backward gathers new tensors, which autograd frees once unneeded
(runtime/gather.py, in_place).

`PostForwardShard`: under an int reshard_after_forward N (FSDP2's "reshard to a
smaller group"), what a rank keeps of a bucket's forward gather for backward.
The shard group's S ranks form S/N post-forward groups of N consecutive ranks.
Rank r, index i = r mod N in its group, keeps segments i*S/N .. (i+1)*S/N - 1
of each gather group's block of the gather output; the group's all-gather of
those slices, rank-major per gather group, is the whole gather output again, so
backward's regather stays within N ranks.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple, Optional, Sequence

import torch

from ..compat import preserve_versions, tensor_version
from ..placements.contract import WireFormat
from ..placements.wire import Cast
from ..planning.bucket_plan import LayoutPlans
from ..planning.copyplan import CopyPlan
from ..planning.fused import SplitCopyOut, TypedSplit
from ..planning.layout import BucketLayout, typed_view
from ..planning.wire_plan import WirePlan
from .comm import group_parts


class Forward:
    """One grad-enabled forward of a bucket: the params made once it gathered into
    and the version of the sharded storage it gathered (its backward needs those)."""

    __slots__ = ("params", "version", "__weakref__")

    def __init__(self, params: "UnshardedParams", version: int) -> None:
        self.params, self.version = params, version


def _runs(plans: LayoutPlans):
    """The fused copy-out of a resharding bucket: params view the gather output
    where the layout keeps views (no padding is pinned past forward)."""
    return (plans.copy_out.beside_views if plans.keeps_views
            else plans.copy_out.every_cast)


def _decoded(plans: LayoutPlans) -> dict:
    """{param index: its batch} of the params whose format decodes into a buffer
    made once (a quantized gather's: placements/quantized.py)."""
    return {i: batch for batch in plans.wires.batches if batch.decodes_into
            for i in batch.members}


def _refilled(plans: LayoutPlans, decoded: dict) -> list:
    """The params of the other formats: made by their first decode, renewed by each
    later one (WireFormat.refill: a tensor subclass's in place, else decoded anew
    and copied into the first one's tensor)."""
    return [i for i, w in enumerate(plans.wires) if not w.cast and i not in decoded]


def _copied(plans: LayoutPlans, columns: dict) -> list:
    """The cast params neither viewing the gather output nor in a fused run: each
    copied by its own copy plan (planning/copyplan.py) into a tensor made once."""
    return [i for i, w in enumerate(plans.wires) if w.cast and w.region not in columns
            and not (plans.keeps_views and w.copies[0].span is not None)]


class UnshardedParams:
    """The gather output, the copy-out buffers and the params over them (see the
    module docstring); made with their storages freed."""

    def __init__(self, layout: BucketLayout, plans: LayoutPlans, world_size: int,
                 device: torch.device, rank: int) -> None:
        self.gathered = torch.empty(layout.wire_bytes, dtype=torch.uint8, device=device)
        # what each gather group's collective writes, made once as the params are, and
        # the gather inputs (this rank's range of each group: several ranges of the output
        # with several groups) with the copy-in's destinations in them, so a gather makes
        # no view of its own (a slice and a split per gather, 5 ops, on every rank whose
        # segment is one range: every Owned bucket)
        self.gathered_parts = output_parts(self.gathered, layout)
        self.send_parts = self.copy_in_dst = None
        # a format that encodes writes its segment offsets: it gets a segment of its own
        if not plans.same_bytes and not plans.wires.encodes:
            self.send_parts = [part[slice(*layout.rank_part(g, rank))]
                               for g, part in enumerate(self.gathered_parts)]
            self.copy_in_dst = split_views(self.gathered, plans.copy_in.in_output)
        runs = _runs(plans)
        self._copies, self._columns = (column_copies(self.gathered, runs, world_size) if runs.runs
                                       else ((), {}))
        columns, decoded = self._columns, _decoded(plans)
        own, self._refilled = _copied(plans, columns), _refilled(plans, decoded)
        self.params = [None if i in decoded or i in own or i in self._refilled else
                       column_full(columns[w.region], w.copies[0].shape) if w.region in columns
                       else w.copies[0].full(self.gathered) for i, w in enumerate(plans.wires)]
        # a tensor of its own per such param (and per part of a refilled param that is
        # no view: _made_fulls), refilled by its copy plan
        copied = [plans.wires[i].copies[0] for i in own]
        self._own = [(plan, torch.empty(plan.shape, dtype=plan.dtype, device=device))
                     for plan in copied]
        for i, (_, out) in zip(own, self._own):
            self.params[i] = out
        self._fulls = {i: self._made_fulls(plans.wires[i], device) for i in self._refilled}
        # each decoding batch's buffer, its params views of it (refilled by its decode)
        self._wires, self._decodes = plans.wires, []
        for batch in {id(b): b for b in decoded.values()}.values():
            out, views = batch.make_out(plans.wires, device)
            self._decodes.append((batch, out))
            for i, view in zip(batch.members, views):
                self.params[i] = view
        outs = [out for _, out in self._decodes] + [out for _, out in self._own]
        # what each gather writes: the columns, the decoded and copied params, and the
        # parts of decoded params that are no view and in no column (new each gather)
        self.copied_bytes = sum(t.numel() * t.element_size() for t in
                                list(columns.values()) + outs) + sum(
            math.prod(c.shape) * c.dtype.itemsize for i in decoded for c in plans.wires[i].copies
            if c.span is None and c.region not in columns)
        # the gather output stays only while a param views it
        self.views_gathered = any(
            c.region not in columns and (i not in self._refilled or c.span is not None)
            for i, w in enumerate(plans.wires) if i not in decoded and i not in own
            for c in w.copies)
        flats = [copy.chunks[0] for copy in self._copies] + outs
        self._versioned = tuple([self.gathered] + flats)
        self._storages = [(t.untyped_storage(), t.untyped_storage().nbytes())
                          for t in self._versioned]
        self.version = None  # the sharded storage version the buffers hold; None: freed
        self.forwards: weakref.WeakSet = weakref.WeakSet()  # awaiting backward
        self.free()

    @property
    def filled(self) -> bool:
        return self.version is not None

    def allocate(self) -> None:
        """Reallocate the gather output: a gather is about to write it, and until
        its copy-out the params hold no version. The copy-out's buffers wait for
        the copy-out (a prefetched gather holds only its output, as a new one would)."""
        self.version = None
        self._allocate(self._storages[:1])

    @staticmethod
    def _allocate(storages) -> None:
        for storage, nbytes in storages:
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)

    def copy_out(self, version: int) -> list:
        """The fused copy-out of the gathered buffer into the params' buffers
        (unseen by autograd's version counters); the buffers now hold `version`."""
        self._allocate(self._storages[1:])
        with preserve_versions(self._versioned):
            for copy in self._copies:
                copy.run()
            for plan, out in self._own:
                plan.full_into(self.gathered, out)
            for batch, out in self._decodes:
                batch.decode(self._wires, self.gathered, self._columns, out)
            self._refill()
        self.version = version
        return list(self.params)

    def _made_fulls(self, wire: "ParamWire", device: torch.device) -> list:
        """Each part's full tensor for a refilled param, made once: a view of the
        gather output or of its column, else (an index or runs plan: Shard(d>0), an
        uneven RaggedShard) a buffer of its own that the copy-out writes through its
        copy plan (`_own`). The param its first decode makes holds these tensors, and
        a later refill may renew only its metadata: torchao's fsdp_post_all_gather(out=)
        sets the scale and leaves the fp8 data where the first gather put it, as FSDP2
        writes each gather into the same buffer. A buffer here costs no copy a new
        tensor per gather would not (CopyPlan.full_into is the copy full makes)."""
        def own(plan) -> torch.Tensor:
            self._own.append((plan, torch.empty(plan.shape, dtype=plan.dtype, device=device)))
            return self._own[-1][1]

        return wire.fulls(self.gathered, self._columns, own)

    def _refill(self) -> None:
        """The other formats' params: made by the first decode, renewed after, from
        their parts' tensors made once (_made_fulls). A param over a storage of its own
        (not the gather output's, not a column's) joins the storages freed on reshard
        and reallocated before each refill."""
        for i in self._refilled:
            wire, fulls = self._wires[i], self._fulls[i]
            if self.params[i] is not None:
                wire.format.refill(fulls, wire.meta, self.params[i])
                continue
            param = self.params[i] = wire.format.decode(fulls, wire.meta)
            known = {storage.data_ptr() for storage, _ in self._storages}
            if type(param) is torch.Tensor and param.untyped_storage().data_ptr() not in known:
                self._versioned += (param,)
                self._storages.append((param.untyped_storage(), param.untyped_storage().nbytes()))

    def free_gathered(self) -> None:
        """Free the gather output once copied out (and an int reshard's slice cut
        from it), unless a param views it."""
        if not self.views_gathered:
            self._storages[0][0].resize_(0)

    def free(self) -> None:
        for storage, _ in self._storages:
            if storage.nbytes():
                storage.resize_(0)
        self.version = None

    def allocated_bytes(self) -> int:
        """Bytes its storages hold now (0 when freed)."""
        return sum(storage.nbytes() for storage, _ in self._storages)

    def awaiting_backward(self) -> bool:
        """Whether a forward whose graph is alive still waits for its backward."""
        return len(self.forwards) > 0


class PostForwardShard(NamedTuple):
    """This rank's 1/N of a forward's gather output, kept for backward."""

    send: torch.Tensor  # its S/N segments of the gather output (gather layout), per group
    group: Any  # the N consecutive shard ranks backward all-gathers within
    version: int  # storage version at forward: a later write makes it stale
    ranks: int  # S/N: how many ranks' segments `send` holds


def keep_slice(gathered: torch.Tensor, layout: BucketLayout, rank: int, n: int, group,
               storage: torch.Tensor) -> PostForwardShard:
    """The slice of `gathered` rank `rank` keeps in its post-forward group of `n`: of
    each gather group's block, the S/N segments of that group's share (one copy)."""
    if any(sizes is not None for sizes in layout.uneven):
        raise AssertionError("an int reshard_after_forward gathers over the padded layout "
                             "(BucketLayouts.gather_for)")
    ranks = layout.world_size // n
    first = (rank % n) * ranks
    parts = [block.view(layout.world_size, -1)[first:first + ranks].reshape(-1)
             for block in group_parts(gathered, layout.spans, layout.world_size)]
    kept = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
    return PostForwardShard(kept, group, tensor_version(storage), ranks)


def usable(shard: Optional[PostForwardShard], storage: torch.Tensor) -> Optional[PostForwardShard]:
    """`shard` while the sharded params are still those it was cut from."""
    if shard is None or shard.version != tensor_version(storage):
        return None
    return shard


def output_parts(gathered: torch.Tensor, layout: BucketLayout) -> list:
    """The gather output (or reduce input: typed) cut into its gather groups'
    blocks (one split)."""
    if len(layout.spans) == 1:
        return [gathered]
    size = gathered.element_size()
    return list(gathered.split([b // size for b in layout.block_bytes]))


# The wire: each param's encode, decode and copy-out.

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

    def fulls(self, gathered: torch.Tensor, columns: Optional[dict] = None, own=None) -> list:
        """Each part's full tensor out of `gathered` (views where they can be),
        or out of its column where the bucket's fused copy-out made one
        (copy_out_columns: {region: column}); a part that is no view is a new
        tensor, or `own(plan)`, a buffer the caller makes once and refills."""
        columns = columns or {}
        return [column_full(columns[plan.region], plan.shape) if plan.region in columns
                else plan.full(gathered) if own is None or plan.span is not None
                else own(plan) for plan in self.copies]

    def counted(self, out: torch.Tensor, fulls: Sequence[torch.Tensor],
                gathered: torch.Tensor) -> tuple:
        """(out, bytes copied out to make it from `gathered` through `fulls`)."""
        if type(out) is not torch.Tensor:  # a subclass over the parts: count the parts copied
            return out, sum(f.numel() * f.element_size()
                            for f, plan in zip(fulls, self.copies) if plan.span is None)
        if out.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr():
            return out, 0  # the format handed back a view
        # a decoded param: its output, and each part that is no view (a column or a copy)
        return out, math.prod(out.shape) * out.element_size() + (0 if self.cast else sum(
            f.numel() * f.element_size() for f, plan in zip(fulls, self.copies)
            if plan.span is None))


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
