"""reshard_after_forward as an int N (FSDP2's "reshard to a smaller group"): after
forward a bucket keeps its params sharded over groups of N consecutive shard
ranks, and backward's regather all-gathers within that group only. At 4 ranks
with N = 2, against a single process trained on all 4 ranks' batches, with the
collectives of each step counted per process group.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import adamw, assert_rel_close, make_model, reference_run
from training_helpers import GroupComm, NoCollectives

pytestmark = pytest.mark.world

WORLD = 4
STEPS = 3
BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    if len(shape) == 1:
        return init_device_mesh("cpu", shape, mesh_dim_names=("shard",))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


# (mesh shape, placement, bf16, how N is set): a 1-D world of 4 and a (1, 4)
# HSDP mesh; N given to flex_shard, to BucketSpecs, and by set_reshard_after_forward;
# under the user's activation checkpointing (non-reentrant checkpoint() around each
# block), whose recompute in backward gathers from the kept slices.
CASES = [
    ((4,), fs.Shard(0), False, "flex_shard"),
    ((1, 4), fs.RaggedShard(), True, "buckets"),
    ((4,), fs.Owned(), False, "setter"),
    ((4,), fs.Shard(0), False, "checkpoint"),
]


def _wrap(shape, placement, bf16, how):
    from flexshard.planning.assign import default_buckets

    from test_activation_checkpoint import ac_model

    model = ac_model("non_reentrant") if how == "checkpoint" else make_model()
    comm = GroupComm()
    kwargs = dict(placement=placement, comm=comm,
                  mp_policy=BF16 if bf16 else fs.MixedPrecisionPolicy())
    if how in ("flex_shard", "checkpoint"):
        kwargs["reshard_after_forward"] = 2
    elif how == "buckets":  # the blocks reshard to 2 ranks, the root bucket keeps its params
        kwargs["buckets"] = [fs.BucketSpec(s.patterns, name=s.name,
                                           reshard_after_forward=2 if s.name != "root" else None)
                             for s in default_buckets(model)]
    model = fs.flex_shard(model, _mesh(shape), **kwargs)
    if how == "setter":
        model.set_reshard_after_forward(2)
    return model, comm


def _train_case(shape, placement, bf16, how) -> tuple:
    from flexshard.runtime.state import get_state

    model, comm = _wrap(shape, placement, bf16, how)
    opt, rank, calls, losses = adamw(model), dist.get_rank(), [], []
    for step in range(STEPS):
        comm.calls.clear()
        x, y = batch(step, rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        calls.append(dict(comm.calls))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    buckets = get_state(model).buckets
    counters = [(b.gather.reshard_after_forward, b.counters.gathers, b.counters.post_forward_gathers)
                for b in buckets]
    return losses, fs.full_state_dict(model), calls, counters, fs.describe(model)


def parity_cases(cases) -> list:
    return [_train_case(*case) for case in cases]


def test_parity_and_collectives_per_group():
    results = run_world(WORLD, parity_cases, CASES, timeout=600)
    everyone = (0, 1, 2, 3)
    for i, (shape, placement, bf16, how) in enumerate(CASES):
        label = f"{shape} {placement} bf16={bf16} N set by {how}"
        ref_losses, ref_params, _ = reference_run(WORLD, STEPS,
                                                  param_dtype=torch.bfloat16 if bf16 else None)
        losses, full, _, counters, plan = results[0][i]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{label}: {m}")
        for k, ref in ref_params.items():
            assert_rel_close(full[k], ref, 1e-5, f"{label}: {k}")
        to_two = [r for r, _, _ in counters if r == 2]
        # The root bucket keeps its params unless the setter (which sets every bucket) ran.
        assert len(to_two) == len(counters) - (how != "setter"), label
        for rank, per_case in enumerate(results):
            calls, rank_counters = per_case[i][2], per_case[i][3]
            pair = (0, 1) if rank < 2 else (2, 3)
            want = {("all_gather", everyone): len(counters),  # forward: one per bucket
                    ("all_gather", pair): len(to_two),  # backward: within the pair only
                    ("reduce_scatter", everyone): len(counters)}
            for step, got in enumerate(calls):
                assert got == want, f"{label}: rank {rank} step {step}: {got}, expected {want}"
            for reshard, gathers, in_pair in rank_counters:
                assert in_pair == (STEPS if reshard == 2 else 0), f"{label}: rank {rank}"
                assert gathers == STEPS * (2 if reshard == 2 else 1), f"{label}: rank {rank}"
        # describe: two gathers per block, the backward one within 2 ranks.
        blocks = [b for b in plan.buckets if b.reshard_after_forward == 2]
        assert len(blocks) == len(to_two)
        assert all(b.gathers_per_step == 2 and b.regather_ranks == 2 for b in blocks), label
        assert "2 (1 in 2 ranks)" in str(plan), label


def test_dry_run_plans_the_int_reshard():
    plan = fs.describe(make_model(), mesh_shape=(2, 4), reshard_after_forward=2)
    blocks = [b for b in plan.buckets if b.module != ""]
    assert blocks and all(b.reshard_after_forward == 2 and b.regather_ranks == 2 for b in blocks)
    assert f"all-gathers ({len(blocks)} within post-forward groups)" in plan.summary()
    assert "to 2" in str(plan)
    root = next(b for b in plan.buckets if b.module == "")
    assert root.reshard_after_forward is False and root.regather_ranks == 0
    # N == S is a full reshard (True), N == 1 keeps the params (False), as FSDP2 reads them.
    full = fs.describe(make_model(), mesh_shape=(1, 4), reshard_after_forward=4)
    assert {b.reshard_after_forward for b in full.buckets} == {True, False}
    assert all(b.regather_ranks in (0, 4) for b in full.buckets)
    kept = fs.describe(make_model(), mesh_shape=(1, 4), reshard_after_forward=1)
    assert {b.reshard_after_forward for b in kept.buckets} == {False}


def _not_a_divisor():
    fs.flex_shard(make_model(), _mesh((4,)), reshard_after_forward=3, comm=NoCollectives())


def _root_only_not_a_divisor():  # the root's bucket never reshards; its int is still checked
    fs.flex_shard(torch.nn.Linear(8, 8), _mesh((4,)), reshard_after_forward=3,
                  comm=NoCollectives())


def _setter_not_a_divisor():
    model = fs.flex_shard(make_model(), _mesh((2, 2)))
    model.set_reshard_after_forward(4)


def test_bad_input():
    expect_all_ranks_raise(WORLD, _not_a_divisor, ValueError,
                           r"bucket 'layers.0': reshard_after_forward=3 does not divide its shard "
                           r"group of 4 rank\(s\); pass a divisor of 4")
    expect_all_ranks_raise(WORLD, _root_only_not_a_divisor, ValueError,
                           r"bucket 'root': reshard_after_forward=3 does not divide its shard "
                           r"group of 4 rank\(s\)")
    expect_all_ranks_raise(WORLD, _setter_not_a_divisor, ValueError,
                           r"reshard_after_forward=4 does not divide its shard group of 2 "
                           r"rank\(s\); pass a divisor of 2")
