"""A bucket's work per step does not grow with the world size.

The data path (gather, unsharded params, gradient packing, reduce-scatter,
sharded grads) is run for rank 0 of simulated worlds in one process, through
a Comm that copies only its own segment (benchmarks/hot_path.py), and the ops
it dispatches are counted: the same count at 8, 64 and 512 ranks, for every
kind of copy plan (views, strided runs, index). Timings: benchmarks/RESULTS.md.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flexshard as fs
from benchmarks.hot_path import LocalComm, block_shapes, make_bucket, step
from flexshard.planning.copyplan import CopyPlan
from flexshard.planning.layout import SlotPlan, bind_placements, plan_layout


DATA_OPS = {"copy_", "index", "index_copy_", "index_select", "mul_", "div_", "add_", "_to_copy"}


class OpCount(TorchDispatchMode):
    """Every dispatched op, and those that move data (not views, not allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.data_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A profiler label (record_function) is two ops per label and bucket, not
        # per param: not part of the data path this test bounds.
        self.ops += func.namespace != "profiler"
        self.data_ops += func.overloadpacket.__name__ in DATA_OPS
        return func(*args, **(kwargs or {}))


def _ops_per_step(world: int, placement, mp=None) -> tuple:
    """(ops, data ops of one step after a warm-up, plan kinds of the gather layout)."""
    # dims divide every world here, into pieces of whole 16-byte units in bf16 (the layout's
    # alignment), so every world takes the same fused plans (planning/fused.py)
    shapes = [(1024, 512), (512, 1024), (4096,), (8192,)]
    bucket = make_bucket(world, placement, shapes, mp=mp)
    grads = [torch.ones(s.shape) for s in bucket.slots]
    step(bucket, grads)
    with OpCount() as mode:
        step(bucket, grads)
    kinds = [w.copies[0].kind for w in bucket.gather.plans_for(bucket.gather.layout).wires]
    return mode.ops, mode.data_ops, kinds


@pytest.mark.parametrize("placement", [fs.Shard(0), fs.RaggedShard(), fs.Shard(1), fs.Owned()])
@pytest.mark.parametrize("cast", [False, True])
def test_ops_per_step_do_not_grow_with_world_size(placement, cast):
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if cast else None
    counts = {w: _ops_per_step(w, placement, mp) for w in (8, 64, 512)}
    assert counts[8] == counts[64] == counts[512], counts
    ops, data_ops, kinds = counts[512]
    # per param: a copy-in, a copy-out, a pack (two through an index: cast, then
    # index_copy_) and a cast at most (one run each here); per bucket: the two
    # collectives' stand-ins and the pre-divide
    assert data_ops <= 5 * len(kinds) + 3, counts
    assert ops <= 30 * len(kinds), counts  # views and allocations included


def test_each_plan_kind_is_exercised():
    """The test above covers views (Owned; Shard(0)'s matrices, each gathered alone),
    strided runs (Shard(0)'s vectors, packed) and index plans (Shard(1))."""
    assert set(_ops_per_step(64, fs.Owned())[2]) == {"view"}
    assert _ops_per_step(64, fs.Shard(0))[2] == ["view", "view", "runs", "runs"]
    assert "index" in _ops_per_step(64, fs.Shard(1))[2]


def test_uneven_chunks_take_few_runs():
    """torch.chunk's short tail: full pieces, one short piece, empty ranks."""
    bucket = make_bucket(64, fs.Shard(0), [(100, 3), (70,)])
    runs = [w.copies[0].runs for w in bucket.gather.plans_for(bucket.gather.layout).wires]
    assert all(r is not None and len(r) <= 3 for r in runs), runs


def _slots(shapes_and_placements, world, dtype=torch.float32):
    entries = [(torch.Size(s), dtype.itemsize, p) for s, p in shapes_and_placements]
    bound = bind_placements(entries, world)
    return [SlotPlan(f"p{i}", e[0], dtype, b, tuple(b.local_shape(e[0], r, world)
                                                      for r in range(world)))
            for i, (e, b) in enumerate(zip(entries, bound))]


@pytest.mark.parametrize("world", [1, 3, 5, 16])
def test_pack_then_full_is_the_identity_for_every_plan(world):
    """Packing a full tensor writes every rank's piece where the layout puts it
    (checked against placement.shard), and reading it back gives the tensor."""
    spec = [((7, 5), fs.Shard(0)), ((6, 9), fs.Shard(1)), ((11, 2), fs.RaggedShard()),
            ((3, 4), fs.Owned()), ((5,), fs.RaggedShard(units=(1,) + (0,) * (world - 1))),
            ((2, 3, 4), fs.RaggedShard(dims=(0, 1)))]
    slots = _slots(spec, world)
    layout = plan_layout(slots, [s.dtype for s in slots], world)
    buffer = torch.zeros(layout.wire_bytes, dtype=torch.uint8)
    fulls = [torch.randn(s.shape) for s in slots]
    for i, (slot, full) in enumerate(zip(slots, fulls)):
        plan = CopyPlan(layout, slot, i)
        plan.pack(buffer, full)
        for r in range(world):
            start, n = layout.piece_start(i, r), layout.regions[i].nbytes[r]
            piece = buffer[start:start + n].view(torch.float32).view(slot.local_shapes[r])
            assert torch.equal(piece, slot.placement.shard(full, r, world))
        assert torch.equal(plan.full(buffer), full)
        assert torch.equal(plan.full(buffer, copy=True), full)


def test_local_comm_bucket_reduces_like_the_mean_of_equal_grads():
    """Sanity of the benchmark's fake: every rank 'sent' what rank 0 sent, so
    the pre-divided sum of one rank's grad is that grad divided by the world."""
    bucket = make_bucket(8, fs.Shard(0), [(16, 2)])
    grad = torch.arange(32.0).view(16, 2)
    (sharded,) = bucket.grads.finish(bucket.grads.start([grad]))
    assert torch.equal(sharded, grad[:2] / 8)
    assert math.prod(bucket.slots[0].local_shapes[0]) == 4
    assert isinstance(bucket.comm, LocalComm) and len(block_shapes()) == 7


def test_an_index_plan_moves_blocks_not_elements():
    """Shard(1) of a (6, 8) matrix over 2 ranks: each full row is two runs of
    4 contiguous elements, so the index holds one entry per 4 elements."""
    slots = _slots([((6, 8), fs.Shard(1))], 2)
    layout = plan_layout(slots, [torch.float32], 2)
    plan = CopyPlan(layout, slots[0], 0)
    assert plan.kind == "index"
    block, positions = plan.index(torch.device("cpu"))
    assert block == 4 and positions.numel() == 48 // 4
