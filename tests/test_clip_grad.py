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


# The spellings of a grad's norm a training loop uses, and GradScaler's inf check.

def norm_spellings() -> dict:
    """Rank body: one backward; each spelling's norm of a sharded grad, and the
    refusal of a matrix norm that is not a sum over the elements."""
    import torch.distributed as dist

    model = fs.flex_shard(make_model())
    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    g = model.layers[0].up.weight.grad
    out = {"norm": g.norm(), "data": g.data.norm(), "detach": g.detach().norm(),
           "linalg": torch.linalg.norm(g), "matrix": torch.linalg.matrix_norm(g),
           "vector": torch.linalg.vector_norm(g)}
    try:
        torch.linalg.matrix_norm(g, ord=2)
    except NotImplementedError as e:
        out["refused"] = str(e)
    return out


def test_every_spelling_of_a_full_norm_is_global():
    ref = make_model()
    for rank in range(2):
        x, y = batch(0, rank)
        (loss_fn(ref(x), y) / 2).backward()
    want = ref.layers[0].up.weight.grad.norm()
    for got in run_world(2, norm_spellings):
        refused = got.pop("refused")
        assert "matrix_norm(grad, ord=2) of a sharded grad" in refused, refused
        assert "Take it of p.grad.full_tensor()" in refused, refused
        for spelling, value in got.items():
            torch.testing.assert_close(value, want, rtol=1e-5, atol=0, msg=spelling)


def hand_clip(model) -> None:
    """The classic clip written by hand: a total of `.data.norm()`s, then `.data.mul_`."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.stack([g.data.norm(2) for g in grads]).norm(2)
    coef = (0.05 / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.data.mul_(coef)


def _sgd_steps(model, batches, clip) -> list:
    """SGD steps on `batches(step)` with `clip(model)` between backward and step: the losses."""
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.5), []
    for step in range(STEPS):
        x, y = batches(step)
        loss = loss_fn(model(x), y)
        loss.backward()
        clip(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def hand_clipped() -> tuple:
    import torch.distributed as dist

    model = fs.flex_shard(make_model())
    losses = _sgd_steps(model, lambda step: batch(step, dist.get_rank()), hand_clip)
    return losses, fs.full_state_dict(model)


def test_a_hand_written_clip_of_data_norms_trains_as_one_process():
    ref = make_model()
    _sgd_steps(ref, lambda step: tuple(torch.cat(t) for t in zip(batch(step, 0), batch(step, 1))),
               hand_clip)
    for _, full in run_world(2, hand_clipped):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)


def _embed_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(8, 6), torch.nn.Linear(6, 3))


def _scaler_batch(step: int, rank: int) -> tuple:
    """At step 1, rank 1 has an inf target: only some rows of the grads go non-finite."""
    g = torch.Generator().manual_seed(100 * step + rank)
    ids, y = torch.randint(0, 8, (4, 5), generator=g), torch.randn(4, 5, 3, generator=g)
    if (step, rank) == (1, 1):
        ids[0], y[0, :, 0] = torch.tensor([0, 1, 2, 3, 0]), float("inf")
    return ids, y


def _scaled_steps(model, ranks, div: int) -> list:
    """GradScaler SGD steps over `ranks`' batches: (scale after each step) per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler, scales = torch.amp.GradScaler("cpu", init_scale=16.0), []
    for step in range(4):
        for rank in ranks:
            ids, y = _scaler_batch(step, rank)
            scaler.scale((model(ids) - y).square().mean() / div).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def scaled_training() -> tuple:
    import torch.distributed as dist

    model = fs.flex_shard(_embed_model(), buckets=[fs.BucketSpec("0.*"), fs.BucketSpec("1.*")])
    return _scaled_steps(model, [dist.get_rank()], 1), fs.full_state_dict(model)


def test_grad_scaler_skips_a_step_on_every_rank_when_one_piece_is_not_finite():
    ref = _embed_model()
    want_scales = _scaled_steps(ref, [0, 1], 2)
    assert want_scales == [16.0, 8.0, 8.0, 8.0]  # step 1 skipped, the scale halved
    for scales, full in run_world(2, scaled_training):
        assert scales == want_scales
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)
