"""A bucket's gather and gradient reduction as traceable ops, for a graph that
holds the whole step (fs.compile, flexshard/whole_step.py).

Forward: this rank's pieces go through the bucket's wire format into one send
buffer, one functional all-gather per gather group writes the rank-major
output, and each param is decoded out of it by the same copy plans the eager
path uses (runtime/unsharded.py). Backward: each unsharded param's grad flows,
through autograd, into a stand-in of the bucket's *reduce* layout (the grads
packed as the eager reduction packs them), which one functional reduce-scatter
per gather group sums over the shard group (and an all-reduce over HSDP's
replicas), in the reduce dtype, divided by the bucket's gradient divide factor.
Autograd then accumulates each sharded grad into the sharded param's `.grad`.

The stand-in never holds values: the forward's values come from the wire, the
backward's structure from the reduce layout (`Spans`), so any wire format
whose decode traces (a cast, QuantizedGather's blocks) reduces its grads in
the reduce dtype, as eager does. A compiler drops the stand-in's forward ops:
nothing reads them.

Dynamo does not trace this module's Python: `unsharded` is one non-strict traced
call in its graph, whose ops AOTAutograd traces (design.md, "The whole step in
one graph").
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ..compat import (FUNCTIONAL_COLLECTIVES_NAMESPACE, functional_collectives, nonstrict_trace,
                      register_constant)
from ..placements import float8
from ..placements.quantized import DECODE_NAMESPACE, BlockQuantized
from ..placements.subclass import SubclassGather
from ..placements.wire import Cast
from ..planning.copyplan import plan_copies
from . import opaque_format
from .bucket import Bucket
from .grad_spans import Indexed, Spans, cast_as, span_group
from .unsharded import plan_param_wires

# aten ops that turn a shard into unsharded params besides views (a cast's encode,
# the send's join and gaps, copy-outs, casts, the stand-in): recomputed in backward
# under reshard after forward, with the collectives and the decode op; saving one
# would keep a copy of the shard (a whole param on an Owned param's owner).
_GATHER_OPS = frozenset({"cat", "clone", "copy", "copy_", "index", "_to_copy", "new_zeros", "zeros",
                         "empty", "new_empty", "empty_like", "_unsafe_view", "view", "reshape",
                         "slice", "as_strided", "alias"})


# aten ops a checkpoint must not recompute: the matmuls and attention kernels
_COMPUTE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm",
                          "_scaled_dot_product_flash_attention",
                          "_scaled_dot_product_flash_attention_for_cpu",
                          "_scaled_dot_product_efficient_attention",
                          "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                          "_efficient_attention_forward"})


def recompute_gather_policy(groups: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpoint policy of reshard after forward: recompute the
    gather in backward (the collectives over the buckets' `groups`, their waits,
    the decode), save other collectives (tensor parallelism's over tp:
    recomputing one would run it again) and the matmuls, and leave the rest to
    the partitioner, which recomputes cheap ops where that saves memory, as in a
    compiled block."""
    namespace = getattr(op, "namespace", None)
    if namespace == FUNCTIONAL_COLLECTIVES_NAMESPACE:
        group = kwargs.get("group_name", args[-1] if args else None)
        ours = op.overloadpacket.__name__ == "wait_tensor" or group in groups
        return CheckpointPolicy.PREFER_RECOMPUTE if ours else CheckpointPolicy.MUST_SAVE
    if namespace == DECODE_NAMESPACE:
        return CheckpointPolicy.PREFER_RECOMPUTE
    name = op.overloadpacket.__name__
    if getattr(op, "is_view", False) or name in _GATHER_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    # "prefer" lets inductor's partitioner recompute cheap ops; AOTAutograd's default
    # partitioner (aot_eager) would recompute matmuls too
    return CheckpointPolicy.MUST_SAVE if name in _COMPUTE_OPS else CheckpointPolicy.PREFER_SAVE


class _GatherReduce(torch.autograd.Function):
    """Forward: all-gather the wire `send`'s gather groups (one coalesced
    collective; not differentiable) and hand back an unfilled stand-in of each
    reduce group, of `segment`'s dtype: rank-major, or a compact group's ranks'
    used elements back to back (`reduces`: per group, (stand-in numel, None or
    this rank's (start, used, width) in a compact one)). Backward: reduce-scatter
    the rank-major stand-ins' grads (one coalesced collective), all-reduce the
    compact ones' (another), into `segment`'s grad."""

    @staticmethod
    def forward(ctx, segment, send, world, group, splits, reduce_dtype, factor, replicas,
                reduces, levels=None):
        ctx.args = (segment.dtype, world, group, reduce_dtype, factor, replicas, reduces)
        sends = send.split(splits) if len(splits) > 1 else [send]
        if world == 1:  # this rank's segment is the whole output (as eager: no collective)
            gathered = [t.view_as(t) for t in sends]
        else:
            gathered = (_gather(sends, world, group) if levels is None
                        else _gather_in_two(sends, *levels))
        stand_ins = [segment.new_empty(numel) for numel, _ in reduces]
        ctx.mark_non_differentiable(*gathered)
        return (*stand_ins, *gathered)

    @staticmethod
    def backward(ctx, *grads):
        dtype, world, group, reduce_dtype, factor, replicas, reduces = ctx.args
        ops = functional_collectives
        # the stand-ins' grads (the gathered outputs have none)
        parts = [g.to(reduce_dtype).contiguous() for g in grads[:len(reduces)]]
        if world > 1:
            parts = _reduced(parts, [mine for _, mine in reduces], world, group)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if replicas is not None:  # HSDP: the shards' sum over the replicas
            out = ops.wait_tensor(ops.all_reduce(out, "sum", replicas))
        return (out / factor).to(dtype), *[None] * 9


def _reduced(parts: Sequence[torch.Tensor], compact: Sequence, world: int, group: str) -> list:
    """This rank's segment of each reduce group's sum over `group`: a rank-major
    part's by one coalesced reduce-scatter, a compact part's (`compact[g]`: this
    rank's (start, used, width)) by one coalesced all-reduce, a segment's width
    of it from its own span on. The rest of that width is the segment's padding,
    whose grad no piece reads, so whatever it holds (a neighbour's sums) is left
    there: no zero-filled copy but at the output's end."""
    ops, out = functional_collectives, list(parts)
    even = [g for g, mine in enumerate(compact) if mine is None]
    whole = [g for g, mine in enumerate(compact) if mine is not None]
    if even:
        done = ops.reduce_scatter_tensor_coalesced([parts[g] for g in even], "sum", world, group)
        for g, t in zip(even, done):
            out[g] = ops.wait_tensor(t)
    if whole:
        done = ops.all_reduce_coalesced([parts[g] for g in whole], "sum", group)
        for g, t in zip(whole, done):
            start, used, width = compact[g]
            mine = ops.wait_tensor(t)[start if used else 0:][:width]
            out[g] = mine if mine.numel() == width else \
                torch.cat([mine, mine.new_zeros(width - mine.numel())])
    return out


def _gather(sends: Sequence[torch.Tensor], size: int, group: str) -> list:
    """One coalesced all-gather of `sends` over `group`, waited: rank-major each."""
    ops = functional_collectives
    return [ops.wait_tensor(t) for t in ops.all_gather_into_tensor_coalesced(sends, size, group)]


def _gather_in_two(sends: Sequence[torch.Tensor], across: str, kept: int, within: str,
                   size: int) -> list:
    """An int reshard's gather: across the post-forward groups first (the `kept`
    ranks at this rank's place in each: what backward regathers from, 1/`size` of
    the output), then within this rank's post-forward group of `size`. Its output
    is position-major: rank k * size + i's segment at i * kept + k
    (`_full_regrouped` reads it)."""
    return _gather(_gather(sends, kept, across), size, within)


class _ValueFrom(torch.autograd.Function):
    """`value` forward, its grad to `plain` backward as it is: a subclass value
    (torchao's float8 weight), whose plain is cast to its dtype (see unsharded),
    as torchao's own cast's grad goes back."""

    @staticmethod
    def forward(ctx, plain, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _join(parts: Sequence[tuple], nbytes: int, like: torch.Tensor) -> torch.Tensor:
    """One segment of `nbytes` from (byte offset, tensor) parts, zeros in the
    gaps: typed when every part has one dtype, else bytes."""
    dtypes = {t.dtype for _, t in parts}
    if len(dtypes) != 1:
        parts = [(start, t.reshape(-1).view(torch.uint8)) for start, t in parts]
    dtype = parts[0][1].dtype if parts else torch.uint8
    size, out, pos = dtype.itemsize, [], 0
    for start, t in sorted(parts, key=lambda p: p[0]):
        if start > pos:
            out.append(like.new_zeros((start - pos) // size, dtype=dtype))
        out.append(cast_as(t, dtype, (-1,)))
        pos = max(pos, start + t.numel() * size)  # an empty part may start inside the last
    if pos < nbytes:
        out.append(like.new_zeros((nbytes - pos) // size, dtype=dtype))
    return torch.cat(out)


def _typed(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return buffer if buffer.dtype == dtype else buffer.view(torch.uint8).view(dtype)


def _opaque(fmt) -> bool:
    """Whether `fmt` encodes and decodes by the opaque ops (a user-defined format)."""
    return not isinstance(fmt, (Cast, BlockQuantized, SubclassGather))


def traced_unsupported(bucket: Bucket) -> list:
    """What the traced gather leaves out for `bucket`, in words (empty: none)."""
    layout, wire = bucket.gather.padded_layout, bucket.gather.wire
    formats = {type(f).__name__ for f in wire.formats
               if isinstance(f, SubclassGather) and not f.batched}
    return ([f"the wire format(s) {', '.join(sorted(formats))}"] if formats else []) + \
        ([] if layout.regions else ["no parameters"])


class TracedBucket:
    """One bucket's gather (forward) and reduction (backward) as traceable ops.
    `kept`: its module keeps the unsharded params to backward (it holds other
    running modules), so an int reshard's gather takes one step, not two."""

    def __init__(self, bucket: Bucket, kept: bool = False) -> None:
        missing = traced_unsupported(bucket)
        if missing:
            raise NotImplementedError(
                f"fs.compile does not support {', '.join(missing)} (bucket {bucket.name!r}): "
                "compile each block with block.compile() instead, which keeps the gather in "
                "flexshard's hooks")
        self.name, rank = bucket.name, bucket.rank
        # the padded layout: the graph gathers with all_gather_into_tensor (bucket_plan.py)
        self.layout, self.wire = bucket.gather.padded_layout, bucket.gather.wire
        self.wires = plan_param_wires(self.layout, self.wire, rank)
        self.sends = [[(self.layout.regions[j].offsets[rank], self.layout.regions[j].dtype,
                        self.wire.slots[j].local_shapes[rank]) for j in self.wire.regions(i)]
                      for i in range(len(self.wire.formats))]
        grads = bucket.grads
        self.trainable = tuple(bucket.grad_slots)
        # the padded reduce layout: the graph reduces with reduce_scatter_tensor
        reduce = bucket.gather.padded_reduce_layout
        self.reduce_dtype = reduce.regions[0].dtype if reduce.regions else torch.float32
        # the trainable pieces' dtype; of several (a mixed bucket), the reduce dtype,
        # each piece cast to it (the grads' way back casts each to its param's)
        dtypes = {bucket.slots[i].dtype for i in self.trainable}
        self.plain_dtype = dtypes.pop() if len(dtypes) == 1 else self.reduce_dtype
        self.grad_copies = plan_copies(reduce, [bucket.slots[i] for i in self.trainable])
        size = self.reduce_dtype.itemsize
        self.pieces = [reduce.regions[j].offsets[rank] // size * self.plain_dtype.itemsize
                       for j in range(len(self.trainable))]  # byte offsets in a plain segment
        self.segment_bytes = reduce.segment_bytes // size * self.plain_dtype.itemsize
        self.world, self.group = bucket.world_size, bucket.group.group_name
        self.factor = grads.gradient_divide_factor
        self.replicas = bucket.replicate_group.group_name if bucket.replicate_size > 1 else None
        self.levels = None if kept else _levels(bucket)  # kept: the params stay to backward
        # the group backward's regather runs over (reshard's checkpoint recomputes it)
        self.regather_group = self.group if self.levels is None else self.levels[2]
        # each gather group's length in a rank's segment: bytes of the wire, elements
        # of the reduce layout; and where each group's output starts (elements)
        self.splits = ([b - a for a, b in self.layout.spans],
                       [(b - a) // size for a, b in reduce.spans])
        self.starts = ([a for a, _ in self.layout.spans], [a // size for a, _ in reduce.spans])
        # each reduce group's ranks' used elements where it is all-reduced compact, else None
        self.compact = _compact(self.grad_copies, reduce, self.world, self.splits[1],
                                self.starts[1], size)
        self.reduces = tuple(_stand_in(used, width, self.world, rank)
                             for used, width in zip(self.compact, self.splits[1]))
        self._bucket = bucket
        self._place(_device_of(bucket))
        self.float8_slots = [i for i, w in enumerate(self.wires.params)
                             if isinstance(w.format, SubclassGather)]
        # a user-defined format's encode and decode: one op each (opaque_format.py)
        self.opaque = {i: opaque_format.register(
            w.format, [s[1:] for s in self.sends[i]],
            [self.wire.slots[j].shape for j in self.wire.regions(i)])
            for i, w in enumerate(self.wires.params) if _opaque(w.format)}
        for i, key in self.opaque.items():
            opaque_format.probe(key, bucket.params[i])
        self.offload = bucket.offload  # its compute device read at trace time (to() moves it)
        self.tp = [w.tp for w in bucket.wiring]
        self.traced = _traced_gather()

    def _place(self, device: torch.device) -> None:
        """The graph's index positions made on `device`, all passed in (unsharded
        below): the gather's (Shard(d > 0) params out of their group's output), then
        the grads' (Spans)."""
        self.device = device
        reduce = self._bucket.gather.padded_reduce_layout
        self.span_groups = [span_group(members, [c.shape for c in self.grad_copies])
                            for members in self._plan_spans(reduce, self.reduce_dtype.itemsize)]
        gather_indices = self._index_plans()
        self.gather_blocks = tuple(block for block, _ in gather_indices)
        self.positions = tuple(p for _, p in gather_indices) + \
            tuple(p for group in self.span_groups for p in group.positions)

    def follow_device(self) -> None:
        """Before each compiled call: the positions made again where to() or
        to_empty() moved the params since (a meta model's, made at fs.compile, hold
        no values). The graph recompiles for the params' new device anyway."""
        device = _device_of(self._bucket)
        if device != self.device:
            self._place(device)

    # a pytree constant (unsharded() below) needs its own __eq__ and __hash__: identity
    def __eq__(self, other) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def _index_plans(self) -> list:
        """(block, positions) of each of the gather's index plans (Shard(d > 0):
        CopyPlan.index) in its group's output, in the order _decode reads them,
        made now on the compute device: made while tracing, their data-dependent
        ops would fail (the grads': _plan_spans).

        The positions go into the graph as inputs, as the grads' do: held by this
        constant TracedBucket they would be constants of the graph, real tensors
        that inductor's fake tensor pass refuses. Of the ways to a Shard(d) param
        that the graph accepts, the index is one gather (one copy, as eager's, and
        the same plan) for any placement, a user's included, in one op whatever the
        world size; a cat of the ranks' piece views is a copy too, but one input
        per rank (inductor copies each on its own past its max_pointwise_cat_inputs,
        8), and a permute of a strided view covers only an even Shard(d). Made in
        the graph from static shapes instead, they would be remade every step."""
        out = []
        for plan in (c for w in self.wires.params for c in w.copies):
            if plan.kind == "index":
                group = self.layout.regions[plan.region].group
                out.append(plan.index(self.device,
                                      self.world * self.starts[0][group] // plan.dtype.itemsize))
        return out

    def _on_device(self, pieces: Sequence[torch.Tensor]) -> list:
        """`pieces` on the compute device: an offloaded bucket's copied from host memory
        (H2D) in the graph, whose backward copies their grads back (D2H) into the host
        params' `.grad`."""
        if self.offload is None:
            return list(pieces)
        device = self.offload.compute_device
        return [p.to(device, non_blocking=True) for p in pieces]

    def _plan_spans(self, reduce, size: int) -> list:
        """Per reduce group, (trainable index, pieces) of its members: spans of the
        group's rank-major buffer (one span, or runs of a rank-major placement's
        pieces), a piece (start, start in the flat grad, numel); or, for an index
        plan, (block, its block positions in the group)."""
        out = [[] for _ in reduce.spans]
        for k, plan in enumerate(self.grad_copies):
            group = reduce.regions[plan.region].group
            base = self.world * self.starts[1][group]
            if plan.span is not None:
                start = plan.span[0] // size - base
                if self.compact[group] is not None:  # at its rank's place, unpadded
                    rank, within = divmod(start, self.splits[1][group])
                    start = sum(self.compact[group][:rank]) + within
                pieces = ((start, 0, plan.numel),)
            elif plan.runs is not None:
                pieces = tuple((run.start - base + i * run.stride, run.flat_start + i * run.length,
                                run.length) for run in plan.runs for i in range(run.rows))
            else:
                width = self.world * self.splits[1][group]
                pieces = Indexed(*plan.index(self.device, base, width))
            out[group].append((k, pieces))
        return out

    def send(self, sharded: Sequence[torch.Tensor], cast8: dict) -> tuple:
        """This rank's wire segment, each piece encoded in its format (torchao's
        float8 weights cast already: `cast8`), and the subclass decodes' metadata."""
        parts, metas = [], {}
        for i, (wire, sends, piece) in enumerate(zip(self.wires.params, self.sends, sharded)):
            if isinstance(wire.format, Cast):  # one cast, no buffer to copy into
                outs = [cast_as(piece.detach(), sends[0][1], sends[0][2])]
            elif i in cast8:
                bits, scale = cast8[i]
                outs = [bits.reshape(sends[0][2])]
                metas[i] = (wire.format.rebuild(piece.detach()), (scale,))
            elif i in self.opaque:
                encoded = opaque_format.encode(piece.detach(), self.opaque[i])
                outs, metas[i] = encoded[:len(sends)], encoded[len(sends):]
            else:
                outs = [piece.new_empty(shape, dtype=dtype) for _, dtype, shape in sends]
                metas[i] = wire.format.encode(piece.detach(), outs, None)
            parts += [(start, out) for (start, _, _), out in zip(sends, outs)]
        return _join(parts, self.layout.segment_bytes, sharded[0]), metas

    def cast_float8(self, sharded: Sequence[torch.Tensor]) -> dict:
        """{slot: (fp8 bits, scale)} of torchao's float8 weights, cast as eager's
        batch casts them (placements/float8.py, bit for bit): one amax all-reduce
        per bucket. Outside reshard after forward's checkpoint (whole_step.py):
        backward regathers these bits, as eager's regather reuses forward's scales."""
        slots = self.float8_slots
        if not slots:
            return {}
        pieces = [p.detach() for p in self._on_device([sharded[i] for i in slots])]
        ops = functional_collectives
        amax = ops.wait_tensor(ops.all_reduce(float8.local_amax(pieces), "max", self.group))
        dtype = self.wires.params[slots[0]].format.wire_dtype
        scale = float8.scales(amax, dtype)
        return dict(zip(slots, zip(float8.cast_each(pieces, scale, dtype), scale.unbind(0))))

    def unsharded(self, sharded: Sequence[torch.Tensor], cast8: dict,
                  positions: Sequence[torch.Tensor]) -> list:
        """The unsharded params (one per slot, a TP slot's a DTensor again), made
        inside the graph that calls this; `cast8` is cast_float8's, `positions`
        this bucket's `positions` (the gather's and the grads' index positions:
        passed in, they are tensors of the graph)."""
        sharded = self._on_device(sharded)  # under reshard, recomputed in backward
        send, metas = self.send(sharded, cast8)
        size = send.element_size()
        splits = [n // size for n in self.splits[0]]
        pieces = [(self.pieces[k], cast_as(sharded[i], self.plain_dtype))
                  for k, i in enumerate(self.trainable)]
        segment = _join(pieces, self.segment_bytes, sharded[0]) if pieces else \
            sharded[0].new_empty(0)
        outs = _GatherReduce.apply(segment, send, self.world, self.group, splits,
                                   self.reduce_dtype, self.factor, self.replicas, self.reduces,
                                   self.levels)
        stand_ins, gathered = outs[:len(self.reduces)], outs[len(self.reduces):]
        if self.levels is not None:
            gathered = _RankOrdered(gathered, *self.levels[1::2])
        gather_at = len(self.gather_blocks)
        indices = iter(zip(self.gather_blocks, positions[:gather_at]))
        fulls = [self._decode(i, wire, gathered, metas.get(i), indices)
                 for i, wire in enumerate(self.wires.params)]
        for k, value in self._spanned(stand_ins, fulls, positions[gather_at:]):
            i = self.trainable[k]
            if type(fulls[i]) is not torch.Tensor:  # a subclass: cast its plain, not its grad
                value = _ValueFrom.apply(value.to(fulls[i].dtype), fulls[i])
            fulls[i] = value
        # TP's modules see the DTensor they expect
        return [full if tp is None else tp.to_param(full) for tp, full in zip(self.tp, fulls)]

    def _spanned(self, stand_ins: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor],
                 positions: Sequence[torch.Tensor]):
        """(trainable index, its value, whose grad goes into its stand-in) of each
        reduce group's members; a subclass member's value is an unfilled tensor.
        `positions`: the groups' `SpanGroup.positions`, one after another."""
        out, positions = [], iter(positions)
        for stand_in, group in zip(stand_ins, self.span_groups):
            if group.members:
                values = [fulls[self.trainable[k]] for k in group.trainable]
                values = [v if type(v) is torch.Tensor else None for v in values]
                mine = [next(positions) for _ in group.blocks]
                out += zip(group.trainable, Spans.apply(stand_in, group, *values, *mine))
        return out

    def _decode(self, slot: int, wire, gathered, meta, indices) -> torch.Tensor:
        """`slot`'s unsharded param; `indices`: the gather's (block, positions),
        each index plan taking the next."""
        fulls = [_full(plan, gathered, self.layout, self.starts[0], self.world, bytes_=True,
                       index=next(indices) if plan.kind == "index" else None)
                 if self.levels is None else
                 _full_regrouped(plan, gathered, self.layout, self.starts[0], self.world,
                                 next(indices) if plan.kind == "index" else None)
                 for plan in wire.copies]
        fmt = wire.format
        if isinstance(fmt, BlockQuantized):
            return fmt.traced_decode(fulls)
        if slot in self.opaque:
            return opaque_format.decode(fulls, meta, self.opaque[slot])
        return fmt.decode(fulls, meta)


# A reduce group is all-reduced unpadded (compact) where its padded rank-major size is at
# least this many times what its ranks use. A ring all-reduce sends 2 (W - 1) / W of its
# input; the padded reduce-scatter (W - 1) / W of W times the width: equal at 2. Above, the
# all-reduce sends fewer bytes, and its input (what backward writes) is smaller at any.
_COMPACT_FROM = 2


def _compact(plans, reduce, world: int, widths: Sequence[int], starts: Sequence[int],
             size: int) -> list:
    """Per reduce group, the elements each rank uses of its segment (every member
    one span inside one rank's segment: whole tensors on their owners) where the
    group is all-reduced compact (`_COMPACT_FROM`), else None."""
    used = [[0] * world for _ in widths]
    whole = [world > 1] * len(widths)
    for plan in plans:
        group = reduce.regions[plan.region].group
        if plan.span is None:
            whole[group] = False
            continue
        rank, within = divmod(plan.span[0] // size - world * starts[group], widths[group])
        whole[group] = whole[group] and within + plan.numel <= widths[group]
        used[group][rank] = max(used[group][rank], within + plan.numel)
    return [tuple(u) if ok and 0 < _COMPACT_FROM * sum(u) <= world * width else None
            for u, ok, width in zip(used, whole, widths)]


def _stand_in(used, width: int, world: int, rank: int) -> tuple:
    """A reduce group's (stand-in numel, None or this rank's (start, used, width))."""
    if used is None:
        return world * width, None
    return sum(used), (sum(used[:rank]), used[rank], width)


def _device_of(bucket: Bucket) -> torch.device:
    """Where `bucket` computes: its offload's compute device, else its storage's."""
    return (bucket.offload.compute_device if bucket.offload is not None
            else bucket.storage.buffer.device)


def _levels(bucket: Bucket):
    """An int reshard N's two gathers: (the group across the post-forward groups, its
    size, this rank's post-forward group, N); None for a bool reshard."""
    n = bucket.gather.post_forward_size
    if n is None:
        return None
    subgroups, rank = bucket.subgroups, bucket.rank
    return (subgroups.across(rank, n).group_name, bucket.world_size // n,
            subgroups.of(rank, n).group_name, n)


class _RankOrdered:
    """An int reshard's position-major gather outputs (`regrouped`, one per gather
    group: `size` groups of `kept` segments), each put in rank order on first use
    only (one copy), for the plans that cannot read them as they are
    (`CopyPlan.traced_full_regrouped`)."""

    def __init__(self, regrouped: Sequence[torch.Tensor], kept: int, size: int) -> None:
        self.regrouped, self.kept, self.size, self._ordered = list(regrouped), kept, size, {}

    def __len__(self) -> int:
        return len(self.regrouped)

    def __iter__(self):
        return (self[group] for group in range(len(self)))

    def __getitem__(self, group: int) -> torch.Tensor:
        if group not in self._ordered:
            out = self.regrouped[group].view(self.size, self.kept, -1)
            self._ordered[group] = out.transpose(0, 1).reshape(-1)
        return self._ordered[group]


def _full_regrouped(plan, outputs: _RankOrdered, layout, starts: Sequence[int],
                    world: int, index=None) -> torch.Tensor:
    """`plan`'s full tensor out of an int reshard's gather outputs: read from the
    position-major order where the plan can, else from the rank-ordered copy
    (an index plan's, by `index`)."""
    group, size = layout.regions[plan.region].group, plan.dtype.itemsize
    full = plan.traced_full_regrouped(_typed(outputs.regrouped[group], plan.dtype),
                                      world * starts[group] // size,
                                      layout.stride(plan.region) // size, outputs.size)
    return full if full is not None else _full(plan, outputs, layout, starts, world, bytes_=True,
                                               index=index)


def _full(plan, outputs: Sequence[torch.Tensor], layout, starts: Sequence[int], world: int,
          bytes_: bool = False, index=None) -> torch.Tensor:
    """`plan`'s full tensor out of the gather groups' `outputs` (rank-major each;
    `starts`: where each group starts in a rank's segment; if `bytes_`, in bytes
    and the outputs typed as the plan's, else in elements of outputs as they are):
    out of its own group's output, a view where the plan is one (an index plan's
    by `index`: its (block, positions))."""
    group = layout.regions[plan.region].group
    size = plan.dtype.itemsize if bytes_ else 1
    typed = outputs[group] if not bytes_ else _typed(outputs[group], plan.dtype)
    return plan.traced_full(typed, world * starts[group] // size, index)


def _gather_unsharded(bucket: TracedBucket, sharded: Sequence[torch.Tensor], cast8: dict,
                      positions: Sequence[torch.Tensor]) -> list:
    return bucket.unsharded(sharded, cast8, positions)


@functools.cache
def _traced_gather():
    """`_gather_unsharded` marked for non-strict tracing, TracedBucket its constant
    argument: made for the first TracedBucket (fs.compile), as resolving them
    imports dynamo, and inductor with it, which `import flexshard` does not."""
    register_constant(TracedBucket)
    return nonstrict_trace(_gather_unsharded)


def unsharded(bucket: TracedBucket, sharded: Sequence[torch.Tensor], cast8: dict) -> list:
    """`bucket`'s unsharded params in a graph dynamo captures: one non-strict
    traced call (AOTAutograd traces its ops; dynamo does not interpret the
    planning Python around them), its index positions passed as tensors of the
    graph."""
    return bucket.traced(bucket, sharded, cast8, bucket.positions)
