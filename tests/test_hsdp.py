"""HSDP: a 2-D mesh (dim 0 replicates, dim 1 shards) at 4 ranks as (2, 2),
(1, 4) and (4, 1), against a single process trained on all 4 ranks' batches.

Every case runs in the one 4-rank world; each rank body runs several cases.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import (adamw, assert_rel_close, comm_counter, make_model, reduce_scatters_as_one,
                       reference_run)
from test_clip_grad import MAX_NORM, clip_step
from training_helpers import (CountingComm, NoCollectives, accumulate_two_halves,
                              check_against_reference, train)

pytestmark = pytest.mark.world

WORLD = 4
STEPS = 3
BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
MIXED_MODEL = {"bf16_pos": True}  # the position table stays bf16: a mixed-dtype root bucket
GATHER, REDUCE, ALL_REDUCE = "_allgather_base_", "_reduce_scatter_base_", "allreduce_"


def mixed(fqn, param):
    """Every bucket holds Owned, Shard(0) and RaggedShard params."""
    if fqn.endswith(("qkv.weight", "up.weight", "tok.weight")):
        return fs.Owned()
    if fqn.endswith(("down.weight", "proj.weight")):
        return fs.Shard(0)
    return fs.RaggedShard()


PLACEMENTS = {"shard0": fs.Shard(0), "owned": fs.Owned(), "ragged": fs.RaggedShard(),
              "mixed": mixed}


def hsdp_mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard"))


# Parity and collectives per step.

# (mesh shape, placement, reshard after forward, bf16 compute): every mesh shape,
# placement, reshard setting and dtype at least once, (2, 2) with each placement.
CASES = [
    ((2, 2), "shard0", True, False),
    ((2, 2), "owned", False, False),
    ((2, 2), "ragged", True, True),
    ((2, 2), "mixed", True, False),
    ((2, 2), "shard0", False, True),
    ((1, 4), "mixed", False, True),
    ((1, 4), "ragged", True, False),
    ((4, 1), "shard0", True, False),
    ((4, 1), "owned", False, True),
]


def _train_case(shape, placement: str, reshard: bool, bf16: bool) -> tuple:
    """Train one case; (mean losses, full params, collectives per step, buckets)."""
    rank = dist.get_rank()
    model_kw = MIXED_MODEL if placement == "mixed" and not bf16 else {}
    model = fs.flex_shard(make_model(**model_kw), hsdp_mesh(shape),
                          placement=PLACEMENTS[placement], reshard_after_forward=reshard,
                          mp_policy=BF16 if bf16 else fs.MixedPrecisionPolicy())
    opt = adamw(model)
    losses, comms = [], []
    for step in range(STEPS):
        x, y = batch(step, rank)
        with comm_counter() as counted:
            loss = loss_fn(model(x), y)
            loss.backward()
        comms.append(counted())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    from flexshard.runtime.state import get_state

    buckets = [b.gather.reshard_after_forward for b in get_state(model).buckets]
    return losses, fs.full_state_dict(model), comms, buckets


def parity_cases(cases) -> list:
    """Rank body: every case in turn."""
    return [_train_case(*case) for case in cases]


def expected_counts(shape, buckets) -> dict:
    """Per step: one gather per bucket within its shard group (two when it
    reshards: backward gathers again), one reduce-scatter there, one
    all-reduce across the replicas; a group of one issues nothing. (The per-forward check
    of the frozen set is one more all-reduce.)"""
    replicas, shards = shape
    want = {}
    if shards > 1:
        for reshard in buckets:
            want[GATHER] = want.get(GATHER, 0) + (2 if reshard else 1)
        want[REDUCE] = len(buckets)
    if replicas > 1:
        want[ALL_REDUCE] = len(buckets)
    # and the check that every rank trains the same params (runtime/rank_agreement.py, RankAgreement): one
    # small host all-reduce (gloo) per forward under grad
    want[ALL_REDUCE] = want.get(ALL_REDUCE, 0) + 1
    return want


def test_parity_and_collectives_per_step():
    results = run_world(WORLD, parity_cases, CASES, timeout=600)
    for i, (shape, placement, reshard, bf16) in enumerate(CASES):
        label = f"{shape} {placement} reshard={reshard} bf16={bf16}"
        model_kw = MIXED_MODEL if placement == "mixed" and not bf16 else {}
        ref_losses, ref_params, _ = reference_run(WORLD, STEPS, param_dtype=torch.bfloat16
                                                  if bf16 else None, model_kw=model_kw)
        losses, full, _, buckets = results[0][i]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{label}: {m}")
        for k, ref in ref_params.items():
            assert_rel_close(full[k], ref, 1e-5, f"{label}: {k}")
        want = expected_counts(shape, buckets)
        assert any(buckets) == reshard, label
        for rank, per_case in enumerate(results):
            r_losses, r_full, comms, _ = per_case[i]
            assert r_losses == losses, f"{label}: rank {rank} disagrees on the loss"
            for k in full:  # the replicas hold bitwise the same params
                assert torch.equal(r_full[k], full[k]), f"{label}: rank {rank}, {k}"
            for step, got in enumerate(comms):
                got = reduce_scatters_as_one(got)  # Owned: a list reduce-scatter
                assert got == want, f"{label}: rank {rank} step {step}: {got}, expected {want}"


# clip_grad_norm_, no-sync accumulation, describe.


def clipped_training(shape) -> tuple:
    """Rank body: clip every step; (losses, params, norms, comm all-reduces)."""
    comm = CountingComm()
    model = fs.flex_shard(make_model(), hsdp_mesh(shape), comm=comm)
    comm.reset()  # flex_shard's plan check all-reduces too
    norms = []
    losses = train(model, STEPS, clip_step(fs.clip_grad_norm_, 2.0, norms))
    from flexshard.runtime.state import get_state

    return (losses, fs.full_state_dict(model), norms, comm.calls["all_reduce"],
            len(get_state(model).buckets))


@pytest.mark.parametrize("shape", [(2, 2), (4, 1)])
def test_clip_grad_norm(shape):
    results = run_world(WORLD, clipped_training, shape)
    losses, full, norms, _, _ = results[0]
    ref_norms = []
    step = clip_step(lambda m, *a: torch.nn.utils.clip_grad_norm_(m.parameters(), *a), 2.0,
                     ref_norms)
    check_against_reference(losses, full, WORLD, STEPS, step_fn=step)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert all(n > MAX_NORM for n in ref_norms), "the test must actually clip"
    replicas, shards = shape
    for _, _, rank_norms, all_reduces, buckets in results:
        assert rank_norms == norms
        # Per step: each bucket's replicate all-reduce, and the norm's over the
        # shard group (none in a group of one: the local grads are whole).
        assert all_reduces == STEPS * (buckets + (shards > 1))


def no_sync_training() -> tuple:
    """Rank body at (2, 2): accumulate over two micro-batches; (losses, params,
    comm calls of the no-sync and synced micro-batch, buckets, describe)."""
    comm = CountingComm()
    model = fs.flex_shard(make_model(), hsdp_mesh((2, 2)), comm=comm)
    calls = []

    def step_fn(model, step, x, y):
        loss = torch.zeros(())
        for micro, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
            model.set_requires_gradient_sync(micro == 1)
            comm.reset()
            part = loss_fn(model(xs), ys) / 2
            part.backward()
            calls.append(dict(comm.calls))
            loss = loss + part.detach()
        return loss

    losses = train(model, STEPS, step_fn)
    plan = fs.describe(model)
    return losses, fs.full_state_dict(model), calls[-2:], plan, str(plan)


def test_no_sync_accumulation_and_describe():
    results = run_world(WORLD, no_sync_training)
    losses, full, _, plan, _ = results[0]
    check_against_reference(losses, full, WORLD, STEPS, step_fn=accumulate_two_halves)
    n = len(plan.buckets)
    assert plan.mesh_shape == (2, 2) and plan.world_size == 4 and plan.replicate_size == 2
    assert plan.all_reduces_per_step == plan.reduces_per_step == n
    for _, _, (no_sync, synced), rank_plan, text in results:
        assert no_sync["reduce_scatter"] == no_sync["all_reduce"] == 0
        assert synced["reduce_scatter"] == synced["all_reduce"] == n
        assert no_sync["all_gather"] == synced["all_gather"] == plan.gathers_per_step
        assert "world size 4 as mesh (replicate 2, shard 2)" in text
        assert f"{n} all-reduces on the replicate dim" in text
        # Placements split over the shard group: 2 ranks' bytes per bucket.
        assert all(len(b.local_bytes) == 2 for b in rank_plan.buckets)


def test_describe_one_dimensional_counts_no_all_reduce():
    plan = fs.describe(fs.flex_shard(make_model()))
    assert plan.mesh_shape == (1, 1) and plan.all_reduces_per_step == 0


def summed_grads() -> dict:
    """Rank body at (2, 2) with set_gradient_divide_factor(1.0): one backward."""
    from reference import sharded_grads

    model = fs.flex_shard(make_model(), hsdp_mesh((2, 2)), placement=mixed)
    model.set_gradient_divide_factor(1.0)
    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    return sharded_grads(model)


def test_divide_factor_one_sums_over_every_rank():
    import reference
    from reference import assemble_grads

    results = run_world(WORLD, summed_grads)
    _, _, mean_grads = reference.reference_run(WORLD, 1)
    for group in (results[:2], results[2:]):  # each replica's shard group
        grads = assemble_grads([(None, None, r) for r in group])
        for k, mean in mean_grads.items():
            torch.testing.assert_close(grads[k], WORLD * mean, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"grad of {k}: {m}")


# A 2-D mesh that is a slice of a larger world (here beside a pipeline dim).


def sub_mesh_training() -> tuple:
    """Rank body: (2, 1, 2) as (pp, replicate, shard); each pp stage's ranks wrap
    their own model over their (1, 2) slice. (full params, mesh rank, mesh size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from flexshard.runtime.state import get_state

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "replicate", "shard"))
    model = fs.flex_shard(make_model(), mesh["replicate", "shard"])
    opt = adamw(model)
    for step in range(STEPS):
        x, y = batch(step, dist.get_rank())
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    state = get_state(model)
    return fs.full_state_dict(model), state.mesh_rank, state.mesh_size


def test_mesh_slice_of_a_larger_world():
    results = run_world(WORLD, sub_mesh_training)
    # The plan check and checkpoint barriers run within the slice: a group of its ranks.
    assert [r[1:] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    _, ref_params, _ = reference_run(2, STEPS)  # stage 0 trains on the batches of ranks 0 and 1
    for k, ref in ref_params.items():
        assert_rel_close(results[0][0][k], ref, 1e-5, k)
        assert torch.equal(results[2][0][k], results[3][0][k]), k
        assert not torch.equal(results[2][0][k], results[0][0][k]), f"{k}: stage 1 has other data"


# The plan check runs over the whole mesh.


def _rank3_differs():
    model = make_model(dim=33 if dist.get_rank() == 3 else 30)
    fs.flex_shard(model, hsdp_mesh((2, 2)), comm=NoBucketCollectives())


class NoBucketCollectives(fs.GlooComm):
    """Lets the plan check run; fails on a bucket's collective."""

    def reduce_scatter(self, *args, **kwargs):
        raise AssertionError("a bucket collective was issued before the error")


def test_fingerprint_compares_replicas_too():
    # Rank 3 shares no shard group with ranks 0 and 1: they raise only if the
    # check spans the replicate dim as well.
    failures = expect_all_ranks_raise(WORLD, _rank3_differs, ValueError,
                                      r"the ranks' bucket plans differ at bucket 0 .* field "
                                      r"'shapes' differs")
    assert "Rank(s) [0, 1, 2] agree with rank 0" in failures[0].message
    assert "Rank(s) [3] agree with rank 3" in failures[3].message


# Bad input: a clear error on every rank before any collective.


def _three_dim_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    fs.flex_shard(make_model(), mesh, comm=NoCollectives())


def _owner_outside_shard_group():
    fs.flex_shard(make_model(), hsdp_mesh((2, 2)), placement=fs.Owned(rank=3),
                  comm=NoCollectives())


def _already_wrapped():
    model = fs.flex_shard(make_model(), hsdp_mesh((2, 2)))
    fs.flex_shard(model, hsdp_mesh((2, 2)), comm=NoCollectives())


def _fully_sharded():
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard(model, mesh=hsdp_mesh((2, 2)))
    fs.flex_shard(model, hsdp_mesh((2, 2)), comm=NoCollectives())


def test_bad_input():
    expect_all_ranks_raise(WORLD, _three_dim_mesh, ValueError,
                           r"mesh must be 1-D \(shard\) or 2-D \(HSDP: replicate, shard\), got a "
                           r"3-D mesh of shape \(1, 2, 2\)")
    expect_all_ranks_raise(WORLD, _owner_outside_shard_group, ValueError,
                           r"parameter '.*' in bucket .*: Owned\(rank=3\) is outside the "
                           r"world of 2 rank\(s\).*under HSDP placements split over the shard "
                           r"group, dim 1 of the \(2, 2\) mesh")
    expect_all_ranks_raise(WORLD, _already_wrapped, ValueError,
                           r"is already wrapped by flex_shard; call flex_shard once")
    expect_all_ranks_raise(WORLD, _fully_sharded, ValueError,
                           r"flex_shard's mesh \(2, 2\) \('replicate', 'shard'\) includes mesh "
                           r"dim 'shard', on which DTensor parameter '.*' is already sharded")

