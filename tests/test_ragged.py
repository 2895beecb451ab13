"""RaggedShard(dims, units) and fs.shard_sizes: blocks of rows in proportion
to units, balanced by default, in the bucket's one gather and one reduce."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from flexshard.planning.layout import bind_placements
from harness import expect_all_ranks_raise, run_world
from reference import assert_one_collective_per_bucket, check_parity, make_model

pytestmark = pytest.mark.world


def test_shard_sizes_largest_remainder():
    assert fs.shard_sizes(10, (1, 0, 2)) == [3, 0, 7]  # quotas 3.33, 0, 6.67
    assert fs.shard_sizes(7, (1, 1, 1, 1)) == [2, 2, 2, 1]  # ties go to the lower rank
    assert fs.shard_sizes(5, (3, 0, 1)) == [4, 0, 1]
    assert fs.shard_sizes(3, (5, 5, 1)) == [2, 1, 0]  # a positive unit may still get 0 rows
    assert fs.shard_sizes(0, (2, 1)) == [0, 0]


def test_shard_sizes_balanced():
    for n in range(12):
        for world in range(1, 6):
            sizes = fs.shard_sizes(n, world_size=world)
            assert sum(sizes) == n and max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)
    assert fs.shard_sizes(3, world_size=4) == [1, 1, 1, 0]  # torch.chunk would give 1, 1, 1, 0 too
    assert fs.shard_sizes(6, world_size=4) == [2, 2, 1, 1]  # torch.chunk: 2, 2, 2, 0


def test_shard_sizes_errors():
    with pytest.raises(ValueError, match=r"units must be >= 0, got \(1, -1\)"):
        fs.shard_sizes(4, (1, -1))
    with pytest.raises(ValueError, match=r"units are all 0; give at least one rank a positive"):
        fs.shard_sizes(4, (0, 0))
    with pytest.raises(ValueError, match=r"2 units for world_size=3; give one unit per rank"):
        fs.shard_sizes(4, (1, 1), world_size=3)
    with pytest.raises(ValueError, match=r"needs world_size= when no process group"):
        fs.shard_sizes(4)
    with pytest.raises(ValueError, match=r"n must be an int >= 0, got -1"):
        fs.shard_sizes(-1, world_size=2)


def _sizes_from_group():
    return fs.shard_sizes(5)


def test_shard_sizes_world_from_process_group():
    assert run_world(2, _sizes_from_group) == [[3, 2], [3, 2]]


def test_flattened_dims_and_round_trip():
    full = torch.arange(2 * 5 * 3.0).view(2, 5, 3)
    ragged = fs.RaggedShard(dims=(0, 1), units=(1, 2, 0))  # 10 rows of 3: 3, 7, 0
    shapes = [ragged.local_shape(full.shape, r, 3) for r in range(3)]
    assert shapes == [torch.Size((3, 3)), torch.Size((7, 3)), torch.Size((0, 3))]
    pieces = [ragged.shard(full, r, 3) for r in range(3)]
    assert pieces[1].data_ptr() == full.data_ptr() + 3 * 3 * 4  # views of the rows
    assert torch.equal(ragged.unshard(pieces, full.shape), full)
    assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]), full.reshape(-1))
    assert ragged.rank_major(full.shape)
    every = fs.RaggedShard(dims=(0, 1, 2))  # all dims: single elements
    assert every.bind(full.shape, 4, 4, (0, 0, 0, 0)).local_shape(full.shape, 0, 4) == (8,)


def test_balanced_bind_gives_extra_rows_to_lightest_ranks():
    bound = fs.RaggedShard().bind(torch.Size((10, 2)), 4, 4, (50, 10, 30, 10))
    assert bound == fs.RaggedShard((0,), (2, 3, 2, 3))  # ranks 1 and 3 hold the fewest bytes
    entries = [(torch.Size((n,)), 4, fs.RaggedShard()) for n in (7, 5, 4)]
    sizes = [[p.local_shape(e[0], r, 3)[0] for r in range(3)]
             for e, p in zip(entries, bind_placements(entries, 3))]
    assert sizes == [[3, 2, 2], [1, 2, 2], [2, 1, 1]]  # 7 first; then 5 and 4 fill the gaps
    totals = [sum(s[r] for s in sizes) for r in range(3)]
    assert max(totals) - min(totals) <= 1


def test_construction_errors():
    with pytest.raises(ValueError, match=r"RaggedShard\(units=\(2, -1\)\): units must be >= 0"):
        fs.RaggedShard(units=(2, -1))
    with pytest.raises(ValueError, match=r"RaggedShard\(units=\(0, 0\)\): units are all 0"):
        fs.RaggedShard(units=(0, 0))
    with pytest.raises(ValueError, match=r"RaggedShard\(dims=\(1,\)\): dims must be a prefix "
                                         r"of the tensor's dims, i\.e\. \(0,\)"):
        fs.RaggedShard(dims=(1,))
    with pytest.raises(ValueError, match=r"dims must be a prefix .* i\.e\. \(0, 1\)"):
        fs.RaggedShard(dims=(0, 2))
    with pytest.raises(TypeError, match=r"dims must be a non-empty tuple of ints"):
        fs.RaggedShard(dims=())
    with pytest.raises(TypeError, match=r"units must be ints, got 1\.5"):
        fs.RaggedShard(units=(1.5, 1))


def test_hashable_value():
    assert fs.RaggedShard(units=[1, 2]) == fs.RaggedShard((0,), (1, 2))
    assert len({fs.RaggedShard(units=[1, 2]), fs.RaggedShard((0,), (1, 2))}) == 1
    assert repr(fs.RaggedShard(units=[1, 2])) == "RaggedShard(dims=(0,), units=(1, 2))"


def _bad_units_length():
    _wrap_with(fs.RaggedShard(units=(1, 2, 3)))


def _bad_dims_for_bias():
    _wrap_with(fs.RaggedShard(dims=(0, 1)))


def _wrap_with(placement):
    fs.flex_shard(make_model(), buckets=[
        fs.BucketSpec("layers.0.*", placement=placement, name="block0"),
        fs.BucketSpec(["tok.*", "pos", "layers.1.*", "norm.*", "head.*"], name="rest")])


def test_errors_name_param_bucket_and_value():
    expect_all_ranks_raise(
        2, _bad_units_length, ValueError,
        r"parameter 'layers\.0\.norm1\.weight' in bucket 'block0': RaggedShard\(units=\(1, 2, 3\)\)"
        r" has 3 units for a world of 2 ranks; give one unit per rank")
    expect_all_ranks_raise(
        2, _bad_dims_for_bias, ValueError,
        r"parameter 'layers\.0\.norm1\.weight' in bucket 'block0': RaggedShard\(dims=\(0, 1\)\) "
        r"cannot split rows of shape \(30,\): it has only 1 dim\(s\); use dims=\(0,\) or fewer")


def test_zero_dim_tensor_is_refused():
    with pytest.raises(ValueError, match=r"a 0-dim tensor has no rows; use Owned\(\) for it"):
        fs.RaggedShard().check(torch.Size(()), 2)


@pytest.mark.parametrize("world,reshard", [(1, True), (2, True), (2, False)])
def test_parity_balanced(world, reshard):
    results = check_parity(world, {"placement": fs.RaggedShard(),
                                   "reshard_after_forward": reshard}, count_comms=True)
    if world > 1:
        assert_one_collective_per_bucket(results)


def uneven_units(fqn, param):
    """Three ranks: weights mostly on rank 0, rank 1 empty; vectors flattened whole."""
    if param.dim() > 1:
        return fs.RaggedShard(units=(3, 0, 1))
    return fs.RaggedShard(units=(1, 1, 1))


def test_parity_uneven_units_three_ranks():
    results = check_parity(3, {"placement": uneven_units}, count_comms=True)
    assert_one_collective_per_bucket(results)


def test_parity_four_ranks_balanced_no_reshard():
    results = check_parity(4, {"placement": fs.RaggedShard(), "reshard_after_forward": False},
                           count_comms=True)
    assert_one_collective_per_bucket(results)


# Uneven gather groups: a large RaggedShard param split unevenly (171, 171, 170 rows)
# is gathered by one broadcast per rank straight into its full tensor, which views it.

BIG = {"dim": 128, "hidden": 512, "heads": 4}  # at 3 ranks: up, down, proj split unevenly
UNEVEN = ("proj.weight", "up.weight", "down.weight")


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=0.05)


def _ragged_slot(fqn, shape, world):
    from flexshard.planning.layout import SlotPlan

    placement = fs.RaggedShard().bind(torch.Size(shape), 4, world, (0,) * world)
    shapes = tuple(placement.local_shape(torch.Size(shape), r, world) for r in range(world))
    return SlotPlan(fqn, torch.Size(shape), torch.float32, placement, shapes)


def test_an_uneven_ragged_param_is_its_own_uneven_group_and_a_view_of_its_block():
    from flexshard.planning.layout import plan_layout

    world = 3
    slots = [_ragged_slot("norm", (128,), world), _ragged_slot("up", (512, 128), world)]
    padded = plan_layout(slots, [torch.float32] * 2, world)
    layout = plan_layout(slots, [torch.float32] * 2, world, uneven=True)
    assert padded.uneven == (None,) and padded.gathered_range(1) is None  # copied out
    rows = [s[0] for s in slots[1].local_shapes]
    assert sorted(rows) == [170, 171, 171]
    assert layout.uneven == (tuple(r * 512 for r in rows), None)
    assert layout.regions[1].uneven and layout.spans[0] == (0, 171 * 512)  # its widest piece
    assert layout.block(0) == (0, 512 * 512)  # no padding: the pieces back to back
    assert layout.gathered_range(1) == (0, 512 * 512)
    assert [layout.piece_start(1, r) for r in range(world)] == [0, rows[0] * 512,
                                                               (rows[0] + rows[1]) * 512]
    assert layout.wire_bytes == 512 * 512 + layout.block_bytes[1] < padded.wire_bytes
    assert sum(b - a for a, b in layout.gaps()) == layout.wire_bytes - layout.ideal_bytes


def test_the_padded_layout_where_a_gather_slices_or_encodes_blocks():
    from flexshard.planning.bucket_plan import plan_bucket_layouts

    world, mp = 3, fs.MixedPrecisionPolicy()
    slots = [_ragged_slot("up", (512, 128), world)]
    layouts = plan_bucket_layouts(slots, [True], mp, world)
    assert layouts.gather.regions[0].uneven and not layouts.padded.regions[0].uneven
    assert layouts.gather_for(True) is layouts.gather is layouts.gather_for(False)
    assert layouts.gather_for(3) is layouts.padded  # an int's kept slice is rank-major
    offloaded = plan_bucket_layouts(slots, [True], mp, world, offload=True)
    assert offloaded.gather is offloaded.padded  # the staged copy-in writes a segment
    # the reduce-scatter's input is the grads back to back, uneven too, on every path but
    # the whole-step graph's, and whatever the gather does (offloaded, an int reshard)
    assert layouts.reduce.regions[0].uneven and offloaded.reduce.regions[0].uneven
    assert layouts.reduce.gathered_range(0) == (0, 512 * 128 * 4)  # the grad packs as a view
    assert not layouts.padded_reduce.regions[0].uneven


def _block_views_uneven_groups(reshard):
    """Rank body: each uneven param, seen inside its Linear's forward, views its block
    of the gather output (the params made once: their gathered buffer)."""
    from flexshard.runtime.state import get_state

    model = fs.flex_shard(make_model(**BIG), placement=fs.RaggedShard(),
                          reshard_after_forward=reshard)
    block = model.layers[0]
    bucket = next(b for b in get_state(model).buckets if b.name == "layers.0")
    layout, seen = bucket.gather.layout, {}
    for name in UNEVEN:
        linear = block.get_submodule(name.rsplit(".", 1)[0])

        def record(module, args, name=name):
            weight = module.weight
            j = next(j for j, s in enumerate(bucket.slots) if s.fqn == f"layers.0.{name}")
            unsharded = bucket.gather.unsharded
            if unsharded is None:  # kept until backward: new tensors per gather
                seen[name] = layout.regions[j].uneven
                return
            gathered = unsharded.gathered
            seen[name] = (layout.regions[j].uneven
                          and weight.untyped_storage().data_ptr()
                          == gathered.untyped_storage().data_ptr()
                          and weight.data_ptr() == gathered.data_ptr()
                          + layout.block(layout.regions[j].group)[0])
        linear.register_forward_pre_hook(record)
    from models import batch, loss_fn

    import torch.distributed as dist

    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    return seen


@pytest.mark.parametrize("reshard", [True, False])
def test_uneven_ragged_params_view_the_gather_output(reshard):
    for seen in run_world(3, _block_views_uneven_groups, reshard):
        assert seen == dict.fromkeys(UNEVEN, True)


def _copied_out(layout) -> int:
    """Bytes a gather over `layout` copies out: the params that view nothing."""
    from flexshard.planning.fused import _uniform

    return sum(reg.nbytes[0] * layout.world_size if _uniform(layout, j) else sum(reg.nbytes)
               for j, reg in enumerate(layout.regions) if layout.gathered_range(j) is None)


@pytest.mark.parametrize("reshard", [True, False])
def test_uneven_groups_train_as_one_process_with_no_copy_out(reshard):
    results = check_parity(3, {"placement": fs.RaggedShard(), "reshard_after_forward": reshard},
                           make_opt=sgd, model_kw=BIG, count_comms=True)
    for name, _, counters, layout, _ in results[0][3]["buckets"]:
        if not name.startswith("layers"):
            continue
        uneven = [j for j, reg in enumerate(layout.regions) if reg.uneven]
        assert len(uneven) == len(UNEVEN), name
        assert all(layout.gathered_range(j) is not None for j in uneven)
        # each gather copied out only the params that view nothing (small ones, packed)
        assert counters["gathers"] > 0
        assert counters["copy_out_bytes"] == _copied_out(layout) * counters["gathers"], name
    for result in results:  # each uneven group: one broadcast per rank, with the all-gathers,
        for got in result[3]["comms"]:  # and one list reduce-scatter in backward
            assert got.get("broadcast_", 0) > 0, got
            assert got.get("reduce_scatter_", 0) >= len(UNEVEN), got


def test_uneven_groups_on_the_fake_backend():
    """One rank of a 6-rank world under torch's "fake" backend (the benchmark's): the
    coalesced broadcasts run, and only the params outside uneven groups are copied out."""
    from benchmarks.harness.fake_world import fake_world
    from flexshard.runtime.state import get_state

    with fake_world(6):  # raises if this process already has a default group
        model = fs.flex_shard(make_model(**BIG), placement=fs.RaggedShard())
        x = torch.randint(0, 37, (2, 11))
        model(x).sum().backward()
        buckets = [b for b in get_state(model).buckets if b.name.startswith("layers")]
        for bucket in buckets:
            layout = bucket.gather.layout
            assert sum(reg.uneven for reg in layout.regions) == len(UNEVEN)
            assert bucket.counters.gathers == 2  # forward, and backward's refill
            assert bucket.counters.copy_out_bytes == 2 * _copied_out(layout)
            assert _copied_out(layout) < sum(sum(reg.nbytes) for reg in layout.regions) // 10
            # one reduce over the uneven reduce layout, no padding in its uneven groups
            reduce = bucket.grads.layout
            assert sum(s is not None for s in reduce.uneven) == len(UNEVEN)
            assert bucket.counters.reduce_wire_bytes == reduce.wire_bytes \
                < bucket.gather.padded_reduce_layout.wire_bytes


def _comm_gathers_uneven(comm_name, async_op):
    """Rank body: Comm.all_gather_groups with an even pair and an uneven one (rank r's
    input its first sizes[r] elements, not written in place), and an uneven pair alone."""
    import torch.distributed as dist

    from flexshard.runtime.comm import Comm
    from flexshard.runtime.gloo import GlooComm

    comm = {"comm": Comm(), "gloo": GlooComm(rooted_min_bytes=0)}[comm_name]
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = (3, 2)[:world]
    even, ragged = torch.zeros(world * 4), torch.zeros(sum(sizes))
    inputs = [torch.full((4,), float(rank)), torch.full((3,), 10.0 + rank)]
    work = comm.all_gather_groups([even, ragged], inputs, None, async_op=async_op,
                                  uneven=(None, sizes))
    if async_op:
        work.wait()
    alone = torch.zeros(sum(sizes))
    at = sum(sizes[:rank])
    alone[at:at + sizes[rank]] = 20.0 + rank  # in place: the input is the output's piece
    work = comm.all_gather_groups([alone], [alone[at:at + sizes[rank]]], None,
                                  async_op=async_op, uneven=(sizes,))
    if async_op:
        work.wait()
    return even.tolist(), ragged.tolist(), alone.tolist()


def _comm_reduces_uneven(comm_name, async_op):
    """Rank body: Comm.reduce_scatter_groups with an even pair and an uneven one whose
    pieces are 3, 0 and 2 elements (a rank with none), then the uneven pair alone."""
    import torch.distributed as dist

    from flexshard.runtime.comm import Comm
    from flexshard.runtime.gloo import GlooComm

    comm = {"comm": Comm(), "gloo": GlooComm(rooted_min_bytes=0)}[comm_name]
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = (3, 0, 2)
    even, ragged = torch.full((2,), -1.0), torch.full((3,), -1.0)
    inputs = [torch.arange(world * 2.0) * (rank + 1), torch.arange(5.0) + 10 * rank]
    work = comm.reduce_scatter_groups([even, ragged], inputs, None, async_op=async_op,
                                      uneven=(None, sizes))
    if async_op:
        work.wait()
    alone = torch.full((3,), -1.0)
    work = comm.reduce_scatter_groups([alone], [torch.arange(5.0) * (rank + 1)], None,
                                      async_op=async_op, uneven=(sizes,))
    if async_op:
        work.wait()
    return even.tolist(), ragged.tolist(), alone.tolist()


@pytest.mark.parametrize("comm", ["comm", "gloo"])
@pytest.mark.parametrize("async_op", [False, True])
def test_comm_reduces_uneven_pieces_into_each_ranks_output(comm, async_op):
    results = run_world(3, _comm_reduces_uneven, comm, async_op)
    full = [3 * k + 30 for k in range(5)]  # sum over ranks of k + 10 * rank
    scaled = [6.0 * k for k in range(5)]  # k * (1 + 2 + 3)
    starts = (0, 3, 3)
    for rank, (even, ragged, alone) in enumerate(results):
        assert even == [6.0 * (2 * rank + k) for k in range(2)]
        n, at = (3, 0, 2)[rank], starts[rank]
        assert ragged == full[at:at + n] + [-1.0] * (3 - n)  # past its piece: untouched
        assert alone == scaled[at:at + n] + [-1.0] * (3 - n)


@pytest.mark.parametrize("comm", ["comm", "gloo"])
@pytest.mark.parametrize("async_op", [False, True])
def test_comm_gathers_uneven_pieces_by_broadcasts(comm, async_op):
    for even, ragged, alone in run_world(2, _comm_gathers_uneven, comm, async_op):
        assert even == [0.0] * 4 + [1.0] * 4
        assert ragged == [10.0] * 3 + [11.0] * 2
        assert alone == [20.0] * 3 + [21.0] * 2


# At 4 ranks the mlp's up (514 rows: 129, 129, 128, 128) is uneven; an int reshard
# keeps a rank-major slice of each block, so its buckets gather over the padded layout.
AT_FOUR = {"dim": 132, "hidden": 514, "heads": 4}


def test_an_int_reshard_trains_over_the_padded_layout():
    results = check_parity(4, {"placement": fs.RaggedShard(), "reshard_after_forward": 2},
                           make_opt=sgd, model_kw=AT_FOUR)
    for name, _, counters, layout, _ in results[0][3]["buckets"]:
        assert not any(reg.uneven for reg in layout.regions), name
        if name.startswith("layers"):
            assert counters["post_forward_gathers"] > 0


def _setter_switches_layouts():
    """Rank body: set_reshard_after_forward(2) moves a bucket to the padded layout and
    True back to the uneven one; a step runs under each."""
    import torch.distributed as dist

    from flexshard.runtime.state import get_state
    from models import batch, loss_fn

    model = fs.flex_shard(make_model(**AT_FOUR), placement=fs.RaggedShard())
    bucket = next(b for b in get_state(model).buckets if b.name == "layers.0")
    seen, x = [], batch(0, dist.get_rank())
    for value in (True, 2, True):
        model.set_reshard_after_forward(value)
        loss_fn(model(x[0]), x[1]).backward()
        seen.append(sum(reg.uneven for reg in bucket.gather.layout.regions))
    return seen


def test_the_reshard_setter_switches_between_the_layouts():
    assert run_world(4, _setter_switches_layouts) == [[1, 0, 1]] * 4


def test_uneven_groups_with_an_empty_rank_train_as_one_process():
    """units=(3, 0, 1): rank 1 holds none of the matrices, so broadcasts nothing."""
    results = check_parity(3, {"placement": uneven_units}, make_opt=sgd, model_kw=BIG)
    layout = next(b[3] for b in results[0][3]["buckets"] if b[0].startswith("layers"))
    assert any(sizes is not None and sizes[1] == 0 for sizes in layout.uneven)
