"""Owned(rank): whole parameters on one rank, owners balanced by bytes, in the
bucket's one all-gather and one reduce-scatter."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from flexshard.planning.layout import bind_placements
from harness import expect_all_ranks_raise, run_world
from reference import assert_one_collective_per_bucket, check_parity, make_model

pytestmark = pytest.mark.world


def test_pieces_shard_and_unshard():
    full = torch.arange(12.0).view(3, 4)
    owned = fs.Owned(1)
    assert [owned.local_shape(full.shape, r, 3) for r in range(3)] == [
        torch.Size((0, 4)), torch.Size((3, 4)), torch.Size((0, 4))]
    pieces = [owned.shard(full, r, 3) for r in range(3)]
    assert pieces[1].data_ptr() == full.data_ptr() and pieces[1].shape == full.shape  # a view
    assert pieces[0].numel() == 0 and pieces[0].dim() == 2  # empty, still a matrix
    joined = owned.unshard(pieces, full.shape)
    assert torch.equal(joined, full) and joined.data_ptr() != full.data_ptr()
    assert owned.rank_major(full.shape)


def test_scalar_param():
    scalar = torch.tensor(3.0)
    owned = fs.Owned(0)
    assert owned.local_shape(scalar.shape, 0, 2) == torch.Size(())
    assert owned.local_shape(scalar.shape, 1, 2) == torch.Size((0,))
    assert torch.equal(owned.unshard([owned.shard(scalar, r, 2) for r in range(2)], scalar.shape),
                       scalar)


def _sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=1e-2)


@pytest.mark.parametrize("world,placement", [(2, fs.Shard(0)), (3, fs.RaggedShard())],
                         ids=["shard-2", "ragged-3"])
def test_a_scalar_under_a_bucket_wide_split_is_owned(world, placement):
    """A 0-dim param (CLIP's temperature) in a bucket given Shard or RaggedShard has
    nothing to split: it is Owned, whole on one rank, and trains as one process does
    (SGD, first-step grads included). flex_shard's default placement is such a split."""
    config = {} if placement == fs.Shard(0) else {"placement": placement}
    results = check_parity(world, config, make_opt=_sgd, model_kw={"logit_scale": True})
    for *_, stats in results:
        (placements,) = [p for name, *_, p in stats["buckets"] if name == "root"]
        assert sum(isinstance(p, fs.Owned) for p in placements) == 1, placements  # logit_scale


def test_owners_balance_bytes_largest_first():
    sizes = [5, 10, 2, 7, 6]  # largest first: 10->r0, 7->r1, 6->r1, 5->r0, 2->r1
    entries = [(torch.Size((n, 3)), 4, fs.Owned()) for n in sizes]
    owners = [p.rank for p in bind_placements(entries, 2)]
    assert owners == [0, 0, 1, 1, 1]
    assert bind_placements(entries, 2) == bind_placements(entries, 2)  # deterministic
    pinned = [(torch.Size((9, 3)), 4, fs.Owned(0))] + entries[:1]
    assert [p.rank for p in bind_placements(pinned, 2)] == [0, 1]  # pinned bytes count


def test_storage_holds_only_each_ranks_own_pieces():
    """The benchmark's odd model (dim 99, hidden 389) over 2 ranks, every param Owned.
    A block's best split is still {qkv, up} against the rest (271,656 against 197,180
    bytes), so its gather segment, sized for the heavy rank, pads the light rank's by
    74,476 bytes: on the wire and in each gather output, inherently. The storage
    buffers hold no such padding (each rank's is its own pieces and their 16-byte
    alignment, where it used to be the segment on every rank; a storage is the whole
    segment only where the padding would be at most 1/16 of it)."""
    from benchmarks.harness.model import build_model

    plan = fs.describe(build_model("odd"), mesh_shape=(1, 2), placement=fs.Owned())
    for b in plan.buckets:
        segment = (b.padding_bytes + sum(b.local_bytes)) // 2
        assert max(b.storage_bytes) == segment
        for stored, local in zip(b.storage_bytes, b.local_bytes):
            assert 0 <= stored - local < 16 * len(b.params)  # alignment gaps only
    blocks = [b for b in plan.buckets if b.name.startswith("layers.")]
    assert all(sorted(b.local_bytes) == [197_180, 271_656] for b in blocks)
    assert all(sorted(b.storage_bytes) == [197_232, 271_664] for b in blocks)  # was 2 x 271,664
    assert all(b.padding_bytes == 74_492 for b in blocks)
    # Over the model: the params a rank stores are its grads plus alignment (they were
    # 1,211,024 bytes on both ranks: 150 kB of padding each).
    assert plan.param_bytes == (1_038_000, 1_062_160)
    assert plan.grad_bytes == (1_037_860, 1_062_016)


def test_construction_errors():
    with pytest.raises(ValueError, match=r"Owned\(rank=-1\): rank must be >= 0"):
        fs.Owned(-1)
    with pytest.raises(TypeError, match=r"Owned\(rank='0'\): rank must be an int or None"):
        fs.Owned("0")


def _rank_outside_world():
    fs.flex_shard(make_model(), buckets=[
        fs.BucketSpec("layers.0.*", placement=fs.Owned(2), name="block0"),
        fs.BucketSpec(["tok.*", "pos", "layers.1.*", "norm.*", "head.*"], name="rest")])


def test_rank_outside_world_names_param_and_bucket():
    expect_all_ranks_raise(
        2, _rank_outside_world, ValueError,
        r"parameter 'layers\.0\.norm1\.weight' in bucket 'block0': Owned\(rank=2\) is outside "
        r"the world of 2 rank\(s\); use a rank in \[0, 1\] or Owned\(\)")


class _OldComm(fs.Comm):
    """A user's Comm written before `uneven=`: it overrides the group reduce."""

    def reduce_scatter_groups(self, outputs, inputs, group, async_op=False, op=None):
        return super().reduce_scatter_groups(outputs, inputs, group, async_op, op)


def _wrap_with_old_comm():
    fs.flex_shard(make_model(), placement=fs.Owned(), comm=_OldComm())


def test_a_comm_without_uneven_is_refused_at_wrap_time():
    expect_all_ranks_raise(
        2, _wrap_with_old_comm, TypeError,
        r"bucket '.+' has uneven groups .+ _OldComm\.reduce_scatter_groups\(\.\.\., "
        r"uneven=sizes\); that override takes no `uneven` argument: accept uneven=None")


@pytest.mark.parametrize("world,reshard", [(1, True), (2, True), (2, False), (3, True)])
def test_parity(world, reshard):
    results = check_parity(world, {"placement": fs.Owned(), "reshard_after_forward": reshard},
                           count_comms=True)
    if world > 1:
        assert_one_collective_per_bucket(results)
    for *_, stats in results:
        for name, bucket_reshard, counters, layout, _ in stats["buckets"]:
            # every unsharded param is a view of the gathered bytes, unless the bucket keeps
            # them through backward and over 1/16 of its gather output is padding (the
            # root at 2 and 3 ranks, the blocks at 3): then all are copied out, each gather
            pins = layout.pins_padding
            copied = world > 1 and not bucket_reshard and pins
            want = counters["gathers"] * layout.ideal_bytes if copied else 0
            assert counters["copy_out_bytes"] == want, name


def test_parity_bf16_param_dtype():
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    check_parity(2, {"placement": fs.Owned(), "mp_policy": mp}, param_dtype=torch.bfloat16)


def _grads_land_on_owners():
    import torch.distributed as dist

    from flexshard.runtime.state import get_state
    from models import batch, loss_fn

    model = fs.flex_shard(make_model(), placement=fs.Owned())
    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    out = []
    for bucket in get_state(model).buckets:
        for slot, param in zip(bucket.slots, bucket.params):
            mine = slot.placement.rank == dist.get_rank()
            out.append((slot.fqn, mine, tuple(param.shape), tuple(param.grad.shape)))
    return out


def _held_bytes():
    import torch.distributed as dist

    from flexshard.runtime.state import get_state
    from models import batch, loss_fn

    model = fs.flex_shard(make_model(), placement=fs.Owned())
    rank = dist.get_rank()
    x, y = batch(0, rank)
    loss_fn(model(x), y).backward()

    def storages(tensors) -> int:
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t.numel()}
        return sum(seen.values())

    return [(b.name, b.storage.layout.segment_bytes, b.storage.layout.storage_bytes(rank),
             b.grads.layout.storage_bytes(rank), storages(b.params),
             storages([p.grad for p in b.params])) for b in get_state(model).buckets]


def test_params_and_grads_hold_no_padding():
    """TinyGPT at 2 ranks, every param Owned: each bucket's segment is over 1/16
    padding for its light rank, whose params and fp32 grads then take their own
    bytes (plus alignment), not the segment (the grads are not views of the padded
    reduce-scatter output)."""
    results = run_world(2, _held_bytes)
    trimmed = 0
    for rank_out in results:
        for name, segment, storage, grads, held_params, held_grads in rank_out:
            assert held_params == storage and held_grads == grads, name
            trimmed += storage < segment
    assert trimmed == len(results[0])  # one light rank per bucket (2 blocks, the root)


def test_the_reduce_input_is_the_grads_back_to_back():
    """Whole tensors on unequal ranks: the gather keeps equal segments (one
    all-gather, padded to the heaviest rank), while the reduce layout's group is
    uneven: each rank's tensors back to back, no padding beyond alignment, each
    grad one span (a view) of the reduce input."""
    from flexshard.planning.bucket_plan import plan_bucket_layouts
    from flexshard.planning.layout import SlotPlan

    world, mp = 3, fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                           reduce_dtype=torch.float32)
    owners = {"a": ((64, 32), 0), "b": ((5,), 1), "c": ((48, 32), 2), "d": ((8,), 0)}
    slots = []
    for fqn, (shape, rank) in owners.items():
        placement = fs.Owned(rank)
        shapes = tuple(placement.local_shape(torch.Size(shape), r, world) for r in range(world))
        slots.append(SlotPlan(fqn, torch.Size(shape), torch.float32, placement, shapes))
    layouts = plan_bucket_layouts(slots, [True] * 4, mp, world)
    reduce, padded = layouts.reduce, layouts.padded_reduce
    assert layouts.gather.uneven == (None,) and padded.uneven == (None,)
    assert reduce.uneven == ((64 * 32 * 4 + 32, 32, 48 * 32 * 4),)  # rank 0: a, then d
    assert reduce.wire_bytes == sum(reduce.uneven[0]) < padded.wire_bytes == 3 * 8224
    assert reduce.wire_bytes - reduce.ideal_bytes == 12  # b's alignment: 20 bytes -> 32
    starts = [reduce.gathered_range(j)[0] for j in range(4)]
    assert starts == [0, 64 * 32 * 4 + 32, 64 * 32 * 4 + 64, 64 * 32 * 4]


def test_gradients_reduce_onto_owners():
    results = run_world(2, _grads_land_on_owners)
    for rank_out in results:
        for fqn, mine, shape, grad_shape in rank_out:
            assert grad_shape == shape, fqn
            assert (torch.Size(shape).numel() > 0) == mine, fqn
    owned = [sum(mine for _, mine, _, _ in r) for r in results]
    assert all(owned) and sum(owned) == len(results[0])  # every param has exactly one owner
