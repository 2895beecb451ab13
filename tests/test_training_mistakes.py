"""The training-loop mistakes FSDP2 users make (issue 35): each one either trains
as the user meant, checked at 2 ranks against the one-process run with SGD (a
wrong gradient scale shows, where Adam would hide it), or raises on every rank,
naming the parameter and the fix, before the step it would corrupt.
docs/troubleshooting.md lists them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import make_model
from training_helpers import check_against_reference

STEPS = 3
LR = 0.05
WORLD = 2


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def sgd_train(model, opt, steps: int = STEPS, step_fn=None) -> list:
    """SGD steps on this rank's batches; the per-step losses averaged over ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = batch(step, rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        if step_fn is not None:
            step_fn(model)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def reference(step_fn=None, model=None, steps: int = STEPS) -> tuple:
    """The one-process SGD run on every rank's batch: (losses, params)."""
    model = model if model is not None else make_model()
    opt = sgd(model.parameters())
    losses = []
    for step in range(steps):
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
        loss = loss_fn(model(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        if step_fn is not None:
            step_fn(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_matches_reference(result, step_fn=None, model=None) -> None:
    losses, full = result
    ref_losses, ref_params = reference(step_fn, model)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert full.keys() == ref_params.keys()
    for k, v in ref_params.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)


# An optimizer built before flex_shard keeps working: the Parameter objects stay.


def optimizer_before_wrap():
    model = make_model()
    before = dict(model.named_parameters())
    opt = sgd(model.parameters())
    fs.flex_shard(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before), "the Parameter objects changed"
    assert [p.shape for p in opt.param_groups[0]["params"]] == [p.shape for p in after.values()]
    return sgd_train(model, opt), fs.full_state_dict(model)


def test_optimizer_built_before_wrapping_trains():
    results = run_world(WORLD, optimizer_before_wrap)
    assert_matches_reference(results[0])
    assert results[1][1].keys() == results[0][1].keys()


# Under torchrun with no process group: flex_shard initialises the default one.


def test_torchrun_without_init_process_group(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    out = tmp_path / "rank0.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(tests / "torchrun_no_init.py"), str(out), str(LR), str(STEPS)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    seen = torch.load(out)
    assert (seen["world"], seen["backend"]) == (2, "gloo")
    full_rows = seen["rows"][1]
    assert seen["rows"][0] == -(-full_rows // 2), seen["rows"]  # rank 0 holds its half
    assert_matches_reference((seen["losses"], seen["full"]))
