"""Property tests of placements and the bucket layout: shard then unshard is
the identity, sizes sum to the whole, byte ranges are disjoint and aligned,
and the gathered buffer yields every full parameter (as a view or a copy)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexshard as fs
from flexshard.planning.fused import plan_copy_out
from flexshard.planning.layout import ALIGN, SlotPlan, bind_placements, plan_layout
from flexshard.planning.copyplan import plan_copies
from flexshard.planning.wire_plan import cast_wire
from flexshard.runtime.traced import _full_regrouped, _RankOrdered
from flexshard.runtime.unsharded import ParamWire
from flexshard.runtime.storage import segment_views

DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.uint8]
FAST = settings(max_examples=60, deadline=None)

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


def _decoded(gathered, layout, slots, i):
    """(slot i's unsharded tensor, bytes copied): its ParamWire's decode, sent as itself."""
    wire = cast_wire(slots, [s.dtype for s in slots], layout.world_size)
    return ParamWire(layout, wire, i, 0).decode(gathered)


@st.composite
def placements(draw, shape, world):
    """Any placement that accepts `shape` over `world` ranks."""
    kinds = ["owned", "owned_pinned"] + (["shard", "ragged"] if shape else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "owned":
        return fs.Owned()
    if kind == "owned_pinned":
        return fs.Owned(draw(st.integers(0, world - 1)))
    if kind == "shard":
        return fs.Shard(draw(st.integers(-len(shape), len(shape) - 1)))
    dims = tuple(range(draw(st.integers(1, len(shape)))))
    units = draw(st.none() | st.lists(st.integers(0, 4), min_size=world, max_size=world)
                 .filter(lambda u: sum(u) > 0).map(tuple))
    return fs.RaggedShard(dims, units)


@st.composite
def buckets(draw, max_params=5, worlds=st.integers(1, 5)):
    """(world, slots, full tensors): a bucket of mixed placements and dtypes."""
    world = draw(worlds)
    n = draw(st.integers(1, max_params))
    entries, fulls, dtypes = [], [], []
    for i in range(n):
        shape = torch.Size(draw(shapes))
        dtype = draw(st.sampled_from(DTYPES))
        placement = draw(placements(shape, world))
        placement.check(shape, world)
        entries.append((shape, dtype.itemsize, placement))
        fulls.append((torch.arange(math.prod(shape)) % 97 + i).to(dtype).view(shape))
        dtypes.append(dtype)
    bound = bind_placements(entries, world)
    slots = [SlotPlan(f"p{i}", e[0], d, b,
                      tuple(b.local_shape(e[0], r, world) for r in range(world)))
             for i, (e, d, b) in enumerate(zip(entries, dtypes, bound))]
    return world, slots, fulls


def _gathered(layout, slots, fulls, world):
    """The rank-major gather output: what each rank contributes, its pieces at their
    offsets."""
    segments = []
    for r in range(world):
        buffer = torch.zeros(layout.segment_bytes, dtype=torch.uint8)
        for slot, full, view in zip(slots, fulls, segment_views(buffer, layout, slots, r)):
            view.copy_(slot.placement.shard(full, r, world))
        segments.append(buffer)
    return torch.cat(segments)


@FAST
@given(st.integers(0, 200), st.lists(st.integers(0, 9), min_size=1, max_size=6))
def test_shard_sizes_sum_and_proportion(n, units):
    if sum(units) == 0:
        return
    sizes = fs.shard_sizes(n, units)
    assert sum(sizes) == n and len(sizes) == len(units)
    for size, u in zip(sizes, units):
        assert abs(size - n * u / sum(units)) < 1  # largest remainder: within one row
        assert u > 0 or size == 0


@FAST
@given(st.integers(0, 200), st.integers(1, 8))
def test_balanced_sizes_differ_by_at_most_one(n, world):
    sizes = fs.shard_sizes(n, world_size=world)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


@FAST
@given(buckets())
def test_shard_then_unshard_is_identity(bucket):
    world, slots, fulls = bucket
    for slot, full in zip(slots, fulls):
        pieces = [slot.placement.shard(full, r, world) for r in range(world)]
        assert [p.shape for p in pieces] == list(slot.local_shapes)
        assert sum(p.numel() for p in pieces) == full.numel()
        assert torch.equal(slot.placement.unshard(pieces, full.shape), full)
        if slot.placement.rank_major(full.shape):
            assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), full.reshape(-1))


@FAST
@given(buckets())
def test_byte_ranges_disjoint_and_aligned(bucket):
    world, slots, _ = bucket
    layout = plan_layout(slots, [s.dtype for s in slots], world)
    widest = max(s.dtype.itemsize for s in slots)
    assert layout.segment_bytes % widest == 0
    for r in range(world):
        spans = sorted((reg.offsets[r], reg.offsets[r] + reg.nbytes[r])
                       for reg in layout.regions if reg.nbytes[r])
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        assert all(0 <= s and e <= layout.segment_bytes for s, e in spans)
        for reg in layout.regions:
            assert reg.offsets[r] % reg.dtype.itemsize == 0
            assert reg.offsets[r] % ALIGN == 0  # 16-byte aligned views, storage and gathered
    assert layout.segment_bytes % ALIGN == 0
    assert layout.ideal_bytes == sum(s.shape.numel() * s.dtype.itemsize for s in slots)
    assert layout.ideal_bytes <= layout.wire_bytes


@FAST
@given(buckets())
def test_gaps_and_pieces_tile_the_buffer(bucket):
    """The reduce input zeroes only `gaps()`: with the pieces they must cover
    every byte of the rank-major buffer exactly once."""
    world, slots, _ = bucket
    layout = plan_layout(slots, [s.dtype for s in slots], world)
    covered = torch.zeros(layout.wire_bytes, dtype=torch.int32)
    for reg in layout.regions:
        for r in range(world):
            start = r * layout.segment_bytes + reg.offsets[r]
            covered[start:start + reg.nbytes[r]] += 1
    gaps = layout.gaps()
    for start, stop in gaps:
        assert start < stop
        covered[start:stop] += 1
    assert bool((covered == 1).all())
    assert all(a[1] < b[0] for a, b in zip(gaps, gaps[1:]))  # sorted, merged
    assert (not gaps) == layout.dense


@FAST
@given(buckets())
def test_gathered_buffer_holds_every_full_param(bucket):
    world, slots, fulls = bucket
    layout = plan_layout(slots, [s.dtype for s in slots], world)
    gathered = _gathered(layout, slots, fulls, world)
    for i, (slot, full) in enumerate(zip(slots, fulls)):
        out, copied = _decoded(gathered, layout, slots, i)
        assert torch.equal(out, full)
        is_view = layout.gathered_range(i) is not None
        assert copied == (0 if is_view else full.numel() * full.element_size())
        if is_view and full.numel():
            assert gathered.data_ptr() <= out.data_ptr() < gathered.data_ptr() + gathered.numel()
        if isinstance(slot.placement, fs.Owned):
            assert is_view  # one non-empty piece: always zero-copy


@FAST
@given(buckets(worlds=st.sampled_from([2, 4, 6])), st.sampled_from([1, 2, 3]))
def test_an_int_reshards_position_major_gather_holds_every_full_param(bucket, size):
    """fs.compile's int reshard gathers across and then within groups of `size`
    ranks: each gather group's output in position-major order (rank k * size + i
    at i * world/size + k). Every param reads out of it whole, and straight from it
    (no rank-ordered copy) where its pieces lie inside segments (Owned) or in runs of
    whole groups of `size` ranks at the segments' stride (a packed Shard(0) param)."""
    world, slots, fulls = bucket
    if world % size:
        size = world
    layout = plan_layout(slots, [s.dtype for s in slots], world)
    gathered = _gathered(layout, slots, fulls, world)
    blocks = gathered.split([(b - a) * world for a, b in layout.spans])  # rank-major each
    regrouped = [t.view(world // size, size, -1).transpose(0, 1).reshape(-1) for t in blocks]
    starts = [a for a, _ in layout.spans]
    for i, (slot, full, plan) in enumerate(zip(slots, fulls, plan_copies(layout, slots))):
        outputs = _RankOrdered(regrouped, world // size, size)
        seg = layout.stride(i) // full.element_size()
        base = world * starts[layout.regions[i].group] // full.element_size()
        index = plan.index(full.device, base) if plan.kind == "index" else None  # TracedBucket's
        assert torch.equal(_full_regrouped(plan, outputs, layout, starts, world, index), full)
        whole_groups = plan.runs is not None and all(
            run.stride == seg and run.rows % size == 0 and (run.start - base) // seg % size == 0
            for run in plan.runs)
        if isinstance(slot.placement, fs.Owned) or whole_groups:
            assert not outputs._ordered, f"{slot.placement} of {tuple(full.shape)} was reordered"


@FAST
@given(buckets(max_params=6))
def test_each_rank_boundary_carries_at_most_one_chained_param(bucket):
    world, slots, _ = bucket
    layout = plan_layout(slots, [s.dtype for s in slots], world)
    crossing = [0] * world
    for i, reg in enumerate(layout.regions):
        ranks = [r for r in range(world) if reg.nbytes[r]]
        if len(ranks) > 1 and layout.gathered_range(i) is not None:
            for r in range(ranks[0], ranks[-1]):
                crossing[r] += 1
    assert max(crossing) <= 1


def test_two_rank_params_chain_on_every_boundary():
    """Four ranks, three params each split over two neighbours: all three are views.
    (Each piece ending a segment is a multiple of 16 bytes, so chains stay aligned.)"""
    world = 4
    specs = [((12, 4), (1, 1, 0, 0)), ((6, 4), (0, 1, 1, 0)), ((6,), (0, 0, 2, 1)), ((5,), None)]
    entries = [(torch.Size(s), 4, fs.RaggedShard(units=u)) for s, u in specs]
    bound = bind_placements(entries, world)
    slots = [SlotPlan(f"p{i}", e[0], torch.float32, b,
                      tuple(b.local_shape(e[0], r, world) for r in range(world)))
             for i, (e, b) in enumerate(zip(entries, bound))]
    layout = plan_layout(slots, [torch.float32] * 4, world)
    assert [layout.gathered_range(i) is not None for i in range(4)] == [True, True, True, False]


def _bound_slots(specs, world: int) -> list:
    """SlotPlans of float32 params (shape, placement), their placements bound."""
    entries = [(torch.Size(shape), 4, placement) for shape, placement in specs]
    bound = bind_placements(entries, world)
    return [SlotPlan(f"p{i}", e[0], torch.float32, b,
                     tuple(b.local_shape(e[0], r, world) for r in range(world)))
            for i, (e, b) in enumerate(zip(entries, bound))]


def test_at_two_ranks_columns_win_over_a_chain():
    """Two ranks, two Shard(0) params: chaining one across the boundary (a view) would
    shift the other off its column of [world, segment], to be copied on its own; both
    stay columns (one split-copy out and one chunk-cat in for the bucket: fused.py).
    A bucket's only split param, beside Owned ones, still chains: a view."""
    slots = _bound_slots([((8, 4), fs.Shard(0)), ((16, 4), fs.Shard(0))], 2)
    layout = plan_layout(slots, [torch.float32] * 2, 2)
    assert [len(set(reg.offsets)) for reg in layout.regions] == [1, 1]
    assert plan_copy_out(layout, range(2)).columns == {0, 1}
    slots = _bound_slots([((16, 4), fs.Shard(0)), ((3,), fs.Owned()), ((5,), fs.Owned())], 2)
    layout = plan_layout(slots, [torch.float32] * 3, 2)
    assert [layout.gathered_range(i) is not None for i in range(3)] == [True, True, True]


def test_adjacent_pieces_of_a_non_rank_major_param_are_not_a_view():
    """Shard(1) alone in a bucket: its pieces sit back to back, yet in the wrong
    order (columns), so the unsharded param must be joined, not viewed."""
    full = torch.arange(4.0).view(2, 2)
    placement = fs.Shard(1)
    slot = SlotPlan("w", full.shape, full.dtype, placement,
                    tuple(placement.local_shape(full.shape, r, 2) for r in range(2)))
    layout = plan_layout([slot], [full.dtype], 2)
    assert layout.gathered_range(0) is None
    gathered = torch.zeros(layout.wire_bytes, dtype=torch.uint8)
    for r, segment in enumerate(gathered.chunk(2)):  # each piece at its (aligned) offset
        segment_views(segment, layout, [slot], r)[0].copy_(placement.shard(full, r, 2))
    out, copied = _decoded(gathered, layout, [slot], 0)
    assert torch.equal(out, full) and copied == full.numel() * full.element_size()
