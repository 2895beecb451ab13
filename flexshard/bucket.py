"""One bucket's life: its sharded parameters, the one gather that unshards them
and the one reduce-scatter that hands back their gradients.

States: SHARDED -> UNSHARDING -> UNSHARDED -> SHARDED. Unsharded parameters
are made by `_Unshard`, an autograd Function whose backward is the bucket's
gradient reduction, so sharded gradients arrive through autograd.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn

from .comm import Comm
from .config import MixedPrecisionPolicy
from .layout import BucketLayout, SlotPlan, plan_layout
from .storage import BucketStorage, gathered_param, typed_view


class BucketState(enum.Enum):
    SHARDED = "sharded"  # modules hold sharded parameters
    UNSHARDING = "unsharding"  # the gather is in flight
    UNSHARDED = "unsharded"  # modules hold unsharded parameters


@dataclass
class BucketCounters:
    """Bytes a bucket moved and copied, since the counters were last reset."""

    gathers: int = 0
    reduces: int = 0
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


class Bucket:
    """The sharded parameters of one BucketSpec and their collectives."""

    def __init__(self, name: str, slots: Sequence[SlotPlan], trainable: Sequence[bool],
                 mp: MixedPrecisionPolicy, reshard_after_forward: bool,
                 group, rank: int, world_size: int, comm: Comm, device) -> None:
        self.name, self.slots, self.mp = name, tuple(slots), mp
        self.reshard_after_forward = reshard_after_forward
        self.group, self.rank, self.world_size, self.comm = group, rank, world_size, comm
        self.storage = BucketStorage(plan_layout(slots, [s.dtype for s in slots], world_size),
                                     slots, rank, device)
        self.gather_layout = plan_layout(slots, [_gather_dtype(s, mp) for s in slots], world_size)
        self.grad_slots = [i for i, t in enumerate(trainable) if t]
        reduce_dtype = _reduce_dtype([slots[i] for i in self.grad_slots], mp)
        self.reduce_layout = plan_layout([slots[i] for i in self.grad_slots],
                                         [reduce_dtype] * len(self.grad_slots), world_size)
        self.params = [nn.Parameter(v, requires_grad=t) for v, t in zip(self.storage.views, trainable)]
        self.state = BucketState.SHARDED
        self.gathering = False  # true while the gather runs: the recompute policy reads it
        self.requires_gradient_sync = True
        self.pending_grads: Optional[torch.Tensor] = None  # unreduced no-sync sum
        self.counters = BucketCounters()

    @property
    def needs_hooks(self) -> bool:
        """False at world size 1 without a cast when every piece has the full
        shape: the sharded params are the full ones."""
        return (self.world_size > 1 or self.gather_layout != self.storage.layout
                or any(s.local_shapes[0] != s.shape for s in self.slots))

    def assert_state(self, *states: BucketState) -> None:
        if self.state not in states:
            raise AssertionError(f"bucket {self.name!r} is {self.state}, expected {states}")

    def load_full(self, fqn_to_tensor) -> None:
        """Copy this rank's piece of each full tensor into the sharded storage."""
        with torch.no_grad():
            for slot, view in zip(self.slots, self.storage.views):
                full = fqn_to_tensor(slot.fqn)
                view.copy_(slot.placement.shard(full.to(view.device), self.rank, self.world_size))

    def unshard(self) -> list:
        """Gather the bucket: unsharded parameters linked to the sharded ones by autograd."""
        self.assert_state(BucketState.SHARDED, BucketState.UNSHARDED)
        self.state = BucketState.UNSHARDING
        try:
            outs = _Unshard.apply(self, *self.params)
        finally:
            self.state = BucketState.SHARDED
        self.state = BucketState.UNSHARDED
        return list(outs)

    def mark_resharded(self) -> None:
        self.assert_state(BucketState.UNSHARDED, BucketState.SHARDED)
        self.state = BucketState.SHARDED

    # The two collectives.

    def gather_params(self, layout: Optional[BucketLayout] = None) -> list:
        """One all-gather over the bucket; returns the unsharded tensors, typed
        by `layout` (the gather layout, i.e. param_dtype, by default)."""
        layout = layout or self.gather_layout
        self.gathering = True
        try:
            send = self._gather_input(layout)
            if self.world_size == 1:
                gathered = send
            else:
                gathered = torch.empty(layout.wire_bytes, dtype=torch.uint8, device=send.device)
                self.comm.all_gather(gathered, send, self.group)
            outs = []
            for i, slot in enumerate(self.slots):
                full, copied = gathered_param(gathered, layout, slot, i)
                self.counters.copy_out_bytes += copied
                outs.append(full)
        finally:
            self.gathering = False
        self.counters.gathers += 1
        self.counters.gather_wire_bytes += layout.wire_bytes if self.world_size > 1 else 0
        self.counters.gather_ideal_bytes += layout.ideal_bytes if self.world_size > 1 else 0
        return outs

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
        """One reduce-scatter (mean over ranks) of the unsharded grads; returns
        sharded grads per slot (None for frozen slots and no-sync passes)."""
        layout = self.reduce_layout
        send = torch.zeros(layout.wire_bytes, dtype=torch.uint8, device=self.storage.buffer.device)
        for j, i in enumerate(self.grad_slots):
            if grads[i] is not None:
                self._pack_grad(send, j, i, grads[i])
        if not self.requires_gradient_sync:
            self._accumulate_pending(send)
            return [None] * len(self.slots)
        if self.pending_grads is not None:
            send, self.pending_grads = self._typed(send).add_(self._typed(self.pending_grads)), None
            send = send.view(torch.uint8)
        out = self._reduce_scatter(send)
        return self._sharded_grads(out)

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

    def _reduce_scatter(self, send: torch.Tensor) -> torch.Tensor:
        layout = self.reduce_layout
        if self.world_size == 1:
            out = send
        else:
            out = torch.empty(layout.segment_bytes, dtype=torch.uint8, device=send.device)
            self.comm.reduce_scatter(self._typed(out), self._typed(send), self.group)
            self.counters.reduce_wire_bytes += layout.wire_bytes
            self.counters.reduce_ideal_bytes += layout.ideal_bytes
            self._typed(out).div_(self.world_size)
        self.counters.reduces += 1
        return out

    def _sharded_grads(self, out: torch.Tensor) -> list:
        grads: list = [None] * len(self.slots)
        for j, i in enumerate(self.grad_slots):
            reg, slot = self.reduce_layout.regions[j], self.slots[i]
            g = typed_view(out, reg.offsets[self.rank], reg.dtype, slot.local_shapes[self.rank])
            grads[i] = g.to(slot.dtype)
        return grads


class _Unshard(torch.autograd.Function):
    """Forward: the bucket's gather. Backward: the bucket's reduce-scatter."""

    @staticmethod
    def forward(ctx, bucket: Bucket, *sharded: torch.Tensor):
        ctx.bucket = bucket
        ctx.set_materialize_grads(False)
        outs = bucket.gather_params()
        frozen = [o for o, p in zip(outs, sharded) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.bucket.reduce_grads(grads))
