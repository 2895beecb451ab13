"""Comm's rooted collectives on gloo (one broadcast / one reduce per rank, see
runtime/comm.py): the same bytes as all_gather_into_tensor and
reduce_scatter_tensor, sync and async, on the world and on a subgroup; and
training through them matches the single-process reference bitwise at 2 ranks."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from harness import run_world
from placement_ref import check_parity

pytestmark = pytest.mark.world

ROOTED = fs.Comm(rooted_min_bytes=0)  # every size goes rooted


def _inputs(rank: int, numel: int, dtype) -> torch.Tensor:
    """Small integers: every sum is exact in fp32 and bf16, whatever order the
    backend adds the ranks' values in (a tree and a ring differ in rounding)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-8, 8, (numel,), generator=g).to(dtype)


def _both_ways(group, size: int, rank: int, numel: int, dtype) -> list:
    """[(rooted, plain) result pairs] of a gather and a reduce, sync and async."""
    plain, rooted = fs.Comm(rooted_on_gloo=False), fs.Comm(rooted_min_bytes=0)
    pairs = []
    for async_op in (False, True):
        outs = []
        for comm in (rooted, plain):
            mine = _inputs(rank, numel, dtype)
            gathered = torch.full((size * numel,), float("nan"), dtype=dtype)
            work = comm.all_gather(gathered, mine, group, async_op=async_op)
            whole = _inputs(100 + rank, size * numel, dtype)
            reduced = torch.full((numel,), float("nan"), dtype=dtype)
            work2 = comm.reduce_scatter(reduced, whole, group, async_op=async_op)
            for w in (work, work2):
                if async_op:
                    w.wait()
            outs.append((gathered, reduced))
        assert comm._rooted(mine, group) is False and rooted._rooted(mine, group) is True
        pairs += [(outs[0][0], outs[1][0]), (outs[0][1], outs[1][1])]
    # The gather input may be the output's own segment (a bucket's copy-in): no copy.
    inplace = torch.zeros(size * numel, dtype=dtype)
    inplace.view(size, -1)[rank].copy_(_inputs(rank, numel, dtype))
    rooted.all_gather(inplace, inplace.view(size, -1)[rank], group)
    pairs.append((inplace, pairs[0][1]))
    return pairs


def rooted_against_plain(numel: int) -> list:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group([1, 3]) if world == 4 else None  # group ranks != global ranks
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for a, b in _both_ways(None, world, rank, numel, dtype):
            results.append(torch.equal(a, b))
        if sub is not None and rank in (1, 3):
            for a, b in _both_ways(sub, 2, (1, 3).index(rank), numel, dtype):
                results.append(torch.equal(a, b))
    if sub is not None:
        dist.destroy_process_group(sub)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_rooted_collectives_give_the_plain_ones_bytes(world):
    for rank_results in run_world(world, rooted_against_plain, 37):
        assert rank_results and all(rank_results), rank_results


@pytest.mark.parametrize("placement", [fs.Shard(0), fs.Owned(), fs.RaggedShard()],
                         ids=["shard0", "owned", "ragged"])
def test_training_through_rooted_collectives_is_bitwise_the_reference(placement):
    check_parity(2, {"placement": placement, "comm": ROOTED, "reshard_after_forward": True},
                 exact=True)


def test_rooted_bf16_at_three_ranks_matches_the_reference():
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    check_parity(3, {"placement": fs.Owned(), "comm": ROOTED, "mp_policy": mp},
                 param_dtype=torch.bfloat16)


class CountingGathers(fs.Comm):
    """Overrides all_gather (counts it): such a Comm keeps equal segments."""

    def __init__(self) -> None:
        super().__init__(rooted_min_bytes=0)
        self.gathers = 0

    def all_gather(self, output, input, group, async_op=False):
        self.gathers += 1
        return super().all_gather(output, input, group, async_op=async_op)


def owned_gather_layouts(comm) -> list:
    """Per bucket of an Owned TinyGPT after one training step: (compact?, wire
    bytes of one gather, as padded, ideal, gathered bytes counted)."""
    from flexshard.runtime.state import get_state
    from placement_ref import adamw, make_model
    from models import batch, loss_fn

    model = fs.flex_shard(make_model(), placement=fs.Owned(), comm=comm)
    opt = adamw(model)
    x, y = batch(0, torch.distributed.get_rank())
    loss_fn(model(x), y).backward()
    opt.step()
    out = []
    for b in get_state(model).buckets:
        lay = b.gather_layout
        out.append((lay.segments is not None, lay.wire_bytes,
                    lay._replace(segments=None).wire_bytes, lay.ideal_bytes,
                    b.counters.gather_wire_bytes // max(b.counters.gathers, 1)))
    return out


def test_owned_buckets_gather_without_padding_on_the_rooted_path():
    rooted = run_world(3, owned_gather_layouts, ROOTED)
    assert all(r == rooted[0] for r in rooted)
    compact = [b for b in rooted[0] if b[0]]
    assert compact, rooted[0]  # the TinyGPT's Owned blocks do not split evenly over 3 ranks
    for _, wire, padded, ideal, counted in compact:
        assert ideal <= wire < padded and counted == wire
        assert wire - ideal < 16 * 3 * 8  # alignment only: under 16 bytes per piece
    counting = run_world(3, owned_gather_layouts, CountingGathers())
    assert not any(b[0] for b in counting[0])  # an overridden all_gather: equal segments
    assert [b[2] for b in counting[0]] == [b[2] for b in rooted[0]]


def rooted_where(max_ranks: int) -> tuple:
    """(rooted at 1 MiB, rooted below it) for a 1 MiB segment on the world,
    with ROOTED_MAX_RANKS set to `max_ranks` for a fresh Comm."""
    from flexshard.runtime import gloo as comm_module

    saved, comm_module.ROOTED_MAX_RANKS = comm_module.ROOTED_MAX_RANKS, max_ranks
    try:
        mib = torch.empty(comm_module.ROOTED_MIN_BYTES, dtype=torch.uint8)
        comm = fs.Comm()
        return comm._rooted(mib, None), comm._rooted(mib[:-1], None)
    finally:
        comm_module.ROOTED_MAX_RANKS = saved


def test_rooted_only_for_large_segments_in_small_worlds():
    assert run_world(2, rooted_where, 8) == [(True, False)] * 2
    assert run_world(2, rooted_where, 1) == [(False, False)] * 2  # a world above the bound


def test_bad_rooted_min_bytes_is_named():
    with pytest.raises(ValueError, match=r"rooted_min_bytes must be an int >= 0.*-1"):
        fs.Comm(rooted_min_bytes=-1)
