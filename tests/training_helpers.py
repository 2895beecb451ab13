"""Shared pieces of the training-feature tests: a counting Comm, short
training loops (sharded, inside a world, and the single-process reference)
and the parity check between them."""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

import flexshard as fs
from models import TinyGPT, batch, loss_fn

STEPS = 3
LR = 1e-2


class CountingComm(fs.Comm):
    """Counts collectives; keeps weakrefs to gather outputs to measure live bytes."""

    def __init__(self) -> None:
        self.calls = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        self.gather_outputs: list = []  # (weakref to untyped storage, nbytes)

    def all_gather(self, output, input, group, async_op=False):
        self.calls["all_gather"] += 1
        self.gather_outputs.append((weakref.ref(output.untyped_storage()), output.nbytes))
        return super().all_gather(output, input, group, async_op)

    def reduce_scatter(self, output, input, group, async_op=False):
        self.calls["reduce_scatter"] += 1
        return super().reduce_scatter(output, input, group, async_op)

    def all_reduce(self, tensor, group, op=dist.ReduceOp.SUM):
        self.calls["all_reduce"] += 1
        return super().all_reduce(tensor, group, op)

    def live_gather_bytes(self) -> int:
        """Bytes of gather outputs still alive (some view of them is referenced)."""
        return sum(n for ref, n in self.gather_outputs if ref() is not None)

    def reset(self) -> None:
        self.calls = dict.fromkeys(self.calls, 0)


class DelayedWork:
    """A Work that reports done only `delay` seconds after launch."""

    def __init__(self, work, delay: float, log: list, name: str) -> None:
        self.work, self.done_at, self.log, self.name = work, time.monotonic() + delay, log, name

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at and self.work.is_completed()

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        time.sleep(max(0.0, self.done_at - time.monotonic()))
        self.log.append(("wait", self.name))
        return True


class DelayComm(CountingComm):
    """Every async all-gather takes at least `delay` seconds (an injected
    slow network); the log records launches and waits."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay, self.log, self.inflight = delay, [], []

    def all_gather(self, output, input, group, async_op=False):
        work = super().all_gather(output, input, group, async_op=True)
        name = f"gather{self.calls['all_gather']}"
        delayed = DelayedWork(work, self.delay, self.log, name)
        self.log.append(("launch", name))
        self.inflight.append(delayed)
        if async_op:
            return delayed
        delayed.wait()
        return None

    def gathers_in_flight(self) -> int:
        return sum(not w.is_completed() for w in self.inflight)


def make_model(seed: int = 0, **kwargs) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)


def train_steps(model, steps: int = STEPS, rank: int = 0, world: int = 1, opt=None,
                step_fn=None) -> list:
    """AdamW steps on `batch(step, rank)`; returns the per-step losses
    (averaged over ranks when distributed)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        inputs, targets = batch(step, rank)
        loss = step_fn(model, inputs, targets) if step_fn else loss_fn(model(inputs), targets)
        if step_fn is None:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(_mean_over_ranks(loss.detach(), world))
    return losses


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    if world > 1:
        loss = loss.clone()
        dist.all_reduce(loss)
        loss /= world
    return float(loss)


def reference_batch(step: int, world: int):
    """The union of every rank's batch: one process sees what all ranks see."""
    parts = [batch(step, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def train_reference(model, world: int, steps: int = STEPS, step_fn=None) -> tuple:
    """Single-process AdamW on the union of the ranks' batches; (losses, state)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        inputs, targets = reference_batch(step, world)
        loss = step_fn(model, inputs, targets) if step_fn else loss_fn(model(inputs), targets)
        if step_fn is None:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_parity(losses, state, ref_losses, ref_state, rtol: float = 1e-5) -> None:
    """Losses each step and full params at the end match the reference (fp32)."""
    assert len(losses) == len(ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs reference {b}"
    assert set(state) <= set(ref_state), sorted(set(state) - set(ref_state))
    for fqn, value in state.items():
        torch.testing.assert_close(value, ref_state[fqn], rtol=rtol, atol=1e-6,
                                   msg=lambda m: f"{fqn}: {m}")
