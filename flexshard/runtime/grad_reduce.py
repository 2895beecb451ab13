"""A bucket's gradient path, in named steps, and the model's queue of reductions
in flight and their delivery into `.grad`.

1. pack (`GradReduce.pack`): the unsharded grads into the reduce input on the
   reduce stream (or added to the no-sync sum); `_Unshard.backward` then defers
   the launch on the model's `ReduceQueue` until the node has returned (autograd
   holds a node's grad inputs until then).
2. launch (`GradReduce.launch`): the reduce-scatter, from the next node's
   pre-hook, `make_room` or `finish_all`. The queue keeps at most
   `max_in_flight` reductions launched (one on CUDA, where the collective
   overlaps the backward of the buckets before it; none on a host, where the
   launch finishes it); the oldest is finished to make room.
3. finish (`GradReduce.finish`): wait, the replicas' all-reduce (or its
   deferral), the post-divide, the copy-out into sharded grads, added to the
   forward's `Delivery`.
4. deliver: at the start of each forward under grad every bucket renews its
   `GradRoute`: one `_Deliver` node taking the sharded params as inputs and giving
   an empty *anchor*, which each `_Unshard` of the bucket in that forward takes
   as an input. The anchor's grad (an empty tensor) reaches `_Deliver` last in
   backward (made first in forward, it has the lowest sequence number, and
   autograd runs ready nodes in decreasing sequence number), whose backward
   finishes the queue and returns the summed sharded grads: AccumulateGrad puts
   them into `.grad` and fires post-accumulate-grad hooks.

A step that raised is cleaned up in one place: `ReduceQueue.abandon_backward`
(the next forward starts outside backward): its launches are waited for and
dropped and the listeners (end-of-backward work of the rest of the runtime)
run. The queue knows launched collectives and the bucket-side steps through
callables only, never buckets.

Streams (design.md, "Streams and buffers"): packing and the collective run on the
device context's reduce stream, ordered by events; the compute stream waits for
the pack (not for the collective) and, in `finish`, for the copy-out.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..compat import (chunk_cat, current_graph_task_id, foreach_copy_, foreach_zero_,
                      queue_callback)
from .comm import Comm, DeviceSite, group_parts, in_backward, on_stream
from ..planning.copyplan import plan_copies
from ..planning.fused import plan_chunk_cat, plan_split, segment_split, span_split
from .counters import BucketCounters
from .unsharded import output_parts, split_views
from .inflight import PendingReduce, ReduceOp
from ..planning.layout import BucketLayout, SlotPlan

# Up to this many unwritten ranges of a reduce input are zeroed each step by one
# foreach op over views of them (Owned's segment tails: one per rank; a solo gather
# group's padding); more, and one fill of the whole buffer costs less.
_FEW_GAPS = 64


class GradReduce:
    """One bucket's reduction of its trainable slots' grads (see the module docstring)."""

    def __init__(self, layout: BucketLayout, slots: Sequence[SlotPlan], grad_slots: list,
                 rank: int, world_size: int, group, comm: Comm, counters: BucketCounters,
                 site: DeviceSite, *, replicate_group=None, replicate_size: int = 1,
                 divide_factor: Optional[float] = None, offload=None) -> None:
        self.layout, self.slots, self.grad_slots = layout, tuple(slots), grad_slots
        self.site = site  # the compute device and its streams, the storage's device
        self.rank, self.world_size, self.group, self.comm = rank, world_size, group, comm
        self.replicate_group, self.replicate_size = replicate_group, replicate_size
        self.counters, self.offload = counters, offload
        self.requires_gradient_sync = True
        self.pending_slots: set = set()  # indices into grad_slots with grads in pending_grads
        self.requires_all_reduce = True  # HSDP: all-reduce across replicas this backward
        # reduced grads are divided by it: the mean over every rank of flex_shard's mesh
        # (a bucket mesh's grads hold every rank's tokens: see design.md, "A mesh per bucket")
        self.gradient_divide_factor = float(divide_factor or world_size * replicate_size)
        self.pending_grads: Optional[torch.Tensor] = None  # unreduced no-sync sum
        self.partial_reduced: Optional[torch.Tensor] = None  # HSDP: reduced shards summed
        #   over backwards that deferred the all-reduce (requires_all_reduce False)
        self._out_bytes = layout.output_bytes(rank)  # no padding where whole tensors reduce
        # the sharded grads' bytes when copied out of a mostly-padding output (_grad_targets)
        grad_bytes = layout.storage_bytes(rank)
        self._grad_bytes = grad_bytes if grad_bytes < self._out_bytes else None
        pieces = range(len(grad_slots))
        self._out_split = segment_split(layout, rank, pieces, self._out_bytes)  # the grads' views
        self._own_split = None if self._grad_bytes is None else \
            segment_split(layout, rank, pieces, self._grad_bytes)
        grad_plans = [slots[i] for i in grad_slots]
        self._copies = plan_copies(layout, grad_plans)
        # The pack in as few ops as the layout allows (planning/fused.py): a chunk-cat of
        # the packed gather group (dim-0 chunks back to back), one foreach copy of the
        # grads that are one span each (a solo group's, Owned), one by one for the rest.
        cat = plan_chunk_cat(layout, grad_plans)
        if cat is not None and all(self._copies[j].kind == "view" for j in cat.members):
            cat = None  # every member is a span: the foreach copy takes them
        self._chunk_cat = cat
        rest = [j for j in pieces if cat is None or j not in cat.members]
        self._spanned = tuple(j for j in rest if self._copies[j].kind == "view")
        self._spans = span_split(layout, self._spanned)
        self._single = tuple(j for j in rest if self._copies[j].kind != "view")
        # What the pack leaves unwritten, zeroed per step: nothing (dense), each gap
        # (a few: Owned's segment tails, solo groups' padding), or all of it (many gaps).
        dtype = layout.regions[0].dtype if layout.regions else torch.uint8
        self._uneven = None if not any(layout.uneven) else tuple(  # elements, not bytes
            None if sizes is None else tuple(b // dtype.itemsize for b in sizes)
            for sizes in layout.uneven)
        self._gaps = _gap_split(layout.gaps(), layout.wire_bytes, dtype)
        self._gaps_beside_cat = None if cat is None else _gap_split(tuple(
            (a, b) for a, b in layout.gaps() if not _inside(a, b, cat, layout)),
            layout.wire_bytes, dtype)

    def move(self, fn) -> None:
        """nn.Module._apply's `fn` (to_empty, .to): the unreduced (on the compute device)
        and partial sums follow."""
        self.pending_grads, self.partial_reduced = (
            None if t is None else fn(t) for t in (self.pending_grads, self.partial_reduced))

    # Step 1: pack.

    def pack(self, grads: Sequence[Optional[torch.Tensor]]) -> Optional[tuple]:
        """Pack the unsharded grads into the reduce input on the reduce stream;
        returns what `launch` needs, or None under no-sync (the packed grads
        are added to pending_grads instead)."""
        layout, sync, ctx = self.layout, self.requires_gradient_sync, self.site.ctx
        present = [grads[i] for i in self.grad_slots]
        cat = self._chunk_cat
        if cat is not None and not _one_dtype([present[j] for j in cat.members]):
            cat = None  # a None grad among them, or two dtypes: their copy plans pack them
        # Zeroed only where the pack leaves bytes unwritten (padding, gaps, a None grad).
        gaps = (self._gaps_beside_cat if cat is not None else self._gaps) \
            if all(g is not None for g in present) else None
        # written in the reduce dtype only: allocated in it
        send = self._typed_empty(layout.wire_bytes, self.site.compute_device)
        op = None
        with on_stream(ctx, ctx.reduce, ctx.record()), \
                record_function("FlexShard::reduce_scatter_copy_in"):  # after: grads, buffers
            self._zero(send, gaps)
            if cat is not None:
                self._chunk_cat_pack(send, [present[j] for j in cat.members], cat)
            self._pack(send, present, cat)
            if not sync:
                self._accumulate_pending(send, present)
            else:
                op = self.reduce_op()
                self._add_pending_and_scale(send, op)
            packed = ctx.record(ctx.reduce)
        # Autograd frees the unsharded grads when backward returns, and a consumed
        # no-sync sum dies here: the compute stream waits for the pack (not for the
        # collective), so only the reduce input is held until finish.
        ctx.wait(packed)
        return (send, op) if sync else None

    def _zero(self, send: torch.Tensor, gaps) -> None:
        """Zero what the pack leaves unwritten: the `gaps` (one foreach zero), or all of it."""
        typed = self.typed(send)
        if gaps is None:
            typed.zero_()
        elif gaps.count:
            foreach_zero_(split_views(typed, gaps))

    def _chunk_cat_pack(self, send: torch.Tensor, grads: list, plan) -> None:
        """The packed group's grads (dim-0 chunks) into its block of the reduce input, cast,
        in one op (FSDP2's foreach_reduce_scatter_copy_in); the columns past them zeroed."""
        block = self.typed(send)[plan.base:plan.base + self.world_size * plan.seg_elems]
        rows = block.view(self.world_size, plan.seg_elems)
        if plan.width < plan.seg_elems:
            rows[:, plan.width:].zero_()
            rows = rows[:, :plan.width]
        # With a cast, torch's CPU kernel copies each grad to a temporary first (one at a
        # time: +1 grad at the peak, FSDP2's the same); CUDA's kernel casts in place.
        chunk_cat(grads, 0, self.world_size, out=rows)
        self.counters.copy_in_bytes += sum(g.numel() for g in grads) * rows.element_size()

    def _pack(self, send: torch.Tensor, grads: list, cat) -> None:
        """The grads `cat` (the chunk-cat, if it ran) left into their rank pieces of the
        reduce input: one foreach copy of those that are one span of it (a solo
        group's, Owned, chained pieces), a few ops per other param whatever the world
        size (see copyplan.py)."""
        spanned = [(j, grads[j]) for j in self._spanned if grads[j] is not None]
        if len(spanned) == len(self._spanned) and spanned:
            foreach_copy_([v for v, _ in zip(split_views(send, self._spans), spanned)],
                          [g.reshape(-1) for _, g in spanned])
        else:
            self._single_copies(send, spanned)
        single = self._single if cat is not None or self._chunk_cat is None \
            else self._single + self._chunk_cat.members
        single = [(j, grads[j]) for j in single if grads[j] is not None]
        self._single_copies(send, single)
        self.counters.copy_in_bytes += sum(self._copies[j].numel * self._copies[j].dtype.itemsize
                                           for j, _ in spanned + single)

    def _single_copies(self, send: torch.Tensor, grads: list) -> None:
        for j, grad in grads:
            self._copies[j].pack(send, grad)

    def _accumulate_pending(self, send: torch.Tensor, present: list) -> None:
        slots = {j for j, g in enumerate(present) if g is not None}  # for check_frozen_pending
        if self.pending_grads is None:
            self.pending_grads, self.pending_slots = send, slots
        else:
            self.typed(self.pending_grads).add_(self.typed(send))
            self.pending_slots |= slots

    def reduce_op(self) -> ReduceOp:
        """The backend's average where it has one (NCCL AVG). Else the grads are
        pre-multiplied by 2**-k, 2**k the largest power of two <= factor (exact:
        a power of two only moves the exponent), summed, and divided by the
        rest of the factor (in [1, 2)): the sum of W grads so pre-divided stays
        below twice the largest grad, where a sum first and a divide after
        overflows in low precision at large world sizes. Bitwise, this is
        sum-then-divide wherever that does not overflow (or go subnormal).
        A factor of 1 (torchtitan's) sums."""
        factor = self.gradient_divide_factor
        if factor == 1.0:  # a world of one, or torchtitan's sum (a one-rank bucket mesh in
            return ReduceOp(None, None, dist.ReduceOp.SUM)  # a larger model still divides)
        # Under HSDP the replicas' all-reduce sums: the whole factor is applied around it.
        if (factor == self.world_size and self.replicate_group is None
                and self.comm.averages(self.group)):
            return ReduceOp(None, None, dist.ReduceOp.AVG)
        mantissa, exponent = math.frexp(factor)  # factor = (2 * mantissa) * 2 ** (exponent - 1)
        post = 2.0 * mantissa
        return ReduceOp(2.0 ** (1 - exponent), None if post == 1.0 else post, dist.ReduceOp.SUM)

    def _add_pending_and_scale(self, send: torch.Tensor, op: ReduceOp) -> None:
        """On the reduce stream: add the no-sync sum, pre-scale."""
        if self.pending_grads is not None:
            self.typed(send).add_(self.typed(self.pending_grads))
            self.pending_grads = None  # its last use: pack's compute wait covers it
        if op.pre_scale is not None:
            self.typed(send).mul_(op.pre_scale)

    # Step 2: launch.

    def start(self, grads: Sequence[Optional[torch.Tensor]]) -> Optional[PendingReduce]:
        """Pack the unsharded grads and launch their reduce-scatter on the reduce
        stream without waiting; None under no-sync (the packed grads are kept
        for later)."""
        packed = self.pack(grads)
        return None if packed is None else self.launch(packed)

    def launch(self, packed: tuple) -> PendingReduce:
        """Launch the reduce-scatter of a packed reduce input (`pack`)."""
        (send, op), ctx = packed, self.site.ctx
        out = send if self.world_size == 1 else self._typed_empty(self._out_bytes, send.device)
        with on_stream(ctx, ctx.reduce, ctx.record()), \
                record_function("FlexShard::reduce_scatter"):  # after: the output's allocation
            work = self._reduce_scatter(send, out, op)
        return PendingReduce(work, out, (send,), op.post_divide)

    def _reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> Any:
        """On the reduce stream: launch the reduce-scatter (None at world size 1)."""
        self.counters.reduces += 1
        if self.world_size == 1:
            return None
        self.counters.reduce_wire_bytes += self.layout.wire_bytes
        self.counters.reduce_ideal_bytes += self.layout.ideal_bytes
        kwargs = {} if op.op == dist.ReduceOp.SUM else {"op": op.op}  # a Comm may not take op
        if self._uneven is not None:  # only where a group is: a user's Comm may predate it
            kwargs["uneven"] = self._uneven
        return self.comm.reduce_scatter_groups(
            group_parts(self.typed(out), self.layout.spans),
            output_parts(self.typed(send), self.layout), self.group, async_op=True, **kwargs)

    # Step 3: finish.

    def finish(self, pending: PendingReduce) -> list:
        """Wait for a launched reduce-scatter; returns sharded grads per slot
        (cast on the reduce stream; the compute stream waits for them). None
        for each when HSDP's all-reduce is deferred (set_requires_all_reduce)."""
        deferred, ctx = self.replicate_group is not None and not self.requires_all_reduce, self.site.ctx
        targets = [] if deferred else self._grad_targets(pending.output, self.site.storage_device)
        with on_stream(ctx, ctx.reduce, ctx.record()), \
                record_function("FlexShard::reduce_scatter_copy_out"):  # after: cast outputs
            if pending.work is not None:
                pending.work.wait()
            if deferred:
                self._keep_partial(pending.output)
            elif self.replicate_group is not None:  # after the reduce-scatter: it sums the shards
                self._all_reduce(pending.output)
            if pending.post_divide is not None and not deferred:
                self.typed(pending.output).div_(pending.post_divide)
            copies = [(t, v) for v, t in targets if t is not v]  # casts, offload's D2H
            if copies:  # one op (async into pinned memory when offloaded)
                foreach_copy_([t for t, _ in copies], [v for _, v in copies],
                              non_blocking=self.offload is not None)
            done = ctx.record(ctx.reduce)
        ctx.wait(done)  # now `pending` (its input, the grads) may die: see PendingReduce.held
        if self.offload is not None and not deferred:  # the host reads the grads after host_wait()
            self.offload.grads_copied = done
            self.counters.d2h_bytes += sum(t.numel() * t.element_size() for _, t in targets)
        grads: list = [None] * len(self.slots)
        for i, (_, target) in zip(self.grad_slots, targets):
            grads[i] = target
        return grads

    def host_wait(self) -> None:
        """The host waits for the last D2H copy of this offloaded bucket's grads."""
        if self.offload is not None:
            self.site.ctx.synchronize(self.offload.grads_copied)

    def _all_reduce(self, output: torch.Tensor) -> None:
        """HSDP, on the reduce stream: add the partial sum kept by the backwards
        that deferred their all-reduce, then all-reduce across replicas."""
        if self.partial_reduced is not None:
            self.typed(output).add_(self.typed(self.partial_reduced))
            self.partial_reduced = None
        with record_function("FlexShard::all_reduce"):
            self.comm.all_reduce(self.typed(output), self.replicate_group)
        self.counters.all_reduces += 1
        self.counters.all_reduce_bytes += output.numel() * output.element_size()

    def _keep_partial(self, output: torch.Tensor) -> None:
        """HSDP with the all-reduce deferred: sum the reduced shards for the next
        backward that all-reduces (as FSDP2's partial reduce output). Linear all
        the way: the pre-divide and post-divide commute with the deferral."""
        if self.partial_reduced is None:
            self.partial_reduced = output
        else:
            self.typed(self.partial_reduced).add_(self.typed(output))

    def _grad_targets(self, out: torch.Tensor, storage_device: torch.device) -> list:
        """(view of the reduce output, sharded grad) per trainable slot; the
        grad is the view itself when no cast is needed, else a new tensor
        (allocated here, on the compute stream); offloaded: a host tensor. Where
        over 1/16 of this rank's reduce segment is padding (an Owned bucket's light
        rank) the grads are views of one buffer of their own bytes instead, so they
        do not pin the padding until the optimizer is done with them. The views
        come from one split of each buffer (planning/fused.py)."""
        targets, offload = [], self.offload
        views = split_views(out, self._out_split)
        owned = None if self._grad_bytes is None or offload is not None else split_views(
            torch.empty(self._grad_bytes, dtype=torch.uint8, device=out.device), self._own_split)
        for j, i in enumerate(self.grad_slots):
            slot = self.slots[i]
            shape = slot.local_shapes[self.rank]
            if math.prod(shape) == 0:  # a view would pin the whole reduce output
                empty = torch.zeros(shape, dtype=slot.dtype, device=storage_device)
                targets.append((empty, empty))
                continue
            view = views[j].view(shape)
            if offload is not None:
                targets.append((view, offload.host_empty(shape, slot.dtype)))
            elif view.dtype != slot.dtype:
                targets.append((view, torch.empty(shape, dtype=slot.dtype, device=out.device)))
            else:
                targets.append((view, view if owned is None else owned[j].view(shape)))
        return targets

    def typed(self, buf: torch.Tensor) -> torch.Tensor:
        """A reduce buffer (uint8, or allocated in the reduce dtype) in the reduce dtype."""
        dtype = self.layout.regions[0].dtype
        return buf if buf.dtype == dtype else buf.view(dtype)

    def _typed_empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A reduce buffer of `nbytes` allocated in the reduce dtype where the bytes are
        whole elements of it (no dtype view per use), else in uint8."""
        dtype = self.layout.regions[0].dtype
        if nbytes % dtype.itemsize:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device)


def _one_dtype(grads: list) -> bool:
    """Whether every grad is present and of the first one's dtype."""
    if any(g is None for g in grads):
        return False
    first = grads[0].dtype
    return all(g.dtype == first for g in grads)


def _gap_split(gaps: tuple, nbytes: int, dtype: torch.dtype):
    """The `gaps` (byte ranges) of a reduce input of `nbytes` as one TypedSplit of
    `dtype` pieces, zeroed by one foreach op; None when there are so many that one
    fill of the whole buffer costs less."""
    if len(gaps) > _FEW_GAPS:
        return None
    size = dtype.itemsize
    return plan_split(nbytes, [(a, dtype, (b - a) // size) for a, b in gaps])


def _inside(start: int, stop: int, cat, layout: BucketLayout) -> bool:
    """Whether bytes [start, stop) of the reduce input lie in `cat`'s block, which
    the chunk-cat writes whole."""
    block = layout.block(len(layout.spans) - 1)
    return block[0] <= start and stop <= block[1]


class Reduction:
    """One bucket's reduction through the model's queue, a named step at a time:
    packed in the bucket's backward, `launch`ed once that node has returned,
    `finish`ed into the forward's Delivery (None: a graph no Delivery waits for)."""

    def __init__(self, grads: GradReduce, packed: tuple, delivery) -> None:
        self.grads, self.packed, self.delivery = grads, packed, delivery
        self.pending: Optional[PendingReduce] = None

    @property
    def work(self):
        """The launched collective (None before launch, or at world size 1)."""
        return None if self.pending is None else self.pending.work

    def launch(self) -> None:
        self.pending, self.packed = self.grads.launch(self.packed), None

    def finish(self) -> None:
        grads, self.pending = self.grads.finish(self.pending), None
        host_wait = self.grads.host_wait if self.grads.offload is not None else None
        self.delivery.add(grads, host_wait)


class ReduceQueue:
    """Launched reduce-scatters of one model, finished in launch order."""

    def __init__(self, max_in_flight: int = 1) -> None:
        self.max_in_flight = max_in_flight
        self.listeners: list = []  # called when a backward pass ends, after the reductions
        # Reductions launched, not yet finished (each holds its reduce output alive
        # until it has been read).
        self._pending: deque = deque()
        self._watched: list = []  # graph tasks with our end-of-backward callback, outermost first
        # Launches packed inside a backward node and run after it returned (when autograd
        # has let go of its grad inputs): at the next launch_deferred(), make_room() or
        # finish_all(), in the order they were deferred.
        self._deferred: deque = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def watch_backward(self) -> None:
        """Inside backward: make sure this pass ends by finishing the queue."""
        task = current_graph_task_id()
        if task != -1 and task not in self._watched:
            self._watched.append(task)
            # Runs when this graph task's engine has run every node, _Deliver included.
            queue_callback(
                lambda: self._backward_ended(task))

    def abandon_backward(self) -> None:
        """Forward starts outside backward, so no backward pass is running: one
        that raised never ran its callback. Its launched reductions are waited
        for and dropped (the user zeroes the grads of a failed step) and the
        listeners clean up after it."""
        if not (self._watched or self._pending or self._deferred):
            return
        self._deferred.clear()  # packed for a failed step: never launched
        while self._pending:
            work = self._pending.popleft().work
            if work is not None:
                work.wait()
        self._watched.clear()
        for listener in self.listeners:
            listener()

    def defer(self, reduction: Reduction) -> None:
        """Launch `reduction` once the current backward node has returned: see
        launch_deferred."""
        self._deferred.append(reduction)
        self.watch_backward()

    def launch_deferred(self) -> None:
        """Launch the deferred reductions, oldest first (a hook on the next node to
        run calls this; so do make_room and finish_all), and track each."""
        while self._deferred:
            reduction = self._deferred.popleft()
            # how many may stay in flight is the device's call; a model's buckets
            # share one compute device, so they agree
            self.max_in_flight = reduction.grads.site.ctx.reduces_in_flight
            reduction.launch()
            if reduction.delivery is not None:
                self.push(reduction)

    def make_room(self) -> None:
        """Finish the oldest reductions until another one may be launched."""
        self.launch_deferred()
        while len(self._pending) >= max(self.max_in_flight, 1):
            self._finish_oldest()

    def push(self, reduction: Reduction) -> None:
        """Track a launched reduction; it is finished by backward's end at the latest."""
        self._pending.append(reduction)
        if self.max_in_flight == 0 or not in_backward():
            self.finish_all()
        else:
            self.watch_backward()

    def finish_all(self) -> None:
        """Launch what is deferred, then finish every reduction, in launch order."""
        self.launch_deferred()
        while self._pending:
            self._finish_oldest()

    def _backward_ended(self, task) -> None:
        if task in self._watched:
            self._watched.remove(task)
        self.finish_all()
        if not self._watched:
            for listener in self.listeners:
                listener()

    def _finish_oldest(self) -> None:
        self._pending.popleft().finish()


class Delivery:
    """The sharded grads one forward's reductions of one bucket produced, until
    its _Deliver node hands them to autograd."""

    def __init__(self) -> None:
        self.grads: Optional[list] = None
        # CPU offload: host waits to run before the host reads the grads (a
        # device may still be copying them into host memory).
        self._host_waits: list = []

    def add(self, grads: list, host_wait: Optional[Callable[[], None]] = None) -> None:
        if host_wait is not None:
            self._host_waits.append(host_wait)
        if self.grads is None:
            self.grads = list(grads)
            return
        self._wait_host()  # the sum reads both forwards' grads on the host
        self.grads = [a if b is None else b if a is None else a + b
                      for a, b in zip(self.grads, grads)]

    def take(self) -> list:
        self._wait_host()
        grads, self.grads = self.grads, None
        return grads

    def _wait_host(self) -> None:
        waits, self._host_waits = self._host_waits, []
        for wait in waits:
            wait()


class _Deliver(torch.autograd.Function):
    """Forward: sharded params -> an empty anchor. Backward: the reduced sharded grads."""

    @staticmethod
    def forward(ctx, queue: ReduceQueue, delivery: Delivery, device, *params: torch.Tensor):
        # ctx keeps the Delivery alive for as long as the graph of this forward lives.
        ctx.queue, ctx.delivery, ctx.count = queue, delivery, len(params)
        # The anchor lives on the compute device (not the params', which are in
        # host memory under CPU offload), so autograd runs this node's backward
        # on the same device thread as the _Unshard nodes and the ReduceQueue.
        return torch.empty(0, device=device)

    @staticmethod
    def backward(ctx, grad):
        # Runs last in backward (lowest sequence number, see the module docstring),
        # so finishing the queue here waits only for reductions already overlapped.
        ctx.queue.finish_all()
        grads = ctx.delivery.take() or [None] * ctx.count
        return (None, None, None, *grads)


class GradRoute:
    """One bucket's route from its reductions into its sharded params' .grad:
    the Delivery and the anchor of the current forward (None outside one)."""

    def __init__(self) -> None:
        self.delivery: Optional[Delivery] = None
        self.anchor: Optional[torch.Tensor] = None
        self._grad: Optional[torch.Tensor] = None  # see anchor_grad

    def renew(self, queue: ReduceQueue, params: Sequence[torch.Tensor], trainable: bool,
              device: torch.device) -> None:
        """Start a new route (at the start of each forward; none under no_grad
        or for a bucket without trainable params); the anchor is on `device`,
        the compute device."""
        self.delivery = self.anchor = None
        if trainable and torch.is_grad_enabled():
            self.delivery = Delivery()
            self.anchor = _Deliver.apply(queue, self.delivery, device, *params)

    def anchor_grad(self, device: torch.device) -> torch.Tensor:
        """The anchor's grad from _Unshard.backward: a defined (empty) grad, so the
        anchor's _Deliver node runs (which ignores it). Made once per device, not
        once per backward: autograd adds two such grads out of place (we hold a
        reference), so the cached one is never written."""
        if self._grad is None or self._grad.device != device:
            self._grad = torch.empty(0, device=device)
        return self._grad

    def clear(self) -> None:
        """Forget the route (the params it takes were replaced, e.g. a device move)."""
        self.delivery = self.anchor = None

    def anchor_for_unshard(self, queue: ReduceQueue, params: Sequence[torch.Tensor],
                           trainable: bool, device: torch.device) -> torch.Tensor:
        """The input tying an unshard's outputs to the route (renewed when there
        is none, e.g. a module run on its own, or it lives on another device);
        an empty stand-in when no grads will flow. `self.delivery` is its Delivery."""
        if self.anchor is None or self.anchor.device != device:
            self.renew(queue, params, trainable, device)
        if self.anchor is None:
            return torch.empty(0, device=device)
        return self.anchor
