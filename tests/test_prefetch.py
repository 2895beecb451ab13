"""Prefetch in recorded execution order, overlap, and asynchronous reduction."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from flexshard.runtime.comm import HostContext
from flexshard.runtime.state import get_state
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import make_model
from training_helpers import CountingComm, DelayComm, MatmulLog, check_against_reference, train

STEPS = 4
BLOCKS = [fs.BucketSpec("layers.0.*", name="layers.0"), fs.BucketSpec("layers.1.*", name="layers.1"),
          fs.BucketSpec("layers.2.*", name="layers.2"),
          fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], name="root")]


def _counters(model) -> dict:
    return {b.name: (b.counters.prefetches, b.counters.discarded_prefetches)
            for b in get_state(model).buckets}


def train_with_depth(depth: int) -> tuple:
    """Rank body: train with a prefetch depth; (losses, full params, counters)."""
    model = fs.flex_shard(make_model(layers=3), buckets=BLOCKS)
    model.set_prefetch_depth(depth)
    losses = train(model, STEPS)
    return losses, fs.full_state_dict(model), _counters(model)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_prefetch_parity(depth):
    results = run_world(2, train_with_depth, depth)
    losses, full, counters = results[0]
    check_against_reference(losses, full, 2, STEPS, model_kw={"layers": 3})
    launched = sum(p for p, _ in counters.values())
    assert all(d == 0 for _, d in counters.values()), f"unused prefetches: {counters}"
    if depth == 0:
        assert launched == 0
    else:
        # From step 2 on, every bucket but the first of each pass is prefetched:
        # forward 4 buckets (3 prefetched), backward 3 resharding ones (2).
        assert launched == (STEPS - 1) * (3 + 2)


def collectives_per_step(specs_reversed: bool) -> tuple:
    """Rank body: collectives of the 3rd step (after recording) and prefetch counters."""
    comm = CountingComm()
    specs = list(reversed(BLOCKS)) if specs_reversed else BLOCKS
    model = fs.flex_shard(make_model(layers=3), buckets=specs, comm=comm)
    train(model, 2)
    comm.reset()
    before = _counters(model)
    train(model, 1)
    after = _counters(model)
    delta = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
    return comm.calls, delta


def test_reversed_bucket_specs_give_the_same_collectives():
    forward = run_world(2, collectives_per_step, False)
    backward = run_world(2, collectives_per_step, True)
    for (calls_f, pre_f), (calls_r, pre_r) in zip(forward, backward):
        assert calls_f == calls_r
        assert pre_f == pre_r
        # 4 buckets gather in forward, the 3 resharding ones again in backward;
        # 4 reduce-scatters; 1 all-reduce is the loss average of train().
        assert calls_f == {"all_gather": 4 + 3, "reduce_scatter": 4, "all_reduce": 0}
        # Forward order root, 0, 1, 2 prefetches 0, 1, 2; backward order 2, 1, 0
        # prefetches 1, 0; none is dropped unused.
        assert pre_f == {"root": (0, 0), "layers.0": (2, 0), "layers.1": (2, 0),
                         "layers.2": (1, 0)}


class OverlappingHost(HostContext):
    """A host context that leaves a reduction in flight, as CudaContext does."""

    reduces_in_flight = 1


def overlap_log(depth: int, reduces_in_flight: int = 1) -> dict:
    """Rank body: for each matmul of step 2, how many gathers and reductions
    were launched and not yet waited for, with a 30 ms injected delay."""
    comm = DelayComm(delay=0.03)
    model = fs.flex_shard(make_model(layers=3), buckets=BLOCKS, comm=comm)
    model.set_prefetch_depth(depth)
    if reduces_in_flight:
        cpu = torch.device("cpu")
        get_state(model).buckets[0].devices.set(cpu, OverlappingHost(cpu))
    train(model, 1)
    rank = torch.distributed.get_rank()
    x, y = batch(1, rank)
    probe = lambda: (comm.flying("all_gather"), comm.flying("reduce_scatter"))  # noqa: E731
    with MatmulLog(probe) as fwd:
        loss = loss_fn(model(x), y)
    with MatmulLog(probe) as bwd:
        loss.backward()
    return {"forward": fwd.seen, "backward": bwd.seen, "left": len(comm.in_flight)}


def test_compute_overlaps_delayed_gathers():
    for log in run_world(2, overlap_log, 1):
        fwd_gathers = [g for g, _ in log["forward"]]
        bwd_gathers = [g for g, _ in log["backward"]]
        bwd_reduces = [r for _, r in log["backward"]]
        # Blocks 0 and 1 compute while the next block's gather is in flight.
        assert sum(g > 0 for g in fwd_gathers) >= 2 * 4  # 4 matmuls per block
        assert sum(g > 0 for g in bwd_gathers) > 0
        assert sum(r > 0 for r in bwd_reduces) > 0, "reduce-scatter overlaps backward"
        assert max(fwd_gathers + bwd_gathers) <= 1, "depth 1 bounds gathers in flight"
        assert log["left"] == 0, "backward ends with nothing in flight"


def test_host_finishes_each_reduction_at_launch():
    # HostContext.reduces_in_flight = 0: no reduction flies while backward computes
    # (its buffers would sit beside the next block's grads); gathers still overlap.
    for log in run_world(2, overlap_log, 1, 0):
        assert all(r == 0 for _, r in log["backward"])
        assert sum(g > 0 for g, _ in log["backward"]) > 0
        assert log["left"] == 0


def test_without_prefetch_nothing_overlaps_gathers():
    for log in run_world(2, overlap_log, 0):
        assert all(g == 0 for g, _ in log["forward"] + log["backward"])


def bad_depth(depth):
    model = fs.flex_shard(make_model())
    model.set_prefetch_depth(depth)


def test_bad_prefetch_depth():
    expect_all_ranks_raise(2, bad_depth, ValueError, r"depth >= 0, got -1", -1)
    expect_all_ranks_raise(2, bad_depth, TypeError, r"expects an int, got 1.5", 1.5)
