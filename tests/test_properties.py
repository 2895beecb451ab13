"""Property tests (hypothesis) of the layout math for random shapes, dtypes,
world sizes 1 to 8 and every placement: shard then unshard is the identity
(directly and through the bucket's bytes), local sizes sum to the global size,
byte ranges are disjoint and aligned, and binding is deterministic."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import flexshard as fs
from harness import run_world
from flexshard.layout import SlotPlan, bind_placements, plan_layout
from flexshard.placements.shard import Shard
from flexshard.storage import gathered_param, segment_views

SETTINGS = settings(max_examples=60, deadline=None)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.int32, torch.int16, torch.uint8]
world_sizes = st.integers(1, 8)
shapes = st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple)


def shard_placements(shape):
    return st.integers(-len(shape), len(shape) - 1).map(Shard)


PLACEMENTS = [shard_placements]  # one strategy (shape -> placements) per placement


@st.composite
def placed(draw, shape=None):
    """(shape, dtype, placement) for any placement that can split the shape."""
    shape = draw(shapes) if shape is None else shape
    placement = draw(st.one_of([make(shape) for make in PLACEMENTS]))
    return shape, draw(st.sampled_from(DTYPES)), placement


@st.composite
def buckets(draw):
    """(world size, [(shape, dtype, placement)]) for a bucket of 1 to 5 parameters."""
    return draw(world_sizes), draw(st.lists(placed(), min_size=1, max_size=5))


def random_tensor(shape, dtype, seed) -> torch.Tensor:
    """Random bytes viewed as `dtype` (compared bytewise, so NaN patterns are fine)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def bound_slots(entries, world_size) -> list:
    bound = bind_placements([(s, d.itemsize, p) for s, d, p in entries], world_size)
    return [SlotPlan(f"p{i}", torch.Size(s), d, pl,
                     tuple(pl.local_shape(torch.Size(s), r, world_size) for r in range(world_size)))
            for i, ((s, d, _), pl) in enumerate(zip(entries, bound))]


@SETTINGS
@given(placed(), world_sizes, st.integers(0, 2**31))
def test_shard_then_unshard_is_identity(entry, world_size, seed):
    shape, dtype, placement = entry
    placement.check(torch.Size(shape), world_size)
    (slot,) = bound_slots([entry], world_size)
    full = random_tensor(shape, dtype, seed)
    pieces = [slot.placement.shard(full, r, world_size) for r in range(world_size)]
    assert [p.shape for p in pieces] == list(slot.local_shapes)
    assert same_bytes(slot.placement.unshard(pieces, full.shape), full)


@SETTINGS
@given(placed(), world_sizes)
def test_local_sizes_sum_to_the_global_size(entry, world_size):
    (slot,) = bound_slots([entry], world_size)
    assert sum(math.prod(s) for s in slot.local_shapes) == math.prod(entry[0])
    for local in slot.local_shapes:
        assert len(local) == len(entry[0])


def _check_layout(layout, slots, dtypes, world_size) -> None:
    widest = max(d.itemsize for d in dtypes)
    assert layout.segment_bytes % widest == 0
    for r in range(world_size):
        spans = []
        for reg, slot, dtype in zip(layout.regions, slots, dtypes):
            assert reg.dtype == dtype and reg.offsets[r] % dtype.itemsize == 0
            assert reg.nbytes[r] == math.prod(slot.local_shapes[r]) * dtype.itemsize
            spans.append((reg.offsets[r], reg.offsets[r] + reg.nbytes[r]))
        spans = sorted(s for s in spans if s[0] < s[1])
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
        assert all(end <= layout.segment_bytes for _, end in spans)
    starts = sorted((layout.piece_start(i, r), layout.piece_start(i, r) + reg.nbytes[r])
                    for i, reg in enumerate(layout.regions) for r in range(world_size)
                    if reg.nbytes[r])
    assert all(a[1] <= b[0] for a, b in zip(starts, starts[1:]))
    assert all(end <= layout.wire_bytes for _, end in starts)
    assert layout.ideal_bytes == sum(sum(reg.nbytes) for reg in layout.regions)


@SETTINGS
@given(buckets(), st.sampled_from([None, torch.bfloat16, torch.float32]))
def test_byte_ranges_are_disjoint_and_aligned(bucket, param_dtype):
    world_size, entries = bucket
    slots = bound_slots(entries, world_size)
    storage = [s.dtype for s in slots]
    gather = [param_dtype if param_dtype and d.is_floating_point else d for d in storage]
    for dtypes in (storage, gather):
        _check_layout(plan_layout(slots, dtypes, world_size), slots, dtypes, world_size)


@SETTINGS
@given(buckets(), st.integers(0, 2**31))
def test_gathered_bytes_unshard_every_parameter(bucket, seed):
    """Each rank writes its pieces into its segment; the rank-major concatenation
    of the segments (what the all-gather makes) yields every full parameter."""
    world_size, entries = bucket
    slots = bound_slots(entries, world_size)
    layout = plan_layout(slots, [s.dtype for s in slots], world_size)
    fulls = [random_tensor(s.shape, s.dtype, seed + i) for i, s in enumerate(slots)]
    segments = []
    for r in range(world_size):
        segment = torch.zeros(layout.segment_bytes, dtype=torch.uint8)
        for slot, view, full in zip(slots, segment_views(segment, layout, slots, r), fulls):
            view.copy_(slot.placement.shard(full, r, world_size))
        segments.append(segment)
    gathered = torch.cat(segments)
    for i, (slot, full) in enumerate(zip(slots, fulls)):
        out, copied = gathered_param(gathered, layout, slot, i)
        assert same_bytes(out, full)
        zero_copy = layout.gathered_range(i) is not None and slot.placement.rank_major(slot.shape)
        assert copied == (0 if zero_copy else full.numel() * full.element_size())


@SETTINGS
@given(buckets())
def test_binding_is_deterministic(bucket):
    world_size, entries = bucket
    first, again = bound_slots(entries, world_size), bound_slots(entries, world_size)
    assert first == again
    assert all(p.placement.bind(p.shape, p.dtype.itemsize, world_size, (0,) * world_size)
               == p.placement for p in first)  # a bound placement binds to itself


# ---- a regression the properties found, end to end


def _column_sharded_linear():
    """A bucket holding one weight sharded on dim 1: the ranks' pieces lie back to
    back in the gathered bytes but are not the flattened weight (not rank_major)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5, bias=False))
    reference = nn.Sequential(nn.Linear(4, 5, bias=False))
    reference.load_state_dict(model.state_dict())
    fs.flex_shard(model, placement=fs.Shard(1))
    x = torch.randn(3, 4)
    out, want = model(x), reference(x)
    out.square().sum().backward()
    want.square().sum().backward()
    full_grad = [torch.empty(5, 2) for _ in range(dist.get_world_size())]
    dist.all_gather(full_grad, model[0].weight.grad.contiguous())
    return out.detach(), want.detach(), torch.cat(full_grad, 1), reference[0].weight.grad


@pytest.mark.world
def test_column_sharded_parameter_matches_reference():
    for out, want, grad, want_grad in run_world(2, _column_sharded_linear):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
