"""fs.clip_grad_norm_: the global norm over sharded grads, one all-reduce."""

from __future__ import annotations

import math

import pytest
import torch

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import make_model
from training_helpers import CountingComm, check_against_reference, train

STEPS = 3
MAX_NORM = 0.05  # below the TinyGPT grad norms of every order, so every step clips


def clip_step(clip, norm_type, norms):
    def step(model, i, x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(clip(model, MAX_NORM, norm_type)))
        return loss
    return step


def clipped_training(norm_type) -> tuple:
    """Rank body: train with fs.clip_grad_norm_; (losses, params, norms, all-reduces)."""
    comm = CountingComm()
    model = fs.flex_shard(make_model(), comm=comm)
    comm.reset()  # flex_shard's own check that the ranks agree all-reduces too
    norms = []
    losses = train(model, STEPS, clip_step(fs.clip_grad_norm_, norm_type, norms))
    # train() all-reduces the loss outside comm; the clips are the only comm all-reduces.
    return losses, fs.full_state_dict(model), norms, comm.calls["all_reduce"]


@pytest.mark.parametrize("world,norm_type", [(2, 2.0), (2, 1.0), (2, math.inf), (3, 2.0)])
def test_clip_parity(world, norm_type):
    results = run_world(world, clipped_training, norm_type)
    losses, full, norms, all_reduces = results[0]
    ref_norms = []
    step = clip_step(lambda m, *a: torch.nn.utils.clip_grad_norm_(m.parameters(), *a),
                     norm_type, ref_norms)
    check_against_reference(losses, full, world, STEPS, step_fn=step)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert all(n > MAX_NORM for n in ref_norms), "the test must actually clip"
    for _, _, rank_norms, rank_all_reduces in results:
        assert rank_norms == norms  # the same norm on every rank
        assert rank_all_reduces == STEPS  # one all-reduce per clip


def single_process_clip() -> tuple:
    model = fs.flex_shard(make_model())
    x, y = batch(0, 0)
    loss_fn(model(x), y).backward()
    return fs.clip_grad_norm_(model, MAX_NORM, 3.0)


def test_world_size_one_and_general_p():
    model = make_model()
    x, y = batch(0, 0)
    loss_fn(model(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, 3.0)
    torch.testing.assert_close(single_process_clip(), expected, rtol=1e-5, atol=0)


def nonfinite():
    model = fs.flex_shard(make_model())
    x, y = batch(0, torch.distributed.get_rank())
    loss_fn(model(x), y).backward()
    next(model.parameters()).grad[0] = float("inf")
    fs.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)


def bad_clip(max_norm, norm_type):
    fs.clip_grad_norm_(fs.flex_shard(make_model()), max_norm, norm_type)


def test_clip_rejects_bad_input():
    expect_all_ranks_raise(2, bad_clip, ValueError, r"norm_type must be > 0 .* got 0", 1.0, 0)
    expect_all_ranks_raise(2, bad_clip, ValueError, r"max_norm must be >= 0, got -1", -1, 2.0)
    expect_all_ranks_raise(2, bad_clip, TypeError, r"max_norm must be a number, got 'a'", "a", 2.0)
    # Rank 0's piece is inf; the global norm says so on every rank.
    expect_all_ranks_raise(2, nonfinite, RuntimeError, r"total norm of order 2.0 .* is inf")
    with pytest.raises(TypeError, match="not wrapped by flex_shard"):
        fs.clip_grad_norm_(make_model(), 1.0)
