"""Sharded grads reach .grad through autograd (AccumulateGrad and its hooks,
torch.autograd.grad) while the reduce-scatters overlap the rest of backward."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import make_model


class EventComm(fs.GlooComm):
    """Logs each reduce-scatter launch."""

    def __init__(self, events):
        self.events = events

    def reduce_scatter(self, output, input, group, async_op=False):
        self.events.append("reduce")
        return super().reduce_scatter(output, input, group, async_op)


class MatmulLog(TorchDispatchMode):
    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm"):
            self.events.append("matmul")
        return func(*args, **(kwargs or {}))


def backward_events() -> list:
    """Rank body: the order of reduce launches, backward matmuls and grad deliveries."""
    import torch.distributed as dist

    events = []
    model = fs.flex_shard(make_model(layers=3), comm=EventComm(events))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: events.append("grad"))
    x, y = batch(0, dist.get_rank())
    loss = loss_fn(model(x), y)
    events.clear()
    with MatmulLog(events):
        loss.backward()
    return events


def test_reductions_overlap_backward_and_grads_arrive_last():
    for events in run_world(2, backward_events):
        first_reduce, first_grad = events.index("reduce"), events.index("grad")
        # Later blocks' matmuls run while an earlier block's reduction is in flight...
        assert "matmul" in events[first_reduce:first_grad]
        # ...and autograd delivers every grad after all the reductions were launched.
        assert events.count("reduce") == 4
        assert first_grad > max(i for i, e in enumerate(events) if e == "reduce")
        assert events.count("grad") == len(list(make_model(layers=3).parameters()))


def autograd_grad_matches_backward() -> bool:
    """Rank body: torch.autograd.grad wrt sharded params equals .grad after backward."""
    import torch.distributed as dist

    model = fs.flex_shard(make_model())
    params = list(model.parameters())
    x, y = batch(0, dist.get_rank())
    grads = torch.autograd.grad(loss_fn(model(x), y), params)
    assert all(p.grad is None for p in params)
    loss_fn(model(x), y).backward()
    return all(torch.equal(g, p.grad) for g, p in zip(grads, params))


def test_autograd_grad_wrt_sharded_params():
    assert run_world(2, autograd_grad_matches_backward) == [True, True]
