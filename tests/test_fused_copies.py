"""A bucket's copies are one fused op per bucket and direction where the layout
allows (planning/fused.py), counted on the user's path: flex_shard, a forward and
a backward at 4 ranks, bf16 params and fp32 reduce, every copy-family op
dispatched inside each copy label (FlexShard::all_gather_copy_in, ...) counted
per occurrence. Counts, not timings: on a GPU each op is a kernel launch."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import flexshard as fs
from harness import run_world

pytestmark = pytest.mark.world

WORLD = 4
COPIES = {"copy_", "_to_copy", "clone", "_foreach_copy_", "split_with_sizes_copy", "_chunk_cat",
          "cat", "index", "index_copy_", "index_select", "index_put_", "stack"}
LABELS = {"FlexShard::all_gather_copy_in": "in", "FlexShard::all_gather_copy_out": "out",
          "FlexShard::reduce_scatter_copy_in": "pack"}


class CopyCount(TorchDispatchMode):
    """Copy-family ops dispatched inside each copy label, one list entry per
    occurrence of the label."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: list = []
        self.counts = collections.defaultdict(list)  # direction -> [ops per occurrence]
        self.names = collections.defaultdict(collections.Counter)  # direction -> op names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "profiler":
            if name == "_record_function_enter_new":
                self.labels.append(LABELS.get(args[0]))
                if self.labels[-1] is not None:
                    self.counts[self.labels[-1]].append(0)
            elif name == "_record_function_exit" and self.labels:
                self.labels.pop()
        elif name in COPIES and self.labels and self.labels[-1] is not None:
            self.counts[self.labels[-1]][-1] += 1
            self.names[self.labels[-1]][name] += 1
        return func(*args, **(kwargs or {}))


PLACEMENTS = {
    "shard0": lambda fqn, p: fs.Shard(0),
    "ragged": lambda fqn, p: fs.RaggedShard(),
    "owned": lambda fqn, p: fs.Owned(),
    "shard1": lambda fqn, p: fs.Shard(1) if p.dim() == 2 else fs.Shard(0),
    "mixed_even": lambda fqn, p: fs.RaggedShard() if p.dim() == 1 else fs.Shard(0),
    "mixed_owned": lambda fqn, p: fs.Owned() if p.dim() == 1 else fs.Shard(0),
    "shard0_uneven": lambda fqn, p: fs.Shard(0),  # 66 rows over 4 ranks: 17, 17, 17, 15
}


def _counted_steps() -> dict:
    """{(kind, cast): counts} of every case, on every rank (one world call)."""
    return {(kind, cast): _counted_step(kind, cast)
            for kind in PLACEMENTS for cast in (True, False) if cast or kind == "shard0"}


def _counted_step(kind: str, cast: bool) -> dict:
    """The copy counts of one forward + backward (after a warm-up one)."""
    torch.manual_seed(0)
    hidden = 66 if kind == "shard0_uneven" else 64
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 64))
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cast else fs.MixedPrecisionPolicy()
    fs.flex_shard(model, buckets=[fs.BucketSpec("0.*"), fs.BucketSpec("2.*")],
                  placement=PLACEMENTS[kind], mp_policy=mp)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).float().sum().backward()
    with CopyCount() as mode:
        model(x).float().sum().backward()
    return {"counts": dict(mode.counts), "names": {k: dict(v) for k, v in mode.names.items()}}


# (copy-in, copy-out, reduce-scatter copy-in) ops per bucket and occurrence
FUSED = {
    "shard0": (1, 1, 1),  # _foreach_copy_, split_with_sizes_copy, _chunk_cat
    "ragged": (1, 1, 1),  # balanced units over rows the world divides: as Shard(0)
    "owned": (1, 0, 1),  # the params are views of the gathered buffer; one foreach pack
    "mixed_even": (1, 1, 1),  # Shard(0) and even RaggedShard columns side by side
    # rows the world does not divide: each rank's piece padded to the largest (as FSDP2
    # pads), so they are columns too (planning/layout.py)
    "shard0_uneven": (1, 1, 1),
    # the Owned bias is copied out too (the Shard(0) weight's copy makes views not
    # worth their pinned buffer: BucketLayout.keeps_views), and its grad packed by a
    # foreach beside the weight's one strided copy
    "mixed_owned": (1, 2, 2),
    # Shard(1)'s pieces are columns of the full weight: one index op per weight out,
    # a cast and an index_copy_ per weight in; the bias (Shard(0)) is one split
    "shard1": (1, 2, 3),
}


@pytest.fixture(scope="module")
def counted() -> list:
    return run_world(WORLD, _counted_steps, timeout=300.0)


@pytest.mark.parametrize("kind", sorted(FUSED))
def test_one_fused_copy_per_bucket_and_direction(counted, kind):
    """At most the planned ops per occurrence on every rank (a rank that holds none
    of a bucket's pieces, Owned, copies none in), and exactly that many on some."""
    want = dict(zip(("in", "out", "pack"), FUSED[kind]))
    seen = collections.defaultdict(set)
    for by_case in counted:
        counts = by_case[(kind, True)]["counts"]
        # each gather (forward, backward's regather) and each reduction: 2 buckets
        assert len(counts["in"]) >= 2 and len(counts["out"]) == len(counts["in"]), counts
        assert len(counts["pack"]) == 2, counts
        for direction, n in want.items():
            assert max(counts[direction]) <= n, (direction, by_case[(kind, True)])
            seen[direction] |= set(counts[direction])
    assert all(n in seen[direction] for direction, n in want.items()), seen


def test_shard0_copies_are_the_fused_ops(counted):
    result = counted[0][("shard0", True)]
    gathers = len(result["counts"]["in"])
    assert result["names"] == {"in": {"_foreach_copy_": gathers},
                               "out": {"split_with_sizes_copy": gathers},
                               "pack": {"_chunk_cat": 2}}


def _shard0_step() -> dict:
    return _counted_step("shard0", True)


def test_at_two_ranks_the_copies_are_the_fused_ops_too():
    """At 2 ranks each param could be chained across the one rank boundary (a view),
    which would shift the others off their columns: the layout keeps the columns
    (planning/layout.py), so a user's 2-GPU job copies as a larger one does."""
    for result in run_world(2, _shard0_step):
        gathers = len(result["counts"]["in"])
        assert result["names"] == {"in": {"_foreach_copy_": gathers},
                                   "out": {"split_with_sizes_copy": gathers},
                                   "pack": {"_chunk_cat": 2}}


def test_without_a_cast_the_storage_is_the_gather_input(counted):
    """fp32 params gathered as fp32: no copy-in at all (no label, no op)."""
    for by_case in counted:
        counts = by_case[("shard0", False)]["counts"]
        assert "in" not in counts, counts
        assert set(counts["out"]) == {1} and counts["pack"] == [1] * 2


# The fused plans against the per-param copy plans they replace, layout by layout
# (planning/fused.py; one process): where a fused plan applies it writes the same
# bytes, and where a layout does not fit it the plan says so.

SPECS = {
    # pieces of whole 16-byte units at 4 and 8 ranks (the layout's alignment)
    "even shard0": [((8, 4), fs.Shard(0)), ((32,), fs.Shard(0)), ((8, 2, 4), fs.Shard(0))],
    "uneven shard0": [((7, 3), fs.Shard(0)), ((16,), fs.Shard(0))],
    "ragged": [((8, 4), fs.RaggedShard()), ((11, 2), fs.RaggedShard())],
    "owned": [((3, 4), fs.Owned()), ((5,), fs.Owned()), ((2, 8), fs.Owned())],
    "shard1": [((6, 8), fs.Shard(1)), ((8,), fs.Shard(0))],
    "mixed": [((8, 4), fs.Shard(0)), ((3, 4), fs.Owned()), ((6, 8), fs.Shard(1)),
              ((9, 2), fs.RaggedShard())],
}


def _layout(name: str, world: int, dtype=torch.float32):
    from flexshard.planning.layout import plan_layout
    from test_hot_path import _slots

    slots = _slots(SPECS[name], world, dtype)
    return slots, plan_layout(slots, [s.dtype for s in slots], world)


def _packed(layout, slots, fulls) -> torch.Tensor:
    from flexshard.planning.copyplan import CopyPlan

    ref = torch.zeros(layout.wire_bytes, dtype=torch.uint8)
    for i, (slot, full) in enumerate(zip(slots, fulls)):
        CopyPlan(layout, slot, i).pack(ref, full)
    return ref


@pytest.mark.parametrize("world", [1, 3, 4, 8])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_fused_plans_write_what_the_per_param_plans_write(name, world):
    from flexshard.planning.fused import plan_chunk_cat, plan_copy_out, span_split
    from flexshard.runtime.unsharded import column_full, copy_out_columns, split_views

    slots, layout = _layout(name, world)
    fulls = [torch.randn(s.shape, generator=torch.Generator().manual_seed(i)).bfloat16()
             for i, s in enumerate(slots)]
    ref = _packed(layout, slots, fulls)  # the reduce input, cast to fp32 on the way
    chunk = plan_chunk_cat(layout, slots)
    if chunk is not None:
        got = torch.full((layout.wire_bytes,), 7, dtype=torch.uint8)  # garbage, as torch.empty
        rows = got.view(torch.float32).view(world, chunk.seg_elems)
        rows[:, chunk.width:].zero_()
        torch._chunk_cat(fulls, 0, world, out=rows[:, :chunk.width])
        assert torch.equal(got, ref)
    spans = span_split(layout, range(len(slots)))
    if spans is not None:
        got = torch.zeros(layout.wire_bytes, dtype=torch.uint8)
        torch._foreach_copy_(split_views(got, spans), [f.reshape(-1) for f in fulls])
        assert torch.equal(got, ref)
    columns = copy_out_columns(ref, plan_copy_out(layout, range(len(slots))), world)
    for j, full in columns.items():  # an uneven param's column ends in its padding
        assert torch.equal(column_full(full, slots[j].shape), fulls[j].float())
    # which layouts fit which fused plan (world 1: every piece is the full tensor)
    fits = {("even shard0", 4), ("even shard0", 8), ("ragged", 4)}
    if (name, world) in fits or name in {"uneven shard0", "owned", "shard1", "mixed"} and world > 1:
        assert (chunk is not None) == ((name, world) in fits), (name, world)
    if world > 1:
        assert (spans is not None) == (name == "owned"), name
    if world > 1:  # a param split as torch.chunk splits it is a column of [world, segment],
        # evenly or not; RaggedShard's uneven units (world 3) are not
        uncolumned = {"owned"} | ({"ragged"} if world == 3 else set())
        assert bool(columns) == (name not in uncolumned), (name, world)


def test_a_bucket_with_an_empty_param_packs_its_reduce_input_per_param():
    # torch._chunk_cat refuses an empty tensor in its list: such a bucket's reduce
    # input is packed by the per-param plans (hypothesis found it in test_properties)
    from flexshard.planning.fused import plan_chunk_cat
    from flexshard.planning.layout import plan_layout
    from test_hot_path import _slots

    for world in (1, 4):
        slots = _slots([((8, 4), fs.Shard(0)), ((0, 4), fs.Shard(0))], world, torch.float32)
        layout = plan_layout(slots, [s.dtype for s in slots], world)
        assert plan_chunk_cat(layout, slots) is None
        assert plan_chunk_cat(layout, slots[:1]) is not None  # without it, one chunk-cat
