"""A bucket's gather, in named steps: buffers (gather input and output), copy-in
(each param's wire format encodes its piece: a cast, or
an offloaded storage's H2D first), the all-gather on the gather stream, the
wait on the compute stream and the copy-out into unsharded params. `BucketGather`
owns every field of it: the gather layout and its copy plans, the reshard value
they depend on, a gather a prefetch launched, and an int reshard's kept slice.
It runs where its `DeviceSite` (comm.py) says at the moment of each call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.profiler import record_function

from ..compat import foreach_copy_, set_versions, tensor_version
from ..planning.bucket_plan import BucketLayouts, LayoutPlans
from ..planning.layout import BucketLayout
from ..planning.fused import CopyOutPlans, plan_copy_in, plan_copy_out
from ..planning.wire_plan import cast_wire
from .comm import (Comm, DeviceSite, HostContext, group_parts, hidden_from_checkpoint,
                   in_backward, on_stream)
from .counters import BucketCounters
from .inflight import PendingGather
from .storage import BucketStorage, segment_views
from .unsharded import (Forward, PostForwardShard, UnshardedParams, column_full, copy_out_columns,
                        keep_slice, output_parts, plan_param_wires, split_views, usable)


class BucketGather:
    """One bucket's all-gather of its storage (see the module docstring)."""

    def __init__(self, layouts: BucketLayouts, storage: BucketStorage, slots, rank: int,
                 world_size: int, group, comm: Comm, counters: BucketCounters, site: DeviceSite,
                 *, reshard_after_forward, offload=None, subgroups=None) -> None:
        self.storage, self.slots, self.rank, self.world_size = storage, tuple(slots), rank, world_size
        self.site = site  # the compute device and its streams
        self.group, self.comm, self.counters = group, comm, counters
        self.offload, self.subgroups = offload, subgroups
        self._layouts = layouts
        # a gather over the storage layout (fs.full_state_dict) sends each piece as it is
        self._storage_wire = cast_wire(self.slots, [s.dtype for s in self.slots], world_size)
        self.reshard_after_forward = reshard_after_forward
        self.inflight: Optional[PendingGather] = None  # a launched, unconsumed gather
        self._mesh = None  # shard_mesh(), made on first use
        self.post_forward: Optional[PostForwardShard] = None  # kept from forward for backward
        self._forward_gathered: Optional[torch.Tensor] = None  # until keep_post_forward_shard()
        # the gather layout's params made once and refilled in place (unsharded.py);
        # False: they cannot be (that layout gathers into new tensors each time)
        self.unsharded: Optional[UnshardedParams] = None
        self._in_place: Optional[bool] = None  # whether they can be, once known
        self._opened: Optional[Forward] = None  # the last open_forward's, until take_opened()
        # Looked up by identity (comparing layouts is O(ranks)).
        self._plans = {id(storage.layout): self._layout_plans(storage.layout)}
        self.layout = layouts.gather_for(reshard_after_forward)
        self._plans[id(self.layout)] = self._layout_plans(self.layout)

    def follow_reshard(self, value) -> None:
        """set_reshard_after_forward's part: what was launched or kept under the
        old value goes; an int's kept slice needs the padded gather layout
        (planning/bucket_plan.py, gathers_uneven), with params made anew."""
        self.discard()
        self.reshard_after_forward = value
        self.drop_forward_buffers()
        layout = self._layouts.gather_for(value)
        if layout is not self.layout:
            self.layout, self.unsharded, self._in_place = layout, None, None
            self._plans.setdefault(id(layout), self._layout_plans(layout))

    @property
    def padded_layout(self) -> BucketLayout:
        """The gather layout with no uneven group (planning/bucket_plan.py, gathers_uneven)."""
        return self._layouts.padded

    @property
    def padded_reduce_layout(self) -> BucketLayout:
        """The reduce layout with no uneven group (planning/bucket_plan.py): the
        whole-step graph's (runtime/traced.py), which reduces as it gathers."""
        return self._layouts.padded_reduce

    @property
    def wire(self):
        """What each slot sends in the gather layout (planning/wire_plan.py, WirePlan)."""
        return self._layouts.wire

    def _layout_plans(self, layout: BucketLayout) -> LayoutPlans:
        wire = self._storage_wire if layout is self.storage.layout else self._layouts.wire
        wires = plan_param_wires(layout, wire, self.rank)
        # the storage's bytes only when every piece is sent as it is (a cast to its own dtype)
        same = layout == self.storage.layout and all(w.cast for w in wires)
        is_storage = same and not self.storage.short
        copy_in = (0 if is_storage else self.storage.buffer.numel() if same
                   else sum(reg.nbytes[self.rank] for reg in layout.regions))
        fused_in = plan_copy_in(self.storage.layout, self.storage.buffer.numel(), layout, wire,
                                self.rank)
        return LayoutPlans(layout.keeps_views, wires,
                           any(w.format.needs_mesh for w in wires), is_storage, copy_in, same,
                           fused_in, self._copy_out_plans(layout, wires))

    @staticmethod
    def _copy_out_plans(layout: BucketLayout, wires) -> CopyOutPlans:
        """The fused copy-outs (planning/fused.py) of the cast params that are no
        view, and of every cast param; keyed by their region in the layout. Both
        take the parts of other formats (a float8 weight's data) that are no view:
        the format decodes them from their copied-out columns."""
        cast = [w for w in wires if w.cast]
        parts = [c.region for w in wires if not w.cast for c in w.copies if c.span is None]
        no_view = [w.region for w in cast if w.copies[0].span is None]
        return CopyOutPlans(plan_copy_out(layout, no_view + parts),
                            plan_copy_out(layout, [w.region for w in cast] + parts))

    def shard_mesh(self, device: torch.device):
        """The shard group as a 1-D DeviceMesh (a tensor subclass's gather
        reduces its scale over it); None at world size 1. Made on first use."""
        if self.world_size == 1 or self.group is None:
            return None
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.group, device.type)
        return self._mesh

    def plans_for(self, layout: BucketLayout) -> LayoutPlans:
        plans = self._plans.get(id(layout))
        return plans if plans is not None else self._layout_plans(layout)

    # The int reshard's kept slice (unsharded.py, PostForwardShard).

    @property
    def post_forward_size(self) -> Optional[int]:
        """N for an int reshard_after_forward N (1 < N < world_size), else None."""
        reshard = self.reshard_after_forward
        return None if isinstance(reshard, bool) else reshard

    def keep_post_forward_shard(self, for_backward: bool) -> None:
        """After the forward's gather: under an int reshard N, keep this rank's
        1/N of the gather output when a backward will regather from it
        (`for_backward`); then drop the gather output."""
        gathered = self._forward_gathered
        self.post_forward = None
        n = self.post_forward_size
        if for_backward and gathered is not None and n is not None:
            with record_function("FlexShard::post_forward_keep_slice"):
                self.post_forward = keep_slice(gathered, self.layout, self.rank, n,
                                               self.subgroups.of(self.rank, n),
                                               self.storage.buffer)
        self._drop_forward_gathered()

    def drop_forward_buffers(self) -> None:
        """Drop what the last forward's gather left: its gather output and the int
        reshard's kept slice (the params are held, or backward is done)."""
        self.post_forward = None
        self._drop_forward_gathered()

    def _drop_forward_gathered(self) -> None:
        gathered, self._forward_gathered = self._forward_gathered, None
        if self.unsharded is not None and gathered is self.unsharded.gathered:
            self.unsharded.free_gathered()

    # The params made once (unsharded.py).

    def in_place(self, layout: BucketLayout, device: torch.device) -> Optional[UnshardedParams]:
        """The params of `layout` made once, if it is the gather layout and they can
        be (made on first use; never at world size 1 without a cast, where the
        storage itself is the gather output). Not for a bucket that keeps its
        params until backward: its new tensors die as autograd lets go of them,
        some (an embedding's) right after forward, where a storage made once
        would stay until its node's backward."""
        if layout is not self.layout or self.reshard_after_forward is False:
            return None
        plans = self.plans_for(layout)
        if self._in_place is None:
            self._in_place = not (self.world_size == 1 and plans.is_storage
                                  and self.offload is None)
        if self._in_place and self.unsharded is None:
            self.unsharded = UnshardedParams(layout, plans, self.world_size, device, self.rank)
        return self.unsharded if self._in_place else None

    def drop_unsharded(self) -> None:
        """Forget the params made once (a device move): the next gather makes them
        again. Between steps, with no backward pending."""
        self.unsharded = None

    def free_unsharded(self) -> None:
        """Reshard the params made once: free their storages (unless a launched
        gather is writing them; its consumer fills them)."""
        unsharded = self.unsharded
        if unsharded is None:
            return
        if self.inflight is not None and self.inflight.gathered is unsharded.gathered:
            return
        unsharded.free()

    def open_forward(self) -> Optional[Forward]:
        """A grad-enabled forward just gathered into the params made once: what
        its backward will need (None when it gathered into new tensors); kept
        for take_opened()."""
        self._opened = None
        unsharded = self.unsharded
        if unsharded is not None and unsharded.filled:
            self._opened = Forward(unsharded, unsharded.version)
            unsharded.forwards.add(self._opened)
        return self._opened

    def take_opened(self) -> Optional[Forward]:
        """The last open_forward's Forward, once (the module hooks refill it), or None."""
        forward, self._opened = self._opened, None
        return forward

    def _source(self, layout: BucketLayout) -> Optional[PostForwardShard]:
        """The kept post-forward shard, when a gather in backward may start from it."""
        if layout is not self.layout or not in_backward():
            return None
        return usable(self.post_forward, self.storage.buffer)

    # Gathering.

    def gather(self, layout: Optional[BucketLayout] = None, new_tensors: bool = False) -> list:
        """One all-gather over the bucket; returns the unsharded tensors, typed
        by `layout` (the gather layout, i.e. param_dtype, by default): the
        params made once, refilled, where they can be and not `new_tensors`. Consumes
        a prefetched gather of the same layout when one is in flight."""
        layout, ctx, device = layout or self.layout, self.site.ctx, self.site.compute_device
        pending = self._take_inflight(layout, new_tensors) or \
            self._launch(layout, False, ctx, device, new_tensors)
        plans = self.plans_for(layout)
        self.wait_for(pending, ctx)
        if self.post_forward_size is not None and not in_backward() and layout is self.layout:
            self._forward_gathered = pending.gathered  # for keep_post_forward_shard()
        unsharded = self.unsharded
        with hidden_from_checkpoint(), record_function("FlexShard::all_gather_copy_out"):
            # hidden: recomputed anyway, skip the per-op Python dispatch
            if unsharded is not None and pending.gathered is unsharded.gathered:
                outs = unsharded.copy_out(pending.version)
                self.counters.copy_out_bytes += unsharded.copied_bytes
                if self._forward_gathered is not pending.gathered:
                    unsharded.free_gathered()
                return outs
            # views where the layout hands them out (a bucket that keeps its params
            # through backward over heavy padding copies them out: BucketLayout)
            return self._copy_out(pending.gathered, plans,
                                  layout.hands_out_views(self.reshard_after_forward))

    def _copy_out(self, gathered: torch.Tensor, plans: LayoutPlans, view_ok: bool) -> list:
        """The unsharded params from the gather output, on the compute stream: views
        where `view_ok` and the layout allow, one split-copy per run of uniform
        columns (planning/fused.py), the wire formats' decode for the rest."""
        fused = plans.copy_out.beside_views if view_ok else plans.copy_out.every_cast
        columns = copy_out_columns(gathered, fused, self.world_size) if fused.runs else {}
        done = {}
        for i, wire in enumerate(plans.wires):
            column = columns.get(wire.region) if wire.cast else None
            if column is not None:
                done[i] = (column_full(column, wire.copies[0].shape),
                           column.numel() * column.element_size())
        outs = []
        for full, copied in plans.wires.decode(gathered, view_ok, done, columns):
            self.counters.copy_out_bytes += copied
            outs.append(full)
        return outs

    def gather_pieces(self, pieces: list) -> list:
        """Full tensors from this rank's `pieces`, shaped and typed as the sharded
        params (None: zeros), in one all-gather over the storage layout (as
        fs.full_state_dict's): for sharded grads."""
        layout, device = self.storage.layout, self.site.compute_device
        plans = self.plans_for(layout)
        with torch.no_grad(), record_function("FlexShard::all_gather_pieces"):
            gathered = torch.zeros(layout.wire_bytes, dtype=torch.uint8, device=device)
            send = torch.zeros(layout.segment_bytes, dtype=torch.uint8, device=device)
            for wire, piece in zip(plans.wires, pieces):
                if piece is not None:
                    wire.encode(send, piece.to(device))
            if self.world_size > 1:
                self.comm.all_gather_groups(group_parts(gathered, layout.spans, self.world_size),
                                            group_parts(send, layout.spans), self.group)
            else:
                gathered = send
            return [wire.decode(gathered, False)[0] for wire in plans.wires]

    def wait_for(self, pending: PendingGather, ctx: HostContext) -> None:
        """Make the compute stream (the current one) wait for a launched gather.
        After this the gather input may be dropped (see PendingGather.send)."""
        ctx.wait(pending.done)
        if pending.work is not None:
            pending.work.wait()  # NCCL: the current stream waits; gloo: the host waits
        if pending.gathered_version is not None:  # into the params made once (unsharded.py):
            # its writes (the copy-in, the collective) are unseen by autograd
            set_versions((pending.gathered,), (pending.gathered_version,))
        stream = ctx.current()
        if stream != pending.stream:  # consumed under another stream than launched
            ctx.adopt(pending.gathered, stream)

    def start(self, new_tensors: bool = False) -> bool:
        """Launch the gather without waiting (prefetch); the next gather consumes it
        (one asking for the same `new_tensors`). False when there is nothing to launch."""
        if self.inflight is not None or self.world_size == 1:
            return False
        self.inflight = self._launch(self.layout, True, self.site.ctx, self.site.compute_device,
                                     new_tensors)
        self.counters.prefetches += 1
        return True

    def discard(self) -> None:
        """Drop a prefetched gather nobody consumed (waits for it first)."""
        pending, self.inflight = self.inflight, None
        if pending is None:
            return
        self.wait_for(pending, self.site.ctx)  # its buffers die on the compute stream's side
        if self.unsharded is not None and pending.gathered is self.unsharded.gathered:
            self.unsharded.free()  # written, never copied out
        self.counters.discarded_prefetches += 1

    def _take_inflight(self, layout: BucketLayout, new_tensors: bool) -> Optional[PendingGather]:
        pending = self.inflight
        if pending is None or pending.layout is not layout:
            return None
        made_once = self.unsharded is not None and pending.gathered is self.unsharded.gathered
        if new_tensors and made_once:
            self.discard()  # launched into the params made once; wanted apart from them
            return None
        if pending.version != tensor_version(self.storage.buffer):  # params written since launch
            self.discard()
            return None
        self.inflight = None
        return pending

    def _launch(self, layout: BucketLayout, async_op: bool, ctx: HostContext,
                device: torch.device, new_tensors: bool = False) -> PendingGather:
        """Copy-in (cast) on the copy-in stream, then the all-gather on the
        gather stream. Both buffers are allocated first, on the compute stream,
        and the side streams start after an event recorded after that. Into the
        params made once where they can be (unless `new_tensors`), unseen by autograd's
        version counters (unsharded.py)."""
        plans, version = self.plans_for(layout), tensor_version(self.storage.buffer)
        source = self._source(layout)  # int reshard, in backward
        unsharded = None if new_tensors else self.in_place(layout, device)
        with torch.no_grad(), hidden_from_checkpoint():
            send, gathered = self._buffers(layout, plans, source, device, unsharded)
            before = None if unsharded is None else tensor_version(gathered)
            work, done = self._fill(send, gathered, layout, plans, source, async_op, ctx)
        self._count(layout, source is not None, 0 if source is not None else plans.copy_in_bytes)
        return PendingGather(work if async_op else None, gathered, layout, version, send, done,
                             ctx.current(), before)

    def _count(self, layout: BucketLayout, post_forward: bool, copy_in: int) -> None:
        """One gather over `layout` in the bucket's counters (no wire at world size 1)."""
        counters = self.counters
        counters.gathers += 1
        counters.post_forward_gathers += post_forward
        counters.copy_in_bytes += copy_in
        if self.world_size > 1:
            counters.gather_wire_bytes += layout.wire_bytes
            counters.gather_ideal_bytes += layout.ideal_bytes

    def _fill(self, send, gathered, layout: BucketLayout, plans: LayoutPlans,
              source: Optional[PostForwardShard], async_op: bool, ctx: HostContext) -> tuple:
        """The copy-in and the all-gather of `_launch`: (work, done event)."""
        after = ready = ctx.record()  # the params' last writes (optimizer) and the allocations
        if source is None and (not plans.is_storage or self.offload is not None):
            with on_stream(ctx, ctx.copy_in, ready), \
                    record_function("FlexShard::all_gather_copy_in"):
                self._copy_in(send, layout, plans)
                after = ctx.record(ctx.copy_in)
        with on_stream(ctx, ctx.gather, after), record_function("FlexShard::all_gather"):
            work = self._all_gather(gathered, send, layout, source, async_op)
            return work, ctx.record(ctx.gather)

    def _all_gather(self, gathered, send, layout: BucketLayout,
                    source: Optional[PostForwardShard], async_op: bool):
        """The collective (None at world size 1) over the shard group (or the
        post-forward group, from the kept slice)."""
        if self.world_size == 1:
            return None
        group, ranks = (self.group, 1) if source is None else (source.group, source.ranks)
        unsharded = self.unsharded
        if unsharded is not None and gathered is unsharded.gathered:
            outputs = unsharded.gathered_parts
            inputs = (unsharded.send_parts if send is gathered
                      else group_parts(send, layout.spans, ranks))
        else:
            outputs = output_parts(gathered, layout)
            inputs = group_parts(send, layout.spans, ranks)
        # `uneven` only where a group is: a user's Comm may predate the argument
        uneven = {"uneven": layout.uneven} if any(layout.uneven) else {}
        return self.comm.all_gather_groups(outputs, inputs, group, async_op=async_op, **uneven)

    def _buffers(self, layout: BucketLayout, plans: LayoutPlans,
                 source: Optional[PostForwardShard], device: torch.device,
                 unsharded: Optional[UnshardedParams]) -> tuple:
        """(gather input, gather output), on the compute stream. The storage buffer
        is the gather input when it can be (no cast, not offloaded, not shorter
        than the segment); otherwise the copy-in writes this rank's segment of the
        gather output and the all-gather reads it there, in place (as FSDP2's), so
        no segment-sized temporary exists beside the output. The params made once hold
        this rank's ranges of their output and the copy-in's views of them (one range,
        or one per gather group); a new-tensor gather slices its one range, or copies in
        to a segment of its own where the layout has several groups. The output is
        that of the params made once (`unsharded`), reallocated, where they are."""
        send = self.storage.buffer if source is None else source.send
        copy_in = source is None and (not plans.is_storage or self.offload is not None)
        if unsharded is not None:
            unsharded.allocate()
            gathered = unsharded.gathered
        elif self.world_size == 1:
            gathered = send if not copy_in else torch.empty(layout.segment_bytes,
                                                            dtype=torch.uint8, device=device)
        else:
            gathered = torch.empty(layout.wire_bytes, dtype=torch.uint8, device=device)
        if self.world_size == 1:
            return (gathered if copy_in else send), gathered
        if copy_in and unsharded is not None and unsharded.send_parts is not None:
            send = gathered  # in place: the params made once hold the views of the segment
        elif copy_in and layout.split_segment:  # the segment is not one range of the output
            send = torch.empty(layout.segment_bytes, dtype=torch.uint8, device=device)
        elif copy_in:
            send = gathered[self.rank * layout.segment_bytes:][:layout.segment_bytes]
        return send, gathered

    def _copy_in(self, send: torch.Tensor, layout: BucketLayout, plans: LayoutPlans) -> None:
        """This rank's pieces, cast to the layout's dtypes: one foreach copy of
        the pieces sent as they are (planning/fused.py), an encode per param of
        other wire formats; without a cast, one copy of the storage buffer
        (shorter than `send`). An offloaded storage is first staged to the
        compute device (H2D): into `send` itself when no cast follows, else
        into a temporary of this stream."""
        fused, staged = plans.copy_in, None
        if self.offload is not None:
            into = send[:self.storage.buffer.numel()] if plans.same_bytes else None
            staged = self.offload.stage(self.storage.buffer, into)
            self.counters.h2d_bytes += staged.numel()
            if plans.same_bytes:
                return
        elif plans.same_bytes:  # a storage shorter than the segment: one copy, padded
            used = self.storage.buffer.numel()
            send[:used].copy_(self.storage.buffer)
            return
        if fused.cast:
            flat = self.storage.flat
            srcs = ([flat[i] for i in fused.cast] if staged is None
                    else split_views(staged, fused.src))
            unsharded = self.unsharded
            in_output = unsharded is not None and send is unsharded.gathered \
                and unsharded.copy_in_dst is not None  # in place, per group (_buffers)
            foreach_copy_(unsharded.copy_in_dst if in_output else split_views(send, fused.dst),
                          srcs)
        if plans.wires.encodes:  # the other formats, batched where they batch (unsharded.py)
            views = (self.storage.views if staged is None
                     else segment_views(staged, self.storage.layout, self.slots, self.rank))
            mesh = self.shard_mesh(send.device) if plans.needs_mesh else None
            plans.wires.encode(send, views, mesh, casts=False)
