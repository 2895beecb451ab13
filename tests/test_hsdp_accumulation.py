"""HSDP gradient accumulation with the replicas' all-reduce deferred to the last
micro-batch (`set_requires_all_reduce(False)`, FSDP2's): the same grads and
params as one process on every rank's micro-batches, one all-reduce per bucket
per step instead of one per micro-batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import make_model
from test_hsdp import PLACEMENTS, hsdp_mesh
from training_helpers import full_grads

pytestmark = pytest.mark.world

WORLD, MICRO, STEPS, LR = 4, 4, 2, 0.5


def reference() -> tuple:
    """One process, SGD: per step the sum over micro-batches of the mean over ranks."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = None
    for step in range(STEPS):
        for m in range(MICRO):
            xs, ys = zip(*(batch(step * MICRO + m, r) for r in range(WORLD)))
            loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return grads, {k: p.detach().clone() for k, p in model.named_parameters()}


def accumulate(placement: str, defer: bool) -> tuple:
    """Rank body on a (2, 2) mesh: (first-step full grads, params, all-reduces and
    their bytes per step, grads seen before the last micro-batch)."""
    from flexshard.runtime.state import get_state

    rank = dist.get_rank()
    model = fs.flex_shard(make_model(), hsdp_mesh((2, 2)), placement=PLACEMENTS[placement])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    buckets = get_state(model).buckets
    grads, early = None, []
    for step in range(STEPS):
        before = sum(b.counters.all_reduces for b in buckets), \
            sum(b.counters.all_reduce_bytes for b in buckets)
        for m in range(MICRO):
            if defer:
                model.set_requires_all_reduce(m == MICRO - 1)
            x, y = batch(step * MICRO + m, rank)
            loss_fn(model(x), y).backward()
            if m < MICRO - 1:
                early.append(any(p.grad is not None for p in model.parameters()))
        if grads is None:
            grads = full_grads(model)
        opt.step()
        opt.zero_grad()
        counts = (sum(b.counters.all_reduces for b in buckets) - before[0],
                  sum(b.counters.all_reduce_bytes for b in buckets) - before[1])
    return grads, fs.full_state_dict(model), counts, any(early) if defer else None


@pytest.mark.parametrize("placement", ["shard0", "owned", "ragged"])
def test_deferred_all_reduce_matches_one_process_with_one_all_reduce_per_step(placement):
    ref_grads, ref_params = reference()
    every = run_world(WORLD, accumulate, placement, False)
    once = run_world(WORLD, accumulate, placement, True)
    for (grads, params, counts, early), (_, _, every_counts, _) in zip(once, every):
        assert early is False, "no grads are delivered before the all-reduce"
        for k, want in ref_grads.items():
            torch.testing.assert_close(grads[k], want, rtol=1e-5, atol=1e-7, msg=k)
        for k, want in ref_params.items():
            torch.testing.assert_close(params[k], want, rtol=1e-5, atol=1e-6, msg=k)
        buckets = every_counts[0] // MICRO
        assert counts == (buckets, every_counts[1] // MICRO)  # 1 all-reduce per bucket, not 4
        assert every_counts[0] == buckets * MICRO


def test_the_setter_takes_a_bool():
    model = fs.flex_shard(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"set_requires_all_reduce expects a bool, got 1"):
        model.set_requires_all_reduce(1)
