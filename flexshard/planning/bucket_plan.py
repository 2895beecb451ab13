"""What a bucket decides once, at wrap time: its three byte layouts (storage,
gather, reduce), the dtypes on the wire, whether it needs hooks at all, and the
copy plans a gather over a layout uses. Pure: no process group, no storage;
the planning wing and the dry run read the same functions the Bucket does."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..config import MixedPrecisionPolicy
from ..placements.subclass import with_gather_dtype
from ..placements.quantized import BlockQuantized
from ..placements.wire import Cast, WireFormat
from .layout import BucketLayout, SlotPlan, plan_layout
from .wire_plan import WirePlan, plan_wire


class LayoutPlans(NamedTuple):
    """What a gather over one layout needs each step, decided at wrap time."""

    keeps_views: bool  # see BucketLayout.keeps_views
    wires: tuple  # ParamWire per slot (planning/wire_plan.py)
    needs_mesh: bool  # a format's encode takes the shard group's DeviceMesh
    is_storage: bool  # the storage buffer is the gather input (no copy-in)
    copy_in_bytes: int
    same_bytes: bool  # the layout is the storage's (no cast): a copy-in, where one runs
    #                   (offload, a storage short of the segment), copies the buffer whole
    copy_in: object = None  # planning/fused.py CopyInPlan: the one foreach copy (cast)
    copy_out: object = None  # planning/fused.py CopyOutPlans


def _gather_dtype(slot: SlotPlan, mp: MixedPrecisionPolicy) -> torch.dtype:
    if mp.param_dtype is not None and slot.dtype.is_floating_point:
        return mp.param_dtype
    return slot.dtype


def hooks_needed(slots: Sequence[SlotPlan], mp: MixedPrecisionPolicy, world_size: int,
                 replicas: int = 1, offload: bool = False, sub_mesh: bool = False) -> bool:
    """False at world size 1 without replicas, offload or a cast when every piece
    has the full shape: the sharded params are the full ones (Bucket.needs_hooks).
    A bucket on a mesh of its own smaller than the model's (`sub_mesh`: experts of
    one rank per expert-parallel group) is hooked even then: its grads are divided
    by the model's world size, and DTensor experts are rebuilt in forward."""
    return (world_size > 1 or replicas > 1 or offload or sub_mesh
            or any(f != Cast(s.dtype) for s, f in zip(slots, wire_formats(slots, mp, world_size)))
            or any(s.local_shapes[0] != s.shape for s in slots))


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
    gather: BucketLayout  # the all-gather: every slot's wire parts (see `wire`)
    reduce: BucketLayout  # the reduce-scatter of the trainable slots (one reduce dtype)
    wire: WirePlan  # what each slot sends in the all-gather
    # the gather layout with no uneven group (`gather` itself when it has none): for a
    # gather that slices or encodes rank-major blocks (gathers_uneven says which)
    padded: BucketLayout = None
    # the reduce layout with no uneven group (`reduce` itself when it has none): for the
    # whole-step graph's reduce_scatter_tensor (runtime/traced.py)
    padded_reduce: BucketLayout = None

    def gather_for(self, reshard_after_forward) -> BucketLayout:
        """The gather layout a bucket resharding so gathers over (see gathers_uneven)."""
        return self.gather if _reshards_whole(reshard_after_forward) else self.padded


def wire_formats(slots: Sequence[SlotPlan], mp: MixedPrecisionPolicy, world_size: int) -> tuple:
    """Each slot's wire format: its tensor subclass's own gather, else the
    policy's gather_format's choice, else a cast to the policy's param_dtype (or none)."""
    out = []
    for s in slots:
        dtype = _gather_dtype(s, mp)
        if s.subclass is not None:  # the param's own tensor subclass gathers it
            out.append(with_gather_dtype(s.subclass, dtype))
            continue
        chosen = None if mp.gather_format is None else \
            mp.gather_format.format(s.fqn, s.shape, s.dtype, dtype, s.placement, world_size)
        if chosen is not None:
            _check_chosen(chosen, s, dtype, mp.gather_format, world_size)
        out.append(Cast(dtype) if chosen is None else chosen)
    return tuple(out)


def _check_chosen(chosen, s: SlotPlan, dtype: torch.dtype, policy, world_size: int) -> None:
    """A policy's choice for slot `s`, checked at wrap time on every rank: what
    would fail at the first gather (on some ranks) fails here, naming the param."""
    said = f"the gather_format {policy!r} returned {chosen!r} for parameter {s.fqn!r}"
    if not isinstance(chosen, WireFormat):
        raise TypeError(f"{said}; its format() must return a fs.WireFormat "
                        "(fs.BlockQuantized(...), a subclass of your own) or None (a cast)")
    if isinstance(chosen, BlockQuantized) and chosen.out_dtype != dtype:
        raise ValueError(f"{said}, whose gathers decode to {dtype}: give it out_dtype={dtype}")
    try:
        chosen.parts(s.shape, s.placement, world_size)
    except ValueError as e:
        raise ValueError(f"parameter {s.fqn!r}: {e}") from e


def _reshards_whole(reshard_after_forward) -> bool:
    """A bool reshard_after_forward (an int N keeps a rank-major slice: PostForwardShard)."""
    return isinstance(reshard_after_forward, bool)


def gathers_uneven(wire: WirePlan, offload: bool) -> bool:
    """The one rule for uneven gather groups (layout.py, design.md "Gather groups"):
    a bucket's gather layout has them when every param is sent as it is (a Cast:
    encoded formats write and read rank-major blocks) and its storage is not
    offloaded (the staged copy-in writes a segment); and it gathers over that
    layout while reshard_after_forward is a bool (an int's kept slice cuts
    rank-major blocks: BucketLayouts.gather_for). Elsewhere, and in the whole-step
    graph (runtime/traced.py), the padded layout."""
    return not offload and all(isinstance(f, Cast) for f in wire.formats)


def plan_bucket_layouts(slots: Sequence[SlotPlan], trainable: Sequence[bool],
                        mp: MixedPrecisionPolicy, world_size: int,
                        offload: bool = False) -> BucketLayouts:
    """The layouts a Bucket of `slots` uses; the dry run (planning/dry_run_plan.py) reads the same."""
    grads = [s for s, t in zip(slots, trainable) if t]
    reduce_dtype = _reduce_dtype(grads, mp)
    wire = plan_wire(slots, wire_formats(slots, mp, world_size), world_size)
    wire_dtypes = [s.dtype for s in wire.slots]
    padded = plan_layout(wire.slots, wire_dtypes, world_size)
    gather = padded
    if gathers_uneven(wire, offload):
        uneven = plan_layout(wire.slots, wire_dtypes, world_size, uneven=True)
        gather = uneven if any(reg.uneven for reg in uneven.regions) else padded
    # The reduce-scatter's uneven groups run on every backend and for every wire format
    # (the reduce input is the plain grads, packed on the compute device): always, and
    # for a packed group of whole tensors too (Owned: no padding, each rank its own).
    padded_reduce = plan_layout(grads, [reduce_dtype] * len(grads), world_size)
    reduce = plan_layout(grads, [reduce_dtype] * len(grads), world_size, uneven=True,
                         owners_uneven=True)
    if not any(reduce.uneven):
        reduce = padded_reduce
    return BucketLayouts(plan_layout(slots, [s.dtype for s in slots], world_size), gather,
                         reduce, wire, padded, padded_reduce)
