"""Shared pieces of the training-feature tests: Comms that count or delay
collectives, a short sharded training loop and the parity check against the
single-process reference (tests/reference.py)."""

from __future__ import annotations

import time
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import flexshard as fs
from models import batch, loss_fn
from reference import assert_rel_close, make_model, reference_run

LR = 1e-2
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class NoCollectives(fs.GlooComm):
    """Fails the test if flexshard issues any collective (bad input must be
    refused before one)."""

    def all_gather(self, *args, **kwargs):
        raise AssertionError("a collective was issued before the error")

    reduce_scatter = reduce_scatter_uneven = all_reduce = all_to_all = all_gather


class CountingComm(fs.GlooComm):
    """Counts collectives; wraps the real ones (GlooComm's: what flex_shard runs
    on gloo, rooted above its threshold), so the path users run is the one counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}

    def all_gather(self, output, input, group, async_op=False):
        self.calls["all_gather"] += 1
        return super().all_gather(output, input, group, async_op)

    def reduce_scatter(self, output, input, group, async_op=False):
        self.calls["reduce_scatter"] += 1
        return super().reduce_scatter(output, input, group, async_op)

    def reduce_scatter_uneven(self, output, input, sizes, group, async_op=False, **kwargs):
        self.calls["reduce_scatter"] += 1  # whole tensors on unequal ranks, a ragged group
        return super().reduce_scatter_uneven(output, input, sizes, group, async_op, **kwargs)

    def all_reduce(self, tensor, group, op=dist.ReduceOp.SUM):
        self.calls["all_reduce"] += 1
        return super().all_reduce(tensor, group, op)

    def reset(self) -> None:
        self.calls = dict.fromkeys(self.calls, 0)


class GroupComm(fs.GlooComm):
    """Counts each bucket collective by (kind, the global ranks of its group),
    wrapping the real ones (see CountingComm)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def _count(self, kind, group) -> None:
        self.calls[(kind, tuple(dist.get_process_group_ranks(group)))] += 1

    def all_gather(self, output, input, group, async_op=False):
        self._count("all_gather", group)
        return super().all_gather(output, input, group, async_op)

    def reduce_scatter(self, output, input, group, async_op=False, **kwargs):
        self._count("reduce_scatter", group)
        return super().reduce_scatter(output, input, group, async_op, **kwargs)

    def reduce_scatter_uneven(self, output, input, sizes, group, async_op=False, **kwargs):
        self._count("reduce_scatter", group)
        return super().reduce_scatter_uneven(output, input, sizes, group, async_op, **kwargs)

    def all_reduce(self, tensor, group, op=dist.ReduceOp.SUM):
        self._count("all_reduce", group)
        return super().all_reduce(tensor, group, op)


def settled(read, want, timeout: float = 5.0):
    """read() once it equals `want`, or its last value after `timeout` seconds.

    The comm backend's worker thread drops its reference to a finished
    collective's tensors shortly after wait() returns (gloo here, NCCL's
    watchdog likewise), so storage freed by flexshard may take a moment to
    die. A leak never settles; a late release does."""
    deadline = time.monotonic() + timeout
    value = read()
    while value != want and time.monotonic() < deadline:
        time.sleep(0.01)
        value = read()
    return value


class UnshardedTracker:
    """Weak references to the storage of every unsharded param any bucket makes
    (the gather output when params are views of it, else each copy-out), so a
    test can ask how many unsharded bytes are alive, per bucket. A storage the
    bucket keeps across gathers (runtime/unsharded.py) counts while allocated."""

    def __init__(self, model) -> None:
        from flexshard.runtime.state import get_state

        self.made: dict = {}  # bucket name -> {id(storage): weakref to it}
        for bucket in get_state(model).buckets:
            bucket.gather.gather = self._recording(bucket.name, bucket.gather.gather)

    def _recording(self, name, gather):
        def gather_params(layout=None, new_tensors=False):
            outs = gather(layout, new_tensors)
            made = self.made.setdefault(name, {})
            for t in outs:
                if t.numel():
                    storage = t.untyped_storage()
                    made[id(storage)] = weakref.ref(storage)
            return outs
        return gather_params

    def live_bytes(self) -> dict:
        """bucket name -> bytes of its unsharded storage still alive (0 omitted)."""
        live = {name: sum(s.nbytes() for s in (r() for r in refs.values()) if s is not None)
                for name, refs in self.made.items()}
        return {name: n for name, n in live.items() if n}

    def live_bytes_among(self, allocations) -> int:
        """Bytes of the unsharded storages alive that `allocations` (test_memory's
        Allocations) saw an op create: a storage the bucket made once and
        reallocated by a resize (runtime/unsharded.py) was not."""
        made = allocations.made
        return sum(s.nbytes() for refs in self.made.values() for s in (r() for r in refs.values())
                   if s is not None and s.nbytes() and s.data_ptr() in made
                   and made[s.data_ptr()][0]() is s)

    def forget_dead(self) -> None:
        for refs in self.made.values():
            for key in [k for k, r in refs.items() if r() is None]:
                del refs[key]


class DelayedWork:
    """A Work whose wait() returns no earlier than `delay` seconds after launch."""

    def __init__(self, work, delay: float, comm: "DelayComm", kind: str) -> None:
        self.work, self.kind, self.comm = work, kind, comm
        self.done_at = time.monotonic() + delay
        comm.in_flight.append(self)

    def wait(self, timeout=None) -> bool:
        if self.work is not None:
            self.work.wait()
        time.sleep(max(0.0, self.done_at - time.monotonic()))
        if self in self.comm.in_flight:
            self.comm.in_flight.remove(self)
        return True


class DelayComm(CountingComm):
    """Collectives that take at least `delay` seconds (an injected slow
    network). `in_flight` holds the launched collectives not yet waited for."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay, self.in_flight = delay, []

    def all_gather(self, output, input, group, async_op=False):
        work = DelayedWork(super().all_gather(output, input, group, True), self.delay,
                           self, "all_gather")
        return work if async_op else work.wait() and None

    def reduce_scatter(self, output, input, group, async_op=False):
        work = DelayedWork(super().reduce_scatter(output, input, group, True), self.delay,
                           self, "reduce_scatter")
        return work if async_op else work.wait() and None

    def flying(self, kind: str) -> int:
        return sum(w.kind == kind for w in self.in_flight)


class MatmulLog(TorchDispatchMode):
    """Counts matmuls, and for each one what `probe()` said when it ran."""

    def __init__(self, probe=lambda: None) -> None:
        super().__init__()
        self.probe, self.seen = probe, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.seen.append(self.probe())
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return len(self.seen)


def accumulate_two_halves(model, step, x, y):
    """Two half micro-batches, the first without gradient sync."""
    total = 0.0
    for micro, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2))):
        if isinstance(model, fs.FlexShardModule):
            model.set_requires_gradient_sync(micro == 1)
        loss = loss_fn(model(xs), ys) / 2
        loss.backward()
        total = total + loss.detach()
    return total


def train(model, steps: int, step_fn=None, opt=None, first_step: int = 0) -> list:
    """AdamW steps of `model` on this rank's batches; per-step losses
    averaged over ranks. `step_fn(model, step, x, y)` returns the loss after
    running backward itself (default: one forward and backward)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = batch(step, rank)
        loss = _forward_backward(model, step, x, y, step_fn)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _forward_backward(model, step, x, y, step_fn):
    """The loss after backward: one forward and backward, or `step_fn`'s."""
    if step_fn is not None:
        return step_fn(model, step, x, y)
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss


def reference_train(model, world: int, steps: int, step_fn=None) -> tuple:
    """Single-process AdamW on every rank's batch at once, for a model the
    test built itself (reference_run builds a plain TinyGPT):
    (losses, named params). `step_fn` as in train()."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers: same kernels, same rounding
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for step in range(steps):
            xs, ys = zip(*(batch(step, r) for r in range(world)))
            loss = _forward_backward(model, step, torch.cat(xs), torch.cat(ys), step_fn)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    # keyed as the model's state dict (no wrapper's `_checkpoint_wrapped_module.`), as
    # fs.full_state_dict is; tied params under each name
    return losses, {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()
                    if isinstance(v, torch.nn.Parameter)}


def check_against_reference(losses, full: dict, world: int, steps: int, model_kw=None,
                            model=None, step_fn=None, rtol: float = 1e-5) -> None:
    """Per-step losses and final full params match the single-process run of
    `model` (default: reference_run's TinyGPT(**model_kw)), fp32."""
    if model is None and step_fn is None:
        ref_losses, ref_params, _ = reference_run(world, steps, lr=LR, model_kw=model_kw)
    else:
        model = model if model is not None else make_model(**(model_kw or {}))
        ref_losses, ref_params = reference_train(model, world, steps, step_fn)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    assert full.keys() == ref_params.keys()
    for k in ref_params:
        if ref_params[k].norm() == 0:  # a frozen zero-initialised param: stays exactly zero
            assert torch.equal(full[k], ref_params[k]), k
        else:
            assert_rel_close(full[k], ref_params[k], rtol, k)


def full_grads(model) -> dict:
    """FQN -> the full gradient of a flex-sharded `model` on every rank (None
    where no rank has one): the public fs.full_grads."""
    return fs.full_grads(model)


@dataclass(frozen=True)
class _Relayed(fs.WireFormat):
    """A param sent as it is, in a format of the user's own (not a Cast)."""

    dtype: torch.dtype

    def parts(self, shape, placement, world_size):
        return (fs.WirePart(shape, self.dtype, placement),)

    def encode(self, piece, outs, mesh):
        outs[0].copy_(piece)

    def decode(self, fulls, meta):
        return fulls[0]


@dataclass(frozen=True)
class Relayed(fs.WirePolicy):
    """Every param in `_Relayed`, a wire format of the user's own: exact, neither a
    Cast nor a format that decodes into a buffer, so its params are made by the
    first decode and renewed by WireFormat.refill's default (runtime/unsharded.py)."""

    def format(self, fqn, shape, dtype, gather_dtype, placement, world_size):
        return _Relayed(gather_dtype)


# The two ways a bucket refills its params made once, as a gather_format to ask for each.
RESHARD_PATHS = {"in place": None, "refilled by decode": Relayed()}
