"""torch.amp.GradScaler over sharded grads: its inf/NaN check is global, so when a
non-finite value lands in one rank's shard every rank skips that step and halves
its scale, as one process does (checked against it at 2 ranks, with SGD).
tests/test_bucket_mesh.py checks the same for experts on a smaller mesh and HSDP."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import assert_rel_close, make_model

pytestmark = pytest.mark.world

WORLD, STEPS, BAD_STEP, LR = 2, 4, 1, 0.05
MAX_NORM = 0.05  # below TinyGPT's grad norms: every clipped step clips


class Poison:
    """A forward hook on the token embedding: in step BAD_STEP (where `active`) its
    output's grad gets an inf at rank 0's first token, so one row of tok.weight's
    grad is inf: in the sharded model, a row in one rank's shard of it."""

    def __init__(self, active: bool) -> None:
        self.step, self.active = 0, active

    def __call__(self, module, inputs, out: torch.Tensor) -> None:
        if self.active and self.step == BAD_STEP:
            out.register_hook(_inf_at_first_token)


def _inf_at_first_token(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[0, 0, 0] = math.inf
    return grad


def scaled_training(model, poison: Poison, batches, clip: bool) -> tuple:
    """SGD under GradScaler("cpu"), with `clip` the AMP recipe's unscale_ and
    torch's clip_grad_norm_ before the step: (steps skipped, final scale, per step
    whether this rank's piece of tok.weight's grad was finite)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)  # powers of 2: exact scaling
    skipped, finite = [], []
    for step in range(STEPS):
        poison.step = step
        x, y = batches(step)
        scaler.scale(loss_fn(model(x), y)).backward()
        finite.append(bool(torch.isfinite(model.tok.weight.grad).all()))  # local: all()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(scaler.get_scale() < scale)
    return skipped, scaler.get_scale(), finite


def poisoned_model(active: bool) -> tuple:
    model, poison = make_model(), Poison(active)
    model.tok.register_forward_hook(poison)
    return model, poison


def sharded_body(clip: bool) -> tuple:
    rank = dist.get_rank()
    model, poison = poisoned_model(active=rank == 0)  # the reference's first sample
    fs.flex_shard(model)
    result = scaled_training(model, poison, lambda step: batch(step, rank), clip)
    return result, fs.full_state_dict(model)


def reference(clip: bool) -> tuple:
    model, poison = poisoned_model(active=True)

    def batches(step):
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
        return torch.cat(xs), torch.cat(ys)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers: same kernels, same rounding
    try:
        result = scaled_training(model, poison, batches, clip)
    finally:
        torch.set_num_threads(threads)
    return result, {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("clip", [False, True])
def test_a_nonfinite_grad_in_one_shard_skips_the_step_on_every_rank(clip):
    results = run_world(WORLD, sharded_body, clip)
    (ref_skipped, ref_scale, _), ref_params = reference(clip)
    assert ref_skipped == [step == BAD_STEP for step in range(STEPS)]
    assert sorted(finite[BAD_STEP] for (_, _, finite), _ in results) == [False, True], \
        "the inf must lie in one rank's shard only"
    assert [(skipped, scale) for (skipped, scale, _), _ in results] == \
        [(ref_skipped, ref_scale)] * WORLD
    for rank, (_, full) in enumerate(results):
        assert full.keys() == ref_params.keys()
        for k, v in ref_params.items():
            assert_rel_close(full[k], v, 1e-5, f"rank {rank}: {k}")
