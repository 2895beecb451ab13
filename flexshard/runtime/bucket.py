"""One bucket's life: its sharded parameters, the one gather that unshards them
and the one reduce-scatter that hands back their gradients.

States: SHARDED -> UNSHARDING -> UNSHARDED -> SHARDED. Unsharded parameters
are made by `_Unshard`, an autograd Function whose backward launches the
bucket's gradient reduction; the model's ReduceQueue finishes it and
accumulates the sharded gradients into `.grad`. A gather may be launched
early (`start_gather`, prefetch) and consumed by the next unshard.
"""

from __future__ import annotations

import enum
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _pop_mode, _push_mode
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

from ..config import MixedPrecisionPolicy
from .comm import Comm
from .layout import BucketLayout, SlotPlan, plan_layout
from .reduction import ReduceQueue, deliver_anchor
from .storage import BucketStorage, gathered_param, typed_view


class BucketState(enum.Enum):
    SHARDED = "sharded"  # modules hold sharded parameters, no gather in flight
    UNSHARDING = "unsharding"  # the gather runs (a prefetched one lives in Bucket.inflight)
    UNSHARDED = "unsharded"  # modules hold unsharded parameters


class PendingGather(NamedTuple):
    """A launched all-gather whose output is not yet consumed."""

    work: Any  # dist.Work, or None when the gather already finished
    gathered: torch.Tensor  # the gather output
    layout: BucketLayout
    version: int  # storage version at launch: a later write makes it stale


class PendingReduce(NamedTuple):
    """A launched reduce-scatter whose sharded grads are not yet delivered."""

    work: Any  # dist.Work, or None at world size 1
    output: torch.Tensor  # the reduce-scatter output (this rank's segment)


_SAC_MODES = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)


@contextmanager
def _hidden_from_checkpoint():
    """Run a gather's ops outside selective-checkpoint dispatch modes.

    Selective activation checkpointing replays ops by (op, call index), so the
    forward and the recompute must issue the same ops. A gather may be launched
    early (prefetch) in one and on demand in the other, so launching never shows
    to those modes; other dispatch modes (CommDebugMode, user modes) still see it.
    """
    depth = torch._C._len_torch_dispatch_stack()
    stack = [torch._C._get_dispatch_stack_at(i) for i in range(depth)]
    if not any(isinstance(m, _SAC_MODES) for m in stack):
        yield
        return
    for _ in stack:
        _pop_mode()
    kept = [m for m in stack if not isinstance(m, _SAC_MODES)]
    for m in kept:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for m in stack:
            _push_mode(m)


@dataclass
class BucketCounters:
    """Bytes a bucket moved and copied, since the counters were last reset."""

    gathers: int = 0
    reduces: int = 0
    prefetches: int = 0  # gathers launched ahead of use (counted in gathers too)
    discarded_prefetches: int = 0  # prefetched gathers dropped unused
    gather_wire_bytes: int = 0
    gather_ideal_bytes: int = 0
    reduce_wire_bytes: int = 0
    reduce_ideal_bytes: int = 0
    copy_in_bytes: int = 0
    copy_out_bytes: int = 0


def _gather_dtype(slot: SlotPlan, mp: MixedPrecisionPolicy) -> torch.dtype:
    if mp.param_dtype is not None and slot.dtype.is_floating_point:
        return mp.param_dtype
    return slot.dtype


def _reduce_dtype(slots: Sequence[SlotPlan], mp: MixedPrecisionPolicy) -> torch.dtype:
    if mp.reduce_dtype is not None:
        return mp.reduce_dtype
    if mp.param_dtype is not None:
        return mp.param_dtype
    dtype = slots[0].dtype if slots else torch.float32
    for s in slots[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    return dtype


class BucketLayouts(NamedTuple):
    """A bucket's three byte plans over the same slots."""

    storage: BucketLayout  # the sharded params, in their own dtypes
    gather: BucketLayout  # the all-gather (param_dtype on the wire)
    reduce: BucketLayout  # the reduce-scatter of the trainable slots (one reduce dtype)


def plan_bucket_layouts(slots: Sequence[SlotPlan], trainable: Sequence[bool],
                        mp: MixedPrecisionPolicy, world_size: int) -> BucketLayouts:
    """The layouts a Bucket of `slots` uses; the dry run (planning/dryrun.py) reads the same."""
    grads = [s for s, t in zip(slots, trainable) if t]
    reduce_dtype = _reduce_dtype(grads, mp)
    return BucketLayouts(plan_layout(slots, [s.dtype for s in slots], world_size),
                         plan_layout(slots, [_gather_dtype(s, mp) for s in slots], world_size),
                         plan_layout(grads, [reduce_dtype] * len(grads), world_size))


def needs_hooks(slots: Sequence[SlotPlan], storage: BucketLayout, gather: BucketLayout,
                world_size: int) -> bool:
    """False at world size 1 without a cast when every piece has the full
    shape: the sharded params are the full ones."""
    return (world_size > 1 or gather != storage
            or any(s.local_shapes[0] != s.shape for s in slots))


class Bucket:
    """The sharded parameters of one BucketSpec and their collectives."""

    def __init__(self, name: str, slots: Sequence[SlotPlan], trainable: Sequence[bool],
                 mp: MixedPrecisionPolicy, reshard_after_forward: bool,
                 group, rank: int, world_size: int, comm: Comm, device) -> None:
        self.name, self.slots, self.mp = name, tuple(slots), mp
        self.reshard_after_forward = reshard_after_forward
        self.group, self.rank, self.world_size, self.comm = group, rank, world_size, comm
        layouts = plan_bucket_layouts(slots, trainable, mp, world_size)
        self.storage = BucketStorage(layouts.storage, slots, rank, device)
        self.gather_layout, self.reduce_layout = layouts.gather, layouts.reduce
        self.grad_slots = [i for i, t in enumerate(trainable) if t]
        self.params = [nn.Parameter(v, requires_grad=t) for v, t in zip(self.storage.views, trainable)]
        self.state = BucketState.SHARDED
        self.gathering = False  # true while the gather runs: the recompute policy reads it
        self.requires_gradient_sync = True
        self.gradient_divide_factor = float(world_size)  # reduced grads are divided by it (mean)
        self.pending_grads: Optional[torch.Tensor] = None  # unreduced no-sync sum
        self.counters = BucketCounters()
        self.inflight: Optional[PendingGather] = None  # a launched, unconsumed gather
        self.reduce_queue = ReduceQueue()  # flex_shard shares one queue across buckets
        self.pinned: Optional[list] = None  # unsharded params held by module.unshard()
        self.used_in_nested_runner = False  # a param is used inside another bucket's module
        self.pin_handle = None  # the UnshardHandle of an unwaited module.unshard(async_op=True)
        self._anchor: Optional[torch.Tensor] = None  # see _grad_anchor
        self._pinned_version = -1
        self._keeps_views = {lay: lay.keeps_views  # decided once, at wrap time
                             for lay in (self.storage.layout, self.gather_layout)}

    @property
    def needs_hooks(self) -> bool:
        return needs_hooks(self.slots, self.storage.layout, self.gather_layout, self.world_size)

    def assert_state(self, *states: BucketState) -> None:
        if self.state not in states:
            raise AssertionError(f"bucket {self.name!r} is {self.state}, expected {states}")

    def check_apply(self, fn) -> None:
        """Refuse an nn.Module._apply `fn` that would change a param's dtype."""
        for slot in self.slots:
            probe = fn(torch.empty(0, dtype=slot.dtype, device=self.storage.buffer.device))
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
        buffer = fn(self.storage.buffer)
        if buffer is self.storage.buffer:
            return
        self.storage.replace_buffer(buffer)
        self.params = [_moved_param(p, v, fn) for p, v in zip(self.params, self.storage.views)]
        if self.pending_grads is not None:
            self.pending_grads = fn(self.pending_grads)
        self._anchor = None

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
            outs = _Unshard.apply(self, self._grad_anchor())
        finally:
            self.state = BucketState.SHARDED
        self.state = BucketState.UNSHARDED
        return list(outs)

    def pin(self, outs: list) -> None:
        """Hold `outs` as the unsharded params until unpin (module.unshard())."""
        self.assert_state(BucketState.UNSHARDED)
        self.pinned, self._pinned_version = outs, self.storage.buffer._version

    def unpin(self) -> None:
        self.pinned = None
        self.mark_resharded()

    def check_pinned(self) -> None:
        """Refuse to run a forward on pinned params the shards no longer match."""
        if self.pinned is not None and self._pinned_version != self.storage.buffer._version:
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

    def new_anchor(self) -> None:
        """Start a new route for this bucket's grads into autograd (at the
        start of each forward under grad; see reduction.py)."""
        self._anchor = None
        if self.grad_slots and torch.is_grad_enabled():
            self._anchor = deliver_anchor(self.reduce_queue, self.params)

    def _grad_anchor(self) -> torch.Tensor:
        """The input tying the unsharded params to this bucket's reduction."""
        if self._anchor is None or self._anchor[1].device != self.storage.buffer.device:
            self.new_anchor()
        if self._anchor is None:
            return torch.empty(0, device=self.storage.buffer.device)
        return self._anchor[1]

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
        self.gathering = True
        try:
            if pending.work is not None:
                pending.work.wait()
            outs, view_ok = [], self._keeps_views[layout]
            with _hidden_from_checkpoint():  # recomputed anyway: skip the per-op Python dispatch
                for i, slot in enumerate(self.slots):
                    full, copied = gathered_param(pending.gathered, layout, slot, i, view_ok)
                    self.counters.copy_out_bytes += copied
                    outs.append(full)
        finally:
            self.gathering = False
        return outs

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
        if pending.work is not None:
            pending.work.wait()
        self.counters.discarded_prefetches += 1

    def _take_inflight(self, layout: BucketLayout) -> Optional[PendingGather]:
        pending = self.inflight
        if pending is None or pending.layout != layout:
            return None
        if pending.version != self.storage.buffer._version:  # params written since launch
            self.discard_gather()
            return None
        self.inflight = None
        return pending

    def _launch(self, layout: BucketLayout, async_op: bool) -> PendingGather:
        version = self.storage.buffer._version
        with torch.no_grad(), _hidden_from_checkpoint():
            send = self._gather_input(layout)
            work = None
            if self.world_size == 1:
                gathered = send
            else:
                gathered = torch.empty(layout.wire_bytes, dtype=torch.uint8, device=send.device)
                work = self.comm.all_gather(gathered, send, self.group, async_op=async_op)
        self.counters.gathers += 1
        self.counters.gather_wire_bytes += layout.wire_bytes if self.world_size > 1 else 0
        self.counters.gather_ideal_bytes += layout.ideal_bytes if self.world_size > 1 else 0
        return PendingGather(work if async_op else None, gathered, layout, version)

    def _gather_input(self, layout: BucketLayout) -> torch.Tensor:
        if layout == self.storage.layout:
            return self.storage.buffer
        send = torch.empty(layout.segment_bytes, dtype=torch.uint8,
                           device=self.storage.buffer.device)
        for reg, slot, view in zip(layout.regions, self.slots, self.storage.views):
            typed_view(send, reg.offsets[self.rank], reg.dtype,
                       slot.local_shapes[self.rank]).copy_(view)
            self.counters.copy_in_bytes += reg.nbytes[self.rank]
        return send

    def reduce_grads(self, grads: Sequence[Optional[torch.Tensor]]) -> list:
        """One reduce-scatter (mean over ranks) of the unsharded grads, waited
        for; returns sharded grads per slot (None for frozen slots and no-sync passes)."""
        pending = self.start_reduce(grads)
        return [None] * len(self.slots) if pending is None else self.finish_reduce(pending)

    def start_reduce(self, grads: Sequence[Optional[torch.Tensor]]) -> Optional[PendingReduce]:
        """Pack the unsharded grads and launch their reduce-scatter without
        waiting; None under no-sync (the packed grads are kept for later)."""
        layout = self.reduce_layout
        send = torch.zeros(layout.wire_bytes, dtype=torch.uint8, device=self.storage.buffer.device)
        for j, i in enumerate(self.grad_slots):
            if grads[i] is not None:
                self._pack_grad(send, j, i, grads[i])
        if not self.requires_gradient_sync:
            self._accumulate_pending(send)
            return None
        if self.pending_grads is not None:
            send, self.pending_grads = self._typed(send).add_(self._typed(self.pending_grads)), None
            send = send.view(torch.uint8)
        return self._reduce_scatter(send)

    def finish_reduce(self, pending: PendingReduce) -> list:
        """Wait for a launched reduce-scatter; returns sharded grads per slot."""
        if pending.work is not None:
            pending.work.wait()
        if self.world_size > 1 and self.gradient_divide_factor != 1.0:
            self._typed(pending.output).div_(self.gradient_divide_factor)
        return self._sharded_grads(pending.output)

    def _typed(self, buf: torch.Tensor) -> torch.Tensor:
        dtype = self.reduce_layout.regions[0].dtype
        return buf.view(dtype)

    def _pack_grad(self, send: torch.Tensor, j: int, i: int, grad: torch.Tensor) -> None:
        layout, slot = self.reduce_layout, self.slots[i]
        for r in range(self.world_size):
            piece = slot.placement.shard(grad, r, self.world_size)
            typed_view(send, layout.piece_start(j, r), layout.regions[j].dtype,
                       slot.local_shapes[r]).copy_(piece)
        self.counters.copy_in_bytes += sum(layout.regions[j].nbytes)

    def _accumulate_pending(self, send: torch.Tensor) -> None:
        if self.pending_grads is None:
            self.pending_grads = send
        else:
            self._typed(self.pending_grads).add_(self._typed(send))

    def _reduce_scatter(self, send: torch.Tensor) -> PendingReduce:
        layout = self.reduce_layout
        work = None
        if self.world_size == 1:
            out = send
        else:
            out = torch.empty(layout.segment_bytes, dtype=torch.uint8, device=send.device)
            work = self.comm.reduce_scatter(self._typed(out), self._typed(send), self.group,
                                            async_op=True)
            self.counters.reduce_wire_bytes += layout.wire_bytes
            self.counters.reduce_ideal_bytes += layout.ideal_bytes
        self.counters.reduces += 1
        return PendingReduce(work, out)

    def _sharded_grads(self, out: torch.Tensor) -> list:
        grads: list = [None] * len(self.slots)
        for j, i in enumerate(self.grad_slots):
            reg, slot = self.reduce_layout.regions[j], self.slots[i]
            shape = slot.local_shapes[self.rank]
            if math.prod(shape) == 0:  # a view would pin the whole reduce output
                grads[i] = torch.zeros(shape, dtype=slot.dtype, device=out.device)
                continue
            g = typed_view(out, reg.offsets[self.rank], reg.dtype, shape)
            grads[i] = g.to(slot.dtype)
        return grads


def _moved_param(old: nn.Parameter, view: torch.Tensor, fn) -> nn.Parameter:
    """A new sharded param over `view` carrying `old`'s grad (moved by `fn`)
    and post-accumulate-grad hooks. A new object, because `.data =` would
    stop the param from sharing the storage buffer's version counter."""
    param = nn.Parameter(view, requires_grad=old.requires_grad)
    if old.grad is not None:
        param.grad = fn(old.grad)
    hooks = getattr(old, "_post_accumulate_grad_hooks", None)
    if hooks:
        param._post_accumulate_grad_hooks = hooks
    return param


def grads_anchor(bucket: Bucket) -> torch.Tensor:
    """A defined (empty) grad for the anchor, so its _Deliver node runs."""
    return torch.empty(0, device=bucket.storage.buffer.device)


class _Unshard(torch.autograd.Function):
    """Forward: the bucket's gather. Backward: the bucket's reduce-scatter."""

    @staticmethod
    def forward(ctx, bucket: Bucket, anchor: torch.Tensor):
        ctx.bucket, ctx.delivery = bucket, bucket._anchor[0] if bucket._anchor else None
        ctx.set_materialize_grads(False)
        outs = bucket.gather_params()
        trainable = set(bucket.grad_slots)
        frozen = [o for i, o in enumerate(outs) if i not in trainable]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # The reduce-scatter runs while the rest of backward does; the queue
        # delivers the sharded grads into .grad (at the latest when backward ends).
        bucket = ctx.bucket
        bucket.reduce_queue.watch_backward()
        bucket.reduce_queue.make_room()
        pending = bucket.start_reduce(grads)
        if pending is not None and ctx.delivery is not None:
            bucket.reduce_queue.push(bucket, pending, ctx.delivery)
        return None, grads_anchor(bucket)
