"""GlooComm's rooted collectives on gloo (one broadcast / one reduce per rank, see
runtime/gloo.py): the same bytes as all_gather_into_tensor and
reduce_scatter_tensor, sync and async, on the world and on a subgroup; and
training through them matches the single-process reference bitwise at 2 ranks."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from harness import run_world
from reference import check_parity

pytestmark = pytest.mark.world

ROOTED = fs.GlooComm(rooted_min_bytes=0)  # every size goes rooted


def _inputs(rank: int, numel: int, dtype) -> torch.Tensor:
    """Small integers: every sum is exact in fp32 and bf16, whatever order the
    backend adds the ranks' values in (a tree and a ring differ in rounding)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-8, 8, (numel,), generator=g).to(dtype)


def _both_ways(group, size: int, rank: int, numel: int, dtype) -> list:
    """[(rooted, plain) result pairs] of a gather and a reduce, sync and async."""
    plain, rooted = fs.GlooComm(rooted_min_bytes=1 << 40), fs.GlooComm(rooted_min_bytes=0)
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
    # A bucket's gather and reduce groups (two pairs each): rooted, one broadcast (one
    # reduce) per rank of the groups joined rank-major, then a split-copy (the rank's
    # segment copied out), where gloo's coalesced collectives run one per group.
    for async_op in (False, True):
        groups = []
        for comm in (rooted, plain):
            segment = torch.cat([_inputs(rank, numel, dtype),
                                 _inputs(50 + rank, 2 * numel, dtype)])
            ins = list(segment.split([numel, 2 * numel]))  # back to back, as a bucket's
            gathered = torch.full((size * 3 * numel,), float("nan"), dtype=dtype)
            outs = list(gathered.split([size * numel, 2 * size * numel]))
            work = comm.all_gather_groups(outs, ins, group, async_op=async_op)
            whole = _inputs(200 + rank, size * 3 * numel, dtype)
            reduced = torch.full((3 * numel,), float("nan"), dtype=dtype)
            work2 = comm.reduce_scatter_groups(list(reduced.split([numel, 2 * numel])),
                                               list(whole.split([size * numel, 2 * size * numel])),
                                               group, async_op=async_op)
            for w in (work, work2):
                if async_op:
                    w.wait()
            groups.append((gathered, reduced))
        pairs += list(zip(*groups))
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


def rooted_rows_against_plain() -> list:
    """An activation's pieces are N-D: rows of a (world x rows, cols) output. The
    rooted path sliced them by elements: (1, n) pieces all came back as rank 0's row,
    (rows, cols) ones raised a size mismatch. Also shard_tensor's backward (a gather)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for rows, cols in [(1, 1 << 18), (4096, 64), (3, 5)]:
        for op in ("gather", "reduce"):
            outs = []
            for comm in (fs.GlooComm(rooted_min_bytes=0), fs.GlooComm(rooted_min_bytes=1 << 40)):
                if op == "gather":
                    out = torch.full((world * rows, cols), float("nan"))
                    comm.all_gather(out, _inputs(rank, rows * cols, torch.float32).view(rows, cols),
                                    None)
                else:
                    out = torch.full((rows, cols), float("nan"))
                    whole = _inputs(100 + rank, world * rows * cols, torch.float32)
                    comm.reduce_scatter(out, whole.view(world * rows, cols), None)
                outs.append(out)
            results.append(torch.equal(*outs))
    full = torch.zeros(world, 1 << 18, requires_grad=True)
    piece = fs.collectives.shard_tensor(full, [1] * world, comm=fs.GlooComm())
    (piece * (rank + 1)).sum().backward()
    results.append(full.grad.mean(dim=1).tolist() == [float(r + 1) for r in range(world)])
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_rooted_collectives_of_rows_give_the_plain_ones_bytes(world):
    for rank_results in run_world(world, rooted_rows_against_plain):
        assert rank_results and all(rank_results), rank_results


@pytest.mark.parametrize("placement", [fs.Shard(0), fs.Owned(), fs.RaggedShard()],
                         ids=["shard0", "owned", "ragged"])
def test_training_through_rooted_collectives_is_bitwise_the_reference(placement):
    check_parity(2, {"placement": placement, "comm": ROOTED, "reshard_after_forward": True},
                 exact=True)


def test_rooted_gather_groups_train_as_one_process():
    """Blocks whose matrices have gather groups of their own (test_gather_groups.py),
    gathered group by group through the rooted broadcasts, at an uneven world: SGD."""
    from test_gather_groups import BIG, sgd

    check_parity(3, {"placement": fs.Shard(0), "comm": ROOTED}, make_opt=sgd, model_kw=BIG)
    # an int reshard: backward regathers the kept slices within groups of 2 ranks
    check_parity(4, {"comm": ROOTED, "reshard_after_forward": 2}, make_opt=sgd, model_kw=BIG)


def test_rooted_bf16_at_three_ranks_matches_the_reference():
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    check_parity(3, {"placement": fs.Owned(), "comm": ROOTED, "mp_policy": mp},
                 param_dtype=torch.bfloat16)


def default_comm_kind() -> str:
    """The Comm flex_shard picks when given none."""
    from flexshard.runtime.state import get_state
    from reference import make_model

    return type(get_state(fs.flex_shard(make_model())).comm).__name__


def test_flex_shard_picks_the_gloo_comm_on_gloo_and_comm_on_one_process():
    assert run_world(2, default_comm_kind) == ["GlooComm"] * 2
    assert default_comm_kind() == "Comm"  # no process group


def rooted_where(max_ranks: int) -> tuple:
    """(rooted at 1 MiB, rooted below it) for a 1 MiB segment on the world,
    with ROOTED_MAX_RANKS set to `max_ranks` for a fresh Comm."""
    from flexshard.runtime import gloo as comm_module

    saved, comm_module.ROOTED_MAX_RANKS = comm_module.ROOTED_MAX_RANKS, max_ranks
    try:
        mib = torch.empty(comm_module.ROOTED_MIN_BYTES, dtype=torch.uint8)
        comm = fs.GlooComm()
        return comm._rooted(mib, None), comm._rooted(mib[:-1], None)
    finally:
        comm_module.ROOTED_MAX_RANKS = saved


def test_rooted_only_for_large_segments_in_small_worlds():
    assert run_world(2, rooted_where, 8) == [(True, False)] * 2
    assert run_world(2, rooted_where, 1) == [(False, False)] * 2  # a world above the bound


def test_bad_rooted_min_bytes_is_named():
    with pytest.raises(ValueError, match=r"rooted_min_bytes must be an int >= 0.*-1"):
        fs.GlooComm(rooted_min_bytes=-1)
