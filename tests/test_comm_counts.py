"""Collectives per step, counted with CommDebugMode."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import make_model

GATHER = torch.ops.c10d._allgather_base_
REDUCE = torch.ops.c10d._reduce_scatter_base_


def _counts(mode: CommDebugMode) -> tuple:
    counts = mode.get_comm_counts()
    total = sum(counts.values())
    gathers, reduces = counts.get(GATHER, 0), counts.get(REDUCE, 0)
    return gathers, reduces, total - gathers - reduces


def count_step(config: dict, microbatches: int = 1) -> list:
    """Rank body: collectives of each forward+backward after a warm-up step."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = fs.flex_shard(make_model(), **config)
    from flexshard.runtime.state import get_state

    out = []
    for step in range(2):
        for micro in range(microbatches):
            model.set_requires_gradient_sync(micro == microbatches - 1)
            x, y = batch(step, rank)
            with CommDebugMode() as mode:
                loss_fn(model(x), y).backward()
            out.append(_counts(mode))
    return [out[-microbatches:], len(get_state(model).buckets)]


@pytest.mark.parametrize("world", [2, 3])
def test_reshard_after_forward(world):
    for counts, buckets in run_world(world, count_step, {}):
        gathers, reduces, other = counts[0]
        # Every bucket gathers in forward; each resharding one (all but the root's) once more.
        assert buckets == 3  # two blocks and the root: so the count below is not the no-reshard one
        assert gathers == 2 * buckets - 1
        assert reduces == buckets
        assert other == 1  # the ranks agree on what trains (RankAgreement): one all-reduce


def test_no_reshard():
    for counts, buckets in run_world(2, count_step, {"reshard_after_forward": False}):
        assert counts[0] == (buckets, buckets, 1)  # 1: RankAgreement's all-reduce


def test_root_bucket_reshards_when_its_spec_asks():
    buckets = [fs.BucketSpec("layers.*", name="blocks", reshard_after_forward=True),
               fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], name="root",
                             reshard_after_forward=True)]
    for counts, n in run_world(2, count_step, {"buckets": buckets}):
        # 'blocks' runs on the root too (its params span the ModuleList): both reshard.
        assert counts[0] == (2 * n, n, 1)


def count_frozen_step() -> tuple:
    """Rank body: collectives of a step after one that trained everything, with a
    param of a resharding block frozen in between."""
    import torch.distributed as dist

    from flexshard.runtime.state import get_state

    rank = dist.get_rank()
    model = fs.flex_shard(make_model())
    out = []
    for step in range(2):
        model.layers[0].up.weight.requires_grad_(step == 0)
        x, y = batch(step, rank)
        with CommDebugMode() as mode:
            loss_fn(model(x), y).backward()
        out.append(_counts(mode))
    return out, len(get_state(model).buckets)


def test_freezing_after_wrapping_adds_no_collective():
    """A param made once keeps the grad_fn of the last forward that trained it: frozen
    later, that old node ran its backward again, one more reduce-scatter a step."""
    for counts, buckets in run_world(2, count_frozen_step):
        assert counts[0] == counts[1] == (2 * buckets - 1, buckets, 1), counts


def test_no_sync_microbatch_skips_reduction():
    for counts, buckets in run_world(2, count_step, {}, 3):
        (g0, r0, _), (g1, r1, _), (g2, r2, _) = counts
        assert r0 == r1 == 0, "no gradient collective on a no-sync micro-batch"
        assert r2 == buckets
        assert g0 == g1 == g2 == 2 * buckets - 1


def test_world_size_one_has_no_collectives():
    for config in ({}, {"reshard_after_forward": False},
                   {"mp_policy": fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)}):
        for counts, _ in run_world(1, count_step, config):
            assert counts[0] == (0, 0, 0)
