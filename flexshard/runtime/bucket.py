"""One bucket's life: its sharded parameters, the one gather that unshards them
and the one reduce-scatter that hands back their gradients.

States: SHARDED -> UNSHARDING -> UNSHARDED -> SHARDED. Unsharded parameters
are made by `_Unshard` (unshard_node.py), an autograd Function whose backward
launches the bucket's gradient reduction; the model's ReduceQueue finishes it and the
bucket's GradRoute (delivery.py) hands the sharded gradients to `.grad`. A gather may be launched
early (`start_gather`, prefetch) and consumed by the next unshard.
"""

from __future__ import annotations

import enum
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.profiler import record_function

from ..compat import tensor_version
from ..config import MixedPrecisionPolicy, OffloadPolicy
from .comm import Comm
from ..planning.copyplan import plan_copies
from .dispatch import hidden_from_checkpoint
from .unshard_node import _Unshard
from .device import DeviceContexts, HostContext, on_stream
from ..planning.bucket_plan import (LayoutPlans, compact_gather, hooks_needed,
                                     plan_bucket_layouts)
from .counters import BucketCounters
from .grad_reduce import GradReduce
from .inflight import PendingGather, PendingReduce
from ..planning.layout import BucketLayout, SlotPlan
from .postforward import PostForwardShard, keep_slice, usable
from .delivery import GradRoute
from .offload import Offload
from .dtensor_param import wrap_unsharded
from .reduction import ReduceQueue, in_backward
from .storage import BucketStorage, gathered_param, moved_param, segment_views, typed_view

class BucketState(enum.Enum):
    SHARDED = "sharded"  # modules hold sharded parameters, no gather in flight
    UNSHARDING = "unsharding"  # the gather runs (a prefetched one lives in Bucket.inflight)
    UNSHARDED = "unsharded"  # modules hold unsharded parameters


class Bucket:
    """The sharded parameters of one BucketSpec and their collectives."""

    def __init__(self, name: str, slots: Sequence[SlotPlan], trainable: Sequence[bool],
                 mp: MixedPrecisionPolicy, reshard_after_forward,
                 group, rank: int, world_size: int, comm: Comm, device,
                 devices: Optional[DeviceContexts] = None, *,
                 replicate_group=None, replicate_size: int = 1, subgroups=None,
                 divide_factor: Optional[float] = None,
                 offload_policy: Optional[OffloadPolicy] = None) -> None:
        self.name, self.slots, self.mp = name, tuple(slots), mp
        self.reshard_after_forward = reshard_after_forward
        # group, rank, world_size: the shard group. Under HSDP the reduced
        # shards are then all-reduced across replicate_group (None: no replicas).
        self.group, self.rank, self.world_size, self.comm = group, rank, world_size, comm
        self.replicate_group, self.replicate_size = replicate_group, replicate_size
        self.subgroups = subgroups  # mesh.Subgroups of the shard group (int reshard)
        self.mesh = None  # its DeviceMesh (its own or the model's; None without a process group)
        self.post_forward: Optional[PostForwardShard] = None  # kept from forward for backward
        self._forward_gathered: Optional[torch.Tensor] = None  # until keep_post_forward_shard
        # Planned once; the gather layout is re-derived when a setter changes what it
        # depends on (set_reshard_after_forward: a compact gather only without an int).
        self._layouts = plan_bucket_layouts(slots, trainable, mp, world_size)
        self._uneven = world_size > 1 and comm.gathers_uneven(group, torch.device(device))
        layouts = compact_gather(self._layouts, reshard_after_forward, offload_policy is not None,
                                 self._uneven)
        # CPU offload: the storage lives in host memory, `device` is the compute device.
        self.offload = None if offload_policy is None else Offload(offload_policy, device)
        self.storage = BucketStorage(layouts.storage, slots, rank,
                                     device if self.offload is None else self.offload.storage_device)
        if self.offload is not None:
            self.storage.replace_buffer(self.offload.to_host(self.storage.buffer))
        self.gather_layout = layouts.gather
        self.grad_slots = [i for i, t in enumerate(trainable) if t]
        self.params = [nn.Parameter(v, requires_grad=t) for v, t in zip(self.storage.views, trainable)]
        self.state = BucketState.SHARDED
        self.regathered: Optional[list] = None  # backward's unsharded params (reshard.py)
        self.saved_in_forward: Optional[bool] = None  # autograd saved a param in the last
        # resharding forward our hooks saw (None: none seen yet); False: no regather in backward
        self.saved_version = -1  # storage version when its unsharded params were registered
        self.counters = BucketCounters()
        self.grads = GradReduce(layouts.reduce, slots, self.grad_slots, rank, world_size, group,
                                comm, self.counters, replicate_group=replicate_group,
                                replicate_size=replicate_size, divide_factor=divide_factor,
                                offload=self.offload)
        self.inflight: Optional[PendingGather] = None  # a launched, unconsumed gather
        self.reduce_queue = ReduceQueue()  # flex_shard shares one queue across buckets
        self.aliases: tuple = ()  # per slot: every (module, attr) registering it (see attach)
        self.tp_specs: Optional[tuple] = None  # per slot: a DTensor param's TPSpec, or None
        self.held: Optional[list] = None  # unsharded params held by module.unshard()
        self.used_in_nested_runner = False  # a param is used inside another bucket's module
        self.hold_handle = None  # the UnshardHandle of an unwaited module.unshard(async_op=True)
        self.grad_route = GradRoute()  # where this forward's reduced grads enter autograd
        self._held_version = -1
        self.devices = devices or DeviceContexts()  # streams, shared by a model's buckets
        # Decided at wrap time (and by set_reshard_after_forward); looked up by identity
        # (comparing layouts is O(ranks)).
        self._plans = {id(self.storage.layout): self._layout_plans(self.storage.layout)}
        self._use_gather_layout(self.gather_layout)

    def _use_gather_layout(self, layout: BucketLayout) -> None:
        """Gather over `layout` from now on, with its plans made here."""
        self.gather_layout = layout
        # a compact gather's broadcasts (one per non-empty segment), counted once here
        self._broadcasts = sum(1 for _, n in layout.segments or () if n)
        self._plans[id(layout)] = self._layout_plans(layout)

    def set_reshard_after_forward(self, value) -> None:
        """The setter's part in the bucket: what depended on the wrap-time value
        follows the new one. The gather layout is compact only where the value
        allows (an int slices equal segments after forward: compact_gather)."""
        self.assert_state(BucketState.SHARDED)
        self.discard_gather()  # launched over the old layout
        self.reshard_after_forward = value
        self.post_forward = self._forward_gathered = None
        gather = compact_gather(self._layouts, value, self.offload is not None,
                                self._uneven).gather
        if gather != self.gather_layout:
            self._use_gather_layout(gather)

    def _layout_plans(self, layout: BucketLayout) -> LayoutPlans:
        # a compact gather layout has the storage's bytes in a segment of another length
        same = layout._replace(segments=None) == self.storage.layout
        is_storage = same and not self.storage.short and layout.segments is None
        copy_in = (0 if is_storage else min(self.storage.buffer.numel(), layout.segment_len(self.rank))
                   if same else sum(reg.nbytes[self.rank] for reg in layout.regions))
        # kept params copy out where equal segments would pin padding, compact or not
        # (copies die one by one, views pin the whole output: design.md, "Compact gathers")
        pins = layout._replace(segments=None).pins_padding
        return LayoutPlans(layout.keeps_views, pins, plan_copies(layout, self.slots),
                           is_storage, copy_in, same)

    def _plans_for(self, layout: BucketLayout) -> LayoutPlans:
        plans = self._plans.get(id(layout))
        return plans if plans is not None else self._layout_plans(layout)

    @property
    def compute_device(self) -> torch.device:
        """Where the unsharded params and the collectives live: the storage's
        device, or the compute device of an offloaded bucket."""
        return self.storage.buffer.device if self.offload is None else self.offload.compute_device

    @property
    def device_ctx(self) -> HostContext:
        """Streams and events of the compute device."""
        return self.devices.get(self.compute_device)

    @property
    def needs_hooks(self) -> bool:
        """False at world size 1 without a cast or offload when every piece has
        the full shape: the sharded params are the full ones."""
        return hooks_needed(self.slots, self.mp, self.world_size, self.replicate_size,
                            self.offload is not None)

    @property
    def post_forward_size(self) -> Optional[int]:
        """N for an int reshard_after_forward N (1 < N < world_size), else None."""
        reshard = self.reshard_after_forward
        return None if isinstance(reshard, bool) else reshard

    def keep_post_forward_shard(self, keep: bool) -> None:
        """After the forward's gather (int reshard N): keep this rank's 1/N of
        the gather output for backward (postforward.py); else drop it."""
        gathered, self._forward_gathered = self._forward_gathered, None
        self.post_forward = None
        n = self.post_forward_size
        if keep and gathered is not None and n is not None:
            with record_function("FlexShard::post_forward_keep_slice"):
                self.post_forward = keep_slice(gathered, self.gather_layout, self.rank, n,
                                               self.subgroups.of(self.rank, n),
                                               self.storage.buffer)

    def _post_forward_source(self, layout: BucketLayout) -> Optional[PostForwardShard]:
        """The kept post-forward shard, when a gather in backward may start from it."""
        if layout is not self.gather_layout or not in_backward():
            return None
        return usable(self.post_forward, self.storage.buffer)

    def assert_state(self, *states: BucketState) -> None:
        if self.state not in states:
            raise AssertionError(f"bucket {self.name!r} is {self.state}, expected {states}")

    def check_apply(self, fn) -> None:
        """Refuse an nn.Module._apply `fn` that would change a param's dtype."""
        for slot in self.slots:
            probe = fn(torch.empty(0, dtype=slot.dtype, device=self.compute_device))
            if probe.dtype != slot.dtype:
                raise NotImplementedError(
                    f"parameter {slot.fqn!r} (bucket {self.name!r}) would change dtype from "
                    f"{slot.dtype} to {probe.dtype}; flex_shard fixes parameter dtypes at wrap "
                    "time: convert the module before flex_shard, or compute in another dtype "
                    "with MixedPrecisionPolicy(param_dtype=...)")

    def apply_to_storage(self, fn) -> None:
        """Move the storage as nn.Module._apply's `fn` moves tensors (to_empty,
        .to(device)); the sharded params become views of the new buffer (new
        nn.Parameter objects, as nn.Module makes for incompatible tensors)."""
        self.assert_state(BucketState.SHARDED)
        self.grads.move(fn)
        offload, old = self.offload, self.storage.buffer
        buffer = fn(old) if offload is None else offload.move(fn, old)
        if buffer is old:
            return
        self.storage.replace_buffer(buffer)
        grad_fn = fn if offload is None else offload.to_host  # offloaded grads stay on the host
        self.params = [moved_param(p, v, grad_fn) for p, v in zip(self.params, self.storage.views)]
        self.grad_route.clear()  # its _Deliver node takes the old params

    def load_full(self, fqn_to_tensor) -> None:
        """Copy this rank's piece of each full tensor into the sharded storage."""
        with torch.no_grad():
            for slot, view in zip(self.slots, self.storage.views):
                full = fqn_to_tensor(slot.fqn)
                view.copy_(slot.placement.shard(full.to(view.device), self.rank, self.world_size))

    def unshard(self) -> list:
        """Gather the bucket: unsharded parameters linked to the sharded ones by autograd."""
        self.assert_state(BucketState.SHARDED, BucketState.UNSHARDED)
        self._check_requires_grad()
        self.state = BucketState.UNSHARDING
        try:
            # _grad_anchor() may renew the route: it runs before forward reads its Delivery.
            outs = _Unshard.apply(self, self._grad_anchor())
        finally:
            self.state = BucketState.SHARDED
        self.state = BucketState.UNSHARDED
        return list(outs)

    def hold(self, outs: list) -> None:
        """module.unshard(): install `outs` as the unsharded params and keep them
        (this reference keeps the gather output alive) until release()."""
        self.assert_state(BucketState.UNSHARDED)
        # The sharded params are views of the buffer: an in-place step bumps this version.
        self.held, self._held_version = outs, tensor_version(self.storage.buffer)
        self._forward_gathered = None
        self.install(outs)

    def release(self) -> None:
        """module.reshard(): the sharded params back on the modules."""
        self.install_sharded()
        self.held = None
        self.mark_resharded()

    def check_held(self) -> None:
        """Refuse to run a forward on held params the shards no longer match."""
        if self.held is not None and self._held_version != tensor_version(self.storage.buffer):
            raise RuntimeError(
                f"bucket {self.name!r}: its sharded params changed (an optimizer step?) while "
                "module.unshard() held them unsharded; call module.reshard() before changing "
                "the params, then module.unshard() again")

    def _check_requires_grad(self) -> None:
        trainable = set(self.grad_slots)
        for i, (slot, param) in enumerate(zip(self.slots, self.params)):
            if param.requires_grad != (i in trainable):
                raise ValueError(
                    f"parameter {slot.fqn!r} (bucket {self.name!r}) changed requires_grad to "
                    f"{param.requires_grad} after flex_shard; the bucket's gradient layout is "
                    "fixed at wrap time, so set requires_grad before calling flex_shard")

    # The modules registering the params (tied aliases included).

    def attach(self, aliases: Sequence[Sequence[tuple]]) -> None:
        """Take each slot's (module, attr) aliases and install the sharded params there."""
        self.aliases = tuple(tuple(a) for a in aliases)
        self.install_sharded()

    def install(self, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        """Point every alias of each slot at the given unsharded tensor (a DTensor
        again for a TP slot; None unregisters)."""
        self._install(wrap_unsharded(self.tp_specs, tensors))

    def _install(self, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        for slot_aliases, tensor in zip(self.aliases, tensors):
            for module, attr in slot_aliases:
                # Straight into _parameters: setattr would refuse the unsharded
                # params, plain tensors (autograd outputs), in a Parameter's place.
                module._parameters[attr] = tensor

    def install_sharded(self) -> None:
        """Put the sharded params back on the modules."""
        self._install(self.params)

    def new_anchor(self) -> None:
        """Start a new route for this bucket's grads into autograd (at the
        start of each forward; see delivery.py)."""
        self.grad_route.renew(self.reduce_queue, self.params, bool(self.grad_slots),
                              self.compute_device)

    def _grad_anchor(self) -> torch.Tensor:
        """The input tying the unsharded params to this bucket's reduction."""
        return self.grad_route.anchor_for_unshard(self.reduce_queue, self.params,
                                                  bool(self.grad_slots), self.compute_device)

    # What the backward's autograd nodes and saved-tensor hooks change (unshard_node.py,
    # reshard.py): through these methods, never by writing the fields.

    def note_registered(self) -> int:
        """Forward registered the unsharded params with the saved-tensor hooks:
        nothing saved yet; returns the storage version they were gathered at."""
        self.saved_in_forward = False
        self.saved_version = tensor_version(self.storage.buffer)
        return self.saved_version

    def note_saved(self) -> None:
        """Autograd saved one of the unsharded params in this forward."""
        self.saved_in_forward = True

    def regather(self) -> tuple:
        """(the unsharded params backward uses, whether they were gathered now):
        one gather per backward, held until backward_done()."""
        if self.regathered is not None:
            return self.regathered, False
        with torch.no_grad():
            self.regathered = self.gather_params()
        return self.regathered, True

    def backward_done(self) -> None:
        """Backward no longer needs the regathered params nor the int reshard's slice."""
        self.regathered = None
        self.post_forward = None

    def mark_resharded(self) -> None:
        self.assert_state(BucketState.UNSHARDED, BucketState.SHARDED)
        self.state = BucketState.SHARDED

    # The two collectives.

    def gather_params(self, layout: Optional[BucketLayout] = None) -> list:
        """One all-gather over the bucket; returns the unsharded tensors, typed
        by `layout` (the gather layout, i.e. param_dtype, by default). Consumes
        a prefetched gather of the same layout when one is in flight."""
        layout = layout or self.gather_layout
        pending = self._take_inflight(layout) or self._launch(layout, async_op=False)
        plans = self._plans_for(layout)
        self._await_gather(pending)
        if self.post_forward_size is not None and not in_backward() and layout is self.gather_layout:
            self._forward_gathered = pending.gathered  # for keep_post_forward_shard
        outs = []
        # A bucket that keeps its unsharded params until backward would pin the gather
        # output's padding as long: its params are copied out when padding is heavy.
        kept = self.reshard_after_forward is False
        view_ok = plans.keeps_views and not (plans.pins_padding and kept)
        with hidden_from_checkpoint(), record_function("FlexShard::all_gather_copy_out"):
            # hidden: recomputed anyway, skip the per-op Python dispatch
            for i, slot in enumerate(self.slots):  # copy-out on the compute stream
                full, copied = gathered_param(pending.gathered, layout, slot, i,
                                              view_ok, plans.copies[i])
                self.counters.copy_out_bytes += copied
                outs.append(full)
        return outs

    def _await_gather(self, pending: PendingGather) -> None:
        """Make the compute stream (the current one) wait for a launched gather.
        After this the gather input may be dropped (see PendingGather.send)."""
        ctx = self.device_ctx
        ctx.wait(pending.done)
        if pending.work is not None:
            pending.work.wait()  # NCCL: the current stream waits; gloo: the host waits
        stream = ctx.current()
        if stream != pending.stream:  # consumed under another stream than launched
            ctx.adopt(pending.gathered, stream)

    def start_gather(self) -> bool:
        """Launch the bucket's gather without waiting (prefetch); the next
        unshard consumes it. Returns False when there is nothing to launch."""
        if self.inflight is not None or self.world_size == 1 or self.state is not BucketState.SHARDED:
            return False
        self.inflight = self._launch(self.gather_layout, async_op=True)
        self.counters.prefetches += 1
        return True

    def discard_gather(self) -> None:
        """Drop a prefetched gather nobody consumed (waits for it first)."""
        pending, self.inflight = self.inflight, None
        if pending is None:
            return
        self._await_gather(pending)  # its buffers die on the compute stream's side
        self.counters.discarded_prefetches += 1

    def _take_inflight(self, layout: BucketLayout) -> Optional[PendingGather]:
        pending = self.inflight
        if pending is None or pending.layout is not layout:
            return None
        if pending.version != tensor_version(self.storage.buffer):  # params written since launch
            self.discard_gather()
            return None
        self.inflight = None
        return pending

    def _launch(self, layout: BucketLayout, async_op: bool) -> PendingGather:
        """Copy-in (cast) on the copy-in stream, then the all-gather on the
        gather stream. Both buffers are allocated first, on the compute stream,
        and the side streams start after an event recorded after that."""
        ctx, plans, version = self.device_ctx, self._plans_for(layout), tensor_version(self.storage.buffer)
        source = self._post_forward_source(layout)  # int reshard, in backward
        with torch.no_grad(), hidden_from_checkpoint():
            send, gathered = self._gather_buffers(layout, plans, source)
            after = ready = ctx.record()  # the params' last writes (optimizer) and the allocations
            if source is None and (not plans.is_storage or self.offload is not None):
                with on_stream(ctx, ctx.copy_in, ready), \
                        record_function("FlexShard::all_gather_copy_in"):
                    self._copy_in(send, layout, plans)
                    after = ctx.record(ctx.copy_in)
            work = None
            with on_stream(ctx, ctx.gather, after), record_function("FlexShard::all_gather"):
                if self.world_size > 1 and layout.segments is not None:
                    work = self.comm.all_gather_segments(gathered, send, layout.segments,
                                                         self.group, async_op=async_op)
                elif self.world_size > 1:
                    group = self.group if source is None else source.group
                    work = self.comm.all_gather(gathered, send, group, async_op=async_op)
                done = ctx.record(ctx.gather)
        self.counters.count_gather(layout, self.world_size > 1, source is not None,
                                   0 if source is not None else plans.copy_in_bytes,
                                   self._broadcasts if layout.segments is not None else 0)
        return PendingGather(work if async_op else None, gathered, layout, version, send, done,
                             ctx.current())

    def _gather_buffers(self, layout: BucketLayout, plans: LayoutPlans,
                        source: Optional[PostForwardShard] = None) -> tuple:
        """(gather input, gather output), on the compute stream. The storage buffer
        is the gather input when it can be (no cast, not offloaded, not shorter
        than the segment); otherwise the copy-in writes this rank's segment of the
        gather output and the all-gather reads it there, in place (as FSDP2's), so
        no segment-sized temporary exists beside the output."""
        device = self.compute_device
        send = self.storage.buffer if source is None else source.send
        copy_in = source is None and (not plans.is_storage or self.offload is not None)
        if self.world_size == 1:
            if copy_in:
                send = torch.empty(layout.segment_bytes, dtype=torch.uint8, device=device)
            return send, send
        gathered = torch.empty(layout.wire_bytes, dtype=torch.uint8, device=device)
        if copy_in:
            start = layout.segment_start(self.rank)
            send = gathered[start:start + layout.segment_len(self.rank)]
        return send, gathered

    def _copy_in(self, send: torch.Tensor, layout: BucketLayout, plans: LayoutPlans) -> None:
        """This rank's pieces, cast to the layout's dtypes: one copy per param;
        without a cast, one copy of the storage buffer (shorter than `send`).
        An offloaded storage is first staged to the compute device (H2D): into
        `send` itself when no cast follows, else into a temporary of this stream."""
        views, used = self.storage.views, self.storage.buffer.numel()
        if self.offload is not None:
            into = send[:used] if plans.same_bytes else None
            staged = self.offload.stage(self.storage.buffer, into)
            self.counters.h2d_bytes += staged.numel()
            if plans.same_bytes:
                return
            views = segment_views(staged, self.storage.layout, self.slots, self.rank)
        if plans.same_bytes:  # a storage shorter than the segment: one copy, padded
            used = min(used, send.numel())  # a compact segment ends with this rank's pieces
            send[:used].copy_(self.storage.buffer[:used])
            return
        for reg, slot, view in zip(layout.regions, self.slots, views):
            typed_view(send, reg.offsets[self.rank], reg.dtype,
                       slot.local_shapes[self.rank]).copy_(view)

    # The gradient path (grad_reduce.py owns its fields and steps).

    @property
    def reduce_layout(self) -> BucketLayout:
        return self.grads.layout

    def start_reduce(self, grads: Sequence[Optional[torch.Tensor]]) -> Optional[PendingReduce]:
        """Pack the unsharded grads and launch their reduce-scatter on the
        reduce stream without waiting; None under no-sync (the packed grads are
        kept for later)."""
        packed = self.pack_reduce(grads)
        return None if packed is None else self.launch_reduce(packed)

    def pack_reduce(self, grads: Sequence[Optional[torch.Tensor]]) -> Optional[tuple]:
        """GradReduce.pack on this bucket's compute device."""
        return self.grads.pack(grads, self.device_ctx, self.compute_device)

    def launch_reduce(self, packed: tuple) -> PendingReduce:
        """GradReduce.launch of a packed reduce input."""
        return self.grads.launch(packed, self.device_ctx)

    def finish_reduce(self, pending: PendingReduce) -> list:
        """GradReduce.finish: the sharded grads per slot."""
        return self.grads.finish(pending, self.device_ctx, self.storage.buffer.device)

    def host_wait(self) -> None:
        """The host waits for the last D2H copy of this offloaded bucket's grads."""
        if self.offload is not None:
            self.device_ctx.synchronize(self.offload.grads_copied)
