"""Single-process references the distributed tests compare against."""

from __future__ import annotations

import copy

import torch

from models import TinyGPT, batch, loss_fn


def make_model(seed: int = 0, **kw) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kw)


def reference_run(world_size: int, steps: int, lr: float = 1e-2, param_dtype=None,
                  model_kw=None) -> tuple:
    """Train on every rank's batch at once: (loss per step, final params, step-0 grads).

    With `param_dtype`, each rank's micro-batch runs on a `param_dtype` copy of the
    fp32 master weights and the fp32-cast grads are averaged, as flexshard's
    mixed precision does with reduce_dtype=float32.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers: same kernels, same rounding
    try:
        return _run(world_size, steps, lr, param_dtype, model_kw)
    finally:
        torch.set_num_threads(threads)


def _run(world_size, steps, lr, param_dtype, model_kw) -> tuple:
    model = make_model(**(model_kw or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, first_grads = [], None
    for step in range(steps):
        if param_dtype is None:
            xs, ys = zip(*(batch(step, r) for r in range(world_size)))
            loss = loss_fn(model(torch.cat(xs)), torch.cat(ys))
            loss.backward()
            losses.append(loss.item())
        else:
            losses.append(low_precision_grads(model, step, world_size, param_dtype))
        if step == 0:
            first_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return losses, params, first_grads


def low_precision_grads(model, step, world_size, dtype, batch_fn=batch, loss=loss_fn) -> float:
    """Mixed precision by hand: each rank's batch on a `dtype` copy of `model`, the
    fp32 grads averaged into `model`'s .grad; returns the mean loss."""
    total = 0.0
    grads = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    for r in range(world_size):
        low = copy.deepcopy(model).to(dtype)
        x, y = batch_fn(step, r)
        value = loss(low(x), y)
        value.backward()
        total += value.item()
        for k, p in low.named_parameters():
            grads[k] += p.grad.float()
    for k, p in model.named_parameters():
        p.grad = grads[k] / world_size
    return total / world_size
