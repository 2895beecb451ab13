"""Buckets mixing Shard, Owned and RaggedShard parameters of several dtypes:
still one all-gather and one reduce-scatter per bucket, zero-copy where the
layout allows it, and little padding with the default owners and units."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from flexshard.planning.assign import default_buckets
from flexshard.planning.plan import plan_wrap
from flexshard.planning.layout import ALIGN, plan_layout
from reference import assert_one_collective_per_bucket, check_parity, make_model

pytestmark = pytest.mark.world

STEPS = 3
MIXED = {"bf16_pos": True}  # the position table stays bf16: a mixed-dtype root bucket


def mixed(fqn, param):
    """Every bucket gets all three placements."""
    if fqn.endswith(("qkv.weight", "up.weight", "tok.weight")):
        return fs.Owned()
    if fqn.endswith(("down.weight", "proj.weight")):
        return fs.Shard(0)
    return fs.RaggedShard()


def copy_out_per_gather(layout, reshard: bool = True) -> int:
    """Bytes of the params that are not views of the gathered buffer (all of
    them when the layout does not keep views, see BucketLayout.keeps_views, or
    when a bucket that keeps its params would pin heavy padding: pins_padding)."""
    views = layout.keeps_views and (reshard or not layout.pins_padding)
    return sum(sum(reg.nbytes) for i, reg in enumerate(layout.regions)
               if not views or layout.gathered_range(i) is None)


@pytest.mark.parametrize("world,reshard", [(2, True), (2, False), (3, True)])
def test_parity_and_one_collective_per_bucket(world, reshard):
    results = check_parity(world, {"placement": mixed, "reshard_after_forward": reshard},
                           steps=STEPS, model_kw=MIXED, count_comms=True)
    assert_one_collective_per_bucket(results)
    for *_, stats in results:
        for name, bucket_reshard, counters, layout, placements in stats["buckets"]:
            assert {type(p) for p in placements} >= {fs.Owned, fs.RaggedShard}, name
            gathers = STEPS * (2 if bucket_reshard else 1)
            assert counters["gathers"] == gathers and counters["reduces"] == STEPS
            assert counters["copy_out_bytes"] == gathers * copy_out_per_gather(
                layout, bucket_reshard), name
            for i, p in enumerate(placements):
                if isinstance(p, fs.Owned):
                    assert layout.gathered_range(i) is not None, (name, i)


def test_parity_bf16_param_dtype():
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    check_parity(2, {"placement": mixed, "mp_policy": mp}, steps=STEPS,
                 param_dtype=torch.bfloat16)


def _bucket_layouts(placement, world: int, one_bucket: bool = False) -> list:
    """Gather layouts of the test transformer's buckets, planned without a process group."""
    model = make_model()
    named = dict(model.named_parameters())
    specs = [fs.BucketSpec("*", name="all")] if one_bucket else default_buckets(model)
    plan = plan_wrap(model, named, specs, placement, fs.MixedPrecisionPolicy(), True, world)
    return [plan_layout(b.slots, [s.dtype for s in b.slots], world) for b in plan.buckets]


def _padding(layouts) -> float:
    """Wire bytes beyond the pieces, each rounded up to the 16 bytes every view is
    aligned to: the padding that balancing decides (alignment: _alignment_padding)."""
    wire = sum(lay.wire_bytes for lay in layouts)
    ideal = sum(_aligned(n) for lay in layouts for reg in lay.regions for n in reg.nbytes)
    return (wire - ideal) / ideal


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _alignment_padding(layouts) -> float:
    aligned = sum(_aligned(n) for lay in layouts for reg in lay.regions for n in reg.nbytes)
    ideal = sum(lay.ideal_bytes for lay in layouts)
    return (aligned - ideal) / ideal


def test_alignment_padding_is_under_fifteen_bytes_per_piece():
    """16-byte alignment costs < 16 bytes per piece: on this tiny model (10-float
    norms) about 0.8% of the bytes, on any model of real size next to nothing."""
    for world in (2, 3, 4):
        layouts = _bucket_layouts(fs.RaggedShard(), world)
        pieces = sum(1 for lay in layouts for reg in lay.regions for n in reg.nbytes if n)
        ideal = sum(lay.ideal_bytes for lay in layouts)
        assert _alignment_padding(layouts) * ideal <= 15 * pieces


@pytest.mark.parametrize("world", [2, 3, 4])
def test_padding_under_one_percent_with_default_units(world):
    assert _padding(_bucket_layouts(fs.RaggedShard(), world)) < 0.01


@pytest.mark.parametrize("world", [2, 3])
def test_padding_under_one_percent_with_default_owners(world):
    assert _padding(_bucket_layouts(fs.Owned(), world, one_bucket=True)) < 0.01


def test_balanced_units_pad_less_than_chunks():
    for world in (3, 4):  # torch.chunk leaves trailing ranks short: Shard(0) pads more
        assert (_padding(_bucket_layouts(fs.RaggedShard(), world))
                < _padding(_bucket_layouts(fs.Shard(0), world)))


def test_owned_buckets_copy_nothing():
    for world in (2, 3, 4):
        assert all(copy_out_per_gather(lay) == 0 for lay in _bucket_layouts(fs.Owned(), world))


def test_largest_split_param_is_chained_at_two_ranks_when_aligned():
    """A chain puts rank 0's piece at the end of its segment, so it chains only
    when that piece is a multiple of 16 bytes (else the views would be misaligned)."""
    for layout in _bucket_layouts(fs.RaggedShard(), 2):
        sizes = [sum(reg.nbytes) for reg in layout.regions]
        largest = sizes.index(max(sizes))
        head_aligned = layout.regions[largest].nbytes[0] % ALIGN == 0
        assert (layout.gathered_range(largest) is not None) == head_aligned
        # The other params are most of the bucket and need copies anyway, so it
        # copies everything out: a view would keep the whole buffer alive beside them.
        assert not layout.keeps_views
        assert copy_out_per_gather(layout) == sum(sizes)


def _report() -> None:
    """Print the padding and copy-out tables of design.md."""
    configs = [("RaggedShard(), per block", fs.RaggedShard(), False),
               ("Owned(), one bucket", fs.Owned(), True),
               ("Shard(0), per block", fs.Shard(0), False),
               ("Owned(), per block", fs.Owned(), False),
               ("Owned() 2-D + RaggedShard(), per block", _owned_matrices, False),
               ("Owned() 2-D + RaggedShard(), one bucket", _owned_matrices, True)]
    for label, placement, one in configs:
        cells = []
        for world in (2, 3, 4):
            layouts = _bucket_layouts(placement, world, one_bucket=one)
            copied = sum(copy_out_per_gather(lay) for lay in layouts)
            ideal = sum(lay.ideal_bytes for lay in layouts)
            cells.append(f"{world} ranks: pad {100 * _padding(layouts):.2f}% "
                         f"(+{100 * _alignment_padding(layouts):.2f}% alignment) "
                         f"copy-out {copied}/{ideal} B")
        print(f"{label:40s} " + " | ".join(cells))


def _owned_matrices(fqn, param):
    return fs.Owned() if param.dim() == 2 else fs.RaggedShard()


if __name__ == "__main__":  # PYTHONPATH=.:tests python tests/test_mixed_bucket.py
    _report()
