"""A bucket's unsharded params made once and refilled in place (runtime/unsharded.py):
the same tensors every step, no saved-tensor hook in the block's forward, and the
gradients of the unwrapped model when several forwards share one backward, when an
eval forward runs between forward and backward, and when two graphs are
backpropagated one after the other; a storage changed in between raises."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import make_model

LR = 0.5  # SGD: the step is the gradient, so a wrong scale shows
WORLD = 2


def _microbatches(rank: int) -> list:
    return [batch(k, rank) for k in (rank, rank + WORLD)]


def _backward(model, how: str) -> None:
    """Two microbatches' losses backpropagated, `how`."""
    (x1, y1), (x2, y2) = _microbatches(dist.get_rank())
    first = loss_fn(model(x1), y1)
    if how == "eval between":
        with torch.no_grad():
            model(x2)
        first.backward()
        loss_fn(model(x2), y2).backward()
        return
    second = loss_fn(model(x2), y2)
    if how == "one backward":
        (first + second).backward()
    else:  # "second first"
        second.backward()
        first.backward()


def stepped(how: str, reshard) -> dict:
    """Rank body: one SGD step on two microbatches' grads; the full params."""
    model = fs.flex_shard(make_model(), reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _backward(model, how)
    opt.step()
    return fs.full_state_dict(model)


def _reference() -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for r in range(WORLD):
        for x, y in _microbatches(r):
            (loss_fn(model(x), y) / WORLD).backward()
    opt.step()
    return model.state_dict()


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("how", ["one backward", "second first", "eval between"])
def test_several_forwards_train_as_the_unwrapped_model(how, reshard):
    want = _reference()
    for got in run_world(WORLD, stepped, how, reshard):
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def evaluated_first(reshard) -> tuple:
    """Rank body: the first forward under torch.inference_mode() (evaluating a model
    before training it), then the two microbatches' SGD step: (eval logits, full params)."""
    model = fs.flex_shard(make_model(), reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with torch.inference_mode():
        logits = model(batch(99, 0)[0])
    _backward(model, "one backward")
    opt.step()
    return logits, fs.full_state_dict(model)


@pytest.mark.parametrize("reshard", [True, False])
def test_inference_mode_before_the_first_step_leaves_the_model_trainable(reshard):
    want = _reference()
    with torch.inference_mode():
        want_logits = make_model()(batch(99, 0)[0])
    for logits, got in run_world(WORLD, evaluated_first, reshard):
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def changed_between() -> str:
    """Rank body: forward, a param changed in place, forward again, backward of the first."""
    model = fs.flex_shard(make_model())
    (x1, y1), (x2, y2) = _microbatches(dist.get_rank())
    first = loss_fn(model(x1), y1)
    with torch.no_grad():
        model.layers[0].up.weight.mul_(2)  # as an optimizer step would
    loss_fn(model(x2), y2)
    try:
        first.backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_backward_of_a_forward_whose_params_changed_raises():
    for message in run_world(WORLD, changed_between):
        assert "its sharded params changed between forward and backward" in message, message


def same_tensors() -> dict:
    """Rank body: block 0's unsharded up-projection weight in two steps' forwards
    (identity, storage bytes after the step) and the saved-tensor hooks active there."""
    from flexshard.compat import top_saved_tensors_default_hooks

    model = fs.flex_shard(make_model())
    seen = []
    model.layers[0].up.register_forward_hook(lambda m, a, out: seen.append(
        (m.weight, top_saved_tensors_default_hooks(False))))
    for step in range(2):
        x, y = batch(step, dist.get_rank())
        loss_fn(model(x), y).backward()
    (w0, hooks0), (w1, hooks1) = seen
    return {"same": w0 is w1, "hooks": [hooks0, hooks1], "bytes": w1.untyped_storage().nbytes(),
            "shape": tuple(w1.shape)}


def test_unsharded_params_are_made_once_and_freed_between_steps():
    for facts in run_world(WORLD, same_tensors):
        assert facts["same"]
        assert facts["hooks"] == [None, None]  # autograd saves the block's tensors itself
        assert facts["bytes"] == 0 and facts["shape"] == (50, 30)


# Several backward passes through one forward: each refills what the last one freed,
# and a pass that builds a graph of its own (create_graph) frees nothing it reads.

def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5),
                               torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _mlp_batch(rank: int) -> tuple:
    g = torch.Generator().manual_seed(17 + rank)
    return torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)


def _passes(model, x, y, how: str, div: int) -> None:
    """`how`: "retained" (two losses, retain_graph) or "penalty" (an input-gradient
    penalty: autograd.grad with create_graph, then backward through both)."""
    if how == "retained":
        out = model(x)
        (loss_fn_mse(out, y) / div).backward(retain_graph=True)
        (out.abs().mean() / div).backward()
        return
    x = x.clone().requires_grad_(True)
    out = model(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    ((loss_fn_mse(out, y) + g.square().sum()) / div).backward()


def loss_fn_mse(out, y):
    return (out - y).square().mean()


def several_passes(how: str, reshard) -> dict:
    """Rank body: two SGD steps of `_passes` on a model of three buckets; the full params."""
    specs = [fs.BucketSpec(f"{i}.*") for i in (0, 2, 4)]
    model = fs.flex_shard(_mlp(), buckets=specs, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(2):
        _passes(model, *_mlp_batch(dist.get_rank()), how, 1)
        opt.step()
        opt.zero_grad()
    return fs.full_state_dict(model)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("how", ["retained", "penalty"])
def test_several_backward_passes_through_one_forward_train_as_the_unwrapped_model(how, reshard):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(2):
        for r in range(WORLD):
            _passes(model, *_mlp_batch(r), how, WORLD)
        opt.step()
        opt.zero_grad()
    for got in run_world(WORLD, several_passes, how, reshard):
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
