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
