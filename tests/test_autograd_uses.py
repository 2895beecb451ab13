"""torch's autograd used around a flex_shard model beyond loss.backward(): what
cannot hold for sharded params is refused on every rank with a RuntimeError naming
the bucket and the fix, where it used to compute silently wrong, and the model then
trains on as the one-process run (SGD) does. What works is checked against torch."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import assert_rel_close, make_model, reference_run
from training_helpers import train

WORLD, LR, STEPS = 2, 0.05, 2
PLACEMENTS = {"shard": fs.Shard(0), "owned": fs.Owned(), "ragged": fs.RaggedShard()}


def _refused_then_trains(placement: str, misuse) -> tuple:
    """`misuse(model, x, y)` on a fresh wrapped TinyGPT: the RuntimeError's
    message (None if it ran), then STEPS of training."""
    model = fs.flex_shard(make_model(), placement=PLACEMENTS[placement])
    x, y = batch(9, dist.get_rank())
    try:
        misuse(model, x, y)
        said = None
    except RuntimeError as e:
        said = str(e)
    return said, train(model, STEPS, opt=torch.optim.SGD(model.parameters(), lr=LR)), \
        fs.full_state_dict(model)


def _check(placement: str, misuse, match: str) -> None:
    ref_losses, ref_params, _ = reference_run(
        WORLD, STEPS, make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=LR))
    for said, losses, full in run_world(WORLD, _refused_then_trains, placement, misuse,
                                        timeout=300):
        assert said is not None, "no rank may go on: every rank raises"
        assert re.search(match, said), said
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        for k, want in ref_params.items():
            assert_rel_close(full[k], want, 1e-5, k)


def functional_call_with_other_params(model, x, y) -> None:
    halved = {n: p * 0.5 for n, p in model.named_parameters()}
    torch.func.functional_call(model, halved, (x,))


def functional_call_of_a_block(model, x, y) -> None:
    """A block with a bucket of its own, called by itself (it gathers alone)."""
    block = model.layers[0]
    halved = {n: p * 0.5 for n, p in block.named_parameters()}
    torch.func.functional_call(block, halved, (torch.randn(2, 11, 30),))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("call", [functional_call_with_other_params, functional_call_of_a_block],
                         ids=["model", "block"])
def test_functional_call_with_other_params_is_refused(placement, call):
    """It used to compute with the model's own params (the gather put them over the
    tensors passed), at every placement."""
    _check(placement, call,
           r"parameter '.*' \(bucket '.*'\) was replaced on its module for this forward "
           r"\(torch\.func\.functional_call")


def own_params_call() -> bool:
    model = fs.flex_shard(make_model())
    x, _ = batch(0, dist.get_rank())
    with torch.no_grad():
        return torch.equal(torch.func.functional_call(model, dict(model.named_parameters()),
                                                      (x,)), model(x))


def test_functional_call_with_the_models_own_params_runs():
    assert run_world(WORLD, own_params_call) == [True] * WORLD


def penalty_on_weight_grads(model, x, y) -> None:
    params = [p for p in model.parameters() if p.numel()]
    grads = torch.autograd.grad(loss_fn(model(x), y), params, create_graph=True)
    sum(g.square().sum() for g in grads).backward()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_create_graph_through_the_params_is_refused(placement):
    """It used to drop the penalty (Shard, RaggedShard: the grads came back without a
    graph) or fail in autograd's internals (Owned)."""
    _check(placement, penalty_on_weight_grads,
           r"create_graph=True reached the params of bucket '.*'.*inputs only works")


def grad_inside_no_sync(model, x, y) -> None:
    model.set_requires_gradient_sync(False)
    try:  # a probe of the grads (their norm, say) between accumulated micro-batches
        torch.autograd.grad(loss_fn(model(x), y), list(model.parameters()), allow_unused=True)
    finally:
        model.set_requires_gradient_sync(True)


@pytest.mark.parametrize("placement", ["shard", "owned"])
def test_autograd_grad_inside_a_no_sync_accumulation_is_refused(placement):
    """It used to add the probe's gradient to the accumulated sum, which the next
    synced backward reduced into .grad."""
    _check(placement, grad_inside_no_sync,
           r"torch\.autograd\.grad with respect to the params of bucket '.*' inside a "
           r"no-sync accumulation")


def no_sync_sums() -> tuple:
    """backward() inside a no-sync accumulation, then a synced one: .grad is the sum
    (the check above leaves .backward() alone)."""
    model = fs.flex_shard(make_model())
    rank = dist.get_rank()
    model.set_requires_gradient_sync(False)
    loss_fn(model(batch(0, rank)[0]), batch(0, rank)[1]).backward()
    model.set_requires_gradient_sync(True)
    loss_fn(model(batch(1, rank)[0]), batch(1, rank)[1]).backward()
    ref = make_model()
    for step in range(2):
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
        loss_fn(ref(torch.cat(xs)), torch.cat(ys)).backward()
    return fs.full_grads(model), {k: p.grad for k, p in ref.named_parameters()}


def test_no_sync_backward_still_accumulates():
    for grads, ref in run_world(WORLD, no_sync_sums):
        for k, want in ref.items():
            torch.testing.assert_close(grads[k], want, rtol=1e-4, atol=1e-6, msg=k)
