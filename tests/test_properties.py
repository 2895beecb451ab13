"""Property tests (hypothesis) of the bucket math for random shapes, dtypes,
world sizes 1 to 8 and every placement (Shard, Owned, RaggedShard).

tests/test_layout_properties.py checks one storage layout in isolation (worlds
of up to 5). Here a whole world of Buckets runs in one process, through a Comm
that plays the collectives, so the properties hold for the code that trains:
- local sizes sum to the global size (ragged rounding sums exactly);
- storage, gather (param_dtype) and reduce layouts: byte ranges disjoint and
  aligned per rank and in the gathered buffer;
- shard then unshard is the identity through the bucket's all-gather, bitwise,
  also with a param_dtype cast;
- the reduce-scatter hands every rank its piece of the mean gradient (grads
  pre-divided by a power of two, summed, divided by the rest), bitwise;
- binding (Owned owners, balanced RaggedShard rows) is deterministic and balanced.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import flexshard as fs
from flexshard.runtime.bucket import Bucket
from flexshard.planning.layout import SlotPlan, bind_placements
from harness import run_world

SETTINGS = settings(max_examples=40, deadline=None)
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
DTYPES = FLOATS + [torch.int64, torch.int32, torch.uint8]  # integer params are frozen
shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(torch.Size)


@st.composite
def placements(draw, shape, world):
    """Any placement that can split `shape` over `world` ranks."""
    choices = [st.just(fs.Owned()), st.integers(0, world - 1).map(fs.Owned)]
    if len(shape):
        units = st.none() | st.lists(st.integers(0, 4), min_size=world, max_size=world).filter(
            lambda u: sum(u) > 0).map(tuple)
        choices += [st.integers(-len(shape), len(shape) - 1).map(fs.Shard),
                    st.builds(fs.RaggedShard, st.integers(1, len(shape)).map(
                        lambda n: tuple(range(n))), units)]
    return draw(st.one_of(choices))


@st.composite
def buckets(draw, max_params=5):
    """(world, slots, trainable): a bucket of bound, mixed placements and dtypes."""
    world = draw(st.integers(1, 8))
    entries, dtypes = [], []
    for _ in range(draw(st.integers(1, max_params))):
        shape, dtype = draw(shapes), draw(st.sampled_from(DTYPES))
        placement = draw(placements(shape, world))
        placement.check(shape, world)
        entries.append((shape, dtype.itemsize, placement))
        dtypes.append(dtype)
    bound = bind_placements(entries, world)
    slots = [SlotPlan(f"p{i}", shape, dtype, pl,
                      tuple(pl.local_shape(shape, r, world) for r in range(world)))
             for i, ((shape, _, _), dtype, pl) in enumerate(zip(entries, dtypes, bound))]
    trainable = [d.is_floating_point and draw(st.booleans()) for d in dtypes]
    return world, slots, trainable


policies = st.sampled_from([
    fs.MixedPrecisionPolicy(),
    fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    fs.MixedPrecisionPolicy(reduce_dtype=torch.float64),
])


class PlayedComm(fs.GlooComm):
    """One rank's Comm in a world played in one process. Each collective runs
    twice: while `world.recording`, it stores what this rank sends; then it
    returns what the real collective would, from every rank's recording."""

    def __init__(self, world: "PlayedWorld", rank: int) -> None:
        self.world, self.rank = world, rank

    def all_gather(self, output, input, group, async_op=False):
        if self.world.recording:
            self.world.sent[self.rank] = input.clone()
        else:
            output.copy_(torch.cat([self.world.sent[r] for r in range(self.world.size)]))

    def reduce_scatter(self, output, input, group, async_op=False):
        if self.world.recording:
            self.world.sent[self.rank] = input.clone()
            return
        total = torch.zeros_like(output)
        for r in range(self.world.size):  # in rank order, as the expected values
            total += self.world.sent[r].view(self.world.size, -1)[self.rank]
        output.copy_(total)

    def reduce_scatter_uneven(self, output, input, sizes, group, async_op=False):
        if self.world.recording:
            self.world.sent[self.rank] = input.clone()
            return
        at = sum(sizes[:self.rank])
        total = torch.zeros_like(output[:sizes[self.rank]])
        for r in range(self.world.size):  # in rank order, as the expected values
            total += self.world.sent[r][at:at + sizes[self.rank]]
        output[:sizes[self.rank]].copy_(total)


class PlayedWorld:
    """`size` Buckets over the same slots, one per rank, fed the same full tensors."""

    def __init__(self, slots, trainable, mp, size: int, fulls: dict) -> None:
        self.size, self.recording, self.sent = size, False, {}
        self.buckets = [Bucket("b", slots, trainable, mp, False, None, r, size,
                               PlayedComm(self, r), torch.device("cpu")) for r in range(size)]
        for bucket in self.buckets:
            bucket.load_full(fulls.__getitem__)

    def run(self, call) -> list:
        """call(bucket, rank) on every rank, once recording and once for real."""
        self.recording = True
        for r, bucket in enumerate(self.buckets):
            call(bucket, r)
        self.recording = False
        return [call(bucket, r) for r, bucket in enumerate(self.buckets)]


def random_bytes(shape, dtype, gen) -> torch.Tensor:
    """Any bit pattern, NaNs included (compared bytewise)."""
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8,
                        generator=gen)
    return raw.view(dtype).view(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that a NaN's payload is free: torch's CPU cast writes a
    different NaN from its vectorised and its scalar loop (fp32 -> bf16: 0xFFFF or
    0x7FC0), so which one a cast gives depends on where the value sits in its tensor."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous().view(-1), b.contiguous().view(-1)
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a[~nan], b[~nan]
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@SETTINGS
@given(buckets())
def test_local_sizes_sum_to_the_global_size(bucket):
    world, slots, _ = bucket
    for slot in slots:
        assert sum(math.prod(s) for s in slot.local_shapes) == math.prod(slot.shape)
        if isinstance(slot.placement, fs.RaggedShard):  # rounding: whole rows, summing exactly
            assert sum(s[0] for s in slot.local_shapes) == math.prod(
                slot.shape[:len(slot.placement.dims)])
        if isinstance(slot.placement, fs.Owned) and math.prod(slot.shape):
            assert [math.prod(s) > 0 for s in slot.local_shapes].count(True) == 1


def _check_layout(layout, slots, world: int) -> None:
    widest = max(reg.dtype.itemsize for reg in layout.regions)
    assert layout.segment_bytes % widest == 0
    spans = []
    for i, (reg, slot) in enumerate(zip(layout.regions, slots)):
        for r in range(world):
            assert reg.offsets[r] % reg.dtype.itemsize == 0
            assert reg.nbytes[r] == math.prod(slot.local_shapes[r]) * reg.dtype.itemsize
            assert reg.offsets[r] + reg.nbytes[r] <= layout.segment_bytes
            if reg.nbytes[r]:
                start = layout.piece_start(i, r)
                spans.append((start, start + reg.nbytes[r]))
    spans.sort()  # every piece of every rank: disjoint in the gathered buffer
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all(end <= layout.wire_bytes for _, end in spans)


@SETTINGS
@given(buckets(), policies)
def test_storage_gather_and_reduce_layouts_are_disjoint_and_aligned(bucket, mp):
    world, slots, trainable = bucket
    b = Bucket("b", slots, trainable, mp, False, None, 0, world, fs.Comm(), torch.device("cpu"))
    _check_layout(b.storage.layout, slots, world)
    _check_layout(b.gather.layout, slots, world)
    if b.grad_slots:
        _check_layout(b.grads.layout, [slots[i] for i in b.grad_slots], world)


@SETTINGS
@given(buckets(), policies, st.integers(0, 2**31))
def test_gather_unshards_every_parameter_bitwise(bucket, mp, seed):
    world, slots, trainable = bucket
    gen = torch.Generator().manual_seed(seed)
    fulls = {s.fqn: random_bytes(s.shape, s.dtype, gen) for s in slots}
    played = PlayedWorld(slots, trainable, mp, world, fulls)
    for outs in played.run(lambda bucket, rank: bucket.gather.gather()):
        for slot, out in zip(slots, outs):
            full = fulls[slot.fqn]
            if mp.param_dtype is not None and full.is_floating_point():
                full = full.to(mp.param_dtype)  # the cast the gather input makes
            assert same_bytes(out, full), slot


@SETTINGS
@given(buckets(), policies, st.integers(0, 2**31))
def test_reduce_gives_each_rank_its_piece_of_the_mean_gradient(bucket, mp, seed):
    world, slots, trainable = bucket
    assume(any(trainable))  # a frozen bucket's gather is not differentiable: no reduce
    gen = torch.Generator().manual_seed(seed)
    fulls = {s.fqn: torch.zeros(s.shape, dtype=s.dtype) for s in slots}
    played = PlayedWorld(slots, trainable, mp, world, fulls)
    grads = [[torch.randn(s.shape, generator=gen).to(s.dtype) if t else None
              for s, t in zip(slots, trainable)] for _ in range(world)]
    results = played.run(lambda bucket, rank: bucket.grads.finish(bucket.grads.start(grads[rank])))
    reduce_dtype = played.buckets[0].grads.layout.regions[0].dtype
    for i, slot in enumerate(slots):
        if not trainable[i]:
            assert all(out[i] is None for out in results)
            continue
        mean = torch.zeros(slot.shape, dtype=reduce_dtype)
        mantissa, exponent = math.frexp(world)  # gloo has no AVG: pre-divide by a power
        for r in range(world):  # of two, the same sum in the same order as the collective,
            mean += grads[r][i].to(reduce_dtype) * 2.0 ** (1 - exponent)
        if world > 1 and mantissa != 0.5:
            mean /= 2 * mantissa  # then the rest of the factor
        for r in range(world):
            want = slot.placement.shard(mean, r, world).to(slot.dtype)
            assert same_bytes(results[r][i], want), (slot, r)


@SETTINGS
@given(st.integers(1, 8), st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)),
                                   min_size=1, max_size=12))
def test_owner_assignment_is_deterministic_and_balanced(world, sizes):
    entries = [(torch.Size(s), 4, fs.Owned()) for s in sizes]
    owners = [p.rank for p in bind_placements(entries, world)]
    assert owners == [p.rank for p in bind_placements(entries, world)]
    load = [0] * world
    for (shape, itemsize, _), owner in zip(entries, owners):
        load[owner] += math.prod(shape) * itemsize
    # each param went to the least-loaded rank: no rank ends more than one param ahead
    assert max(load) - min(load) <= max(math.prod(s) * 4 for s in sizes)


@SETTINGS
@given(st.integers(1, 8), st.lists(st.integers(0, 20), min_size=1, max_size=8))
def test_balanced_ragged_rows_are_deterministic_and_even(world, rows):
    entries = [(torch.Size((n, 3)), 4, fs.RaggedShard()) for n in rows]
    bound = bind_placements(entries, world)
    assert bound == bind_placements(entries, world)
    for (shape, _, _), placement in zip(entries, bound):
        sizes = [placement.local_shape(shape, r, world)[0] for r in range(world)]
        assert sum(sizes) == shape[0] and max(sizes) - min(sizes) <= 1


# ---- found by these properties, end to end


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
