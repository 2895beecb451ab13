"""An exception raised inside a user's forward or backward leaves the wrapped
module usable: buckets are SHARDED again, no saved-tensor hooks are left on the
stack, no unsharded storage is held and the next step matches a single-process
reference."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import flexshard as fs
from flexshard.runtime.bucket import BucketState
from flexshard.runtime.state import get_state
from harness import run_world
from models import TinyGPT, batch, loss_fn
from training_helpers import RESHARD_PATHS

pytestmark = pytest.mark.world

LR = 1e-2
RTOL = 1e-5


class Injected(RuntimeError):
    """The failure the tests inject."""


class Flaky(nn.Module):
    """Wraps a module; raises on its `fail_at`-th call (counting from 1)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.calls, self.fail_at = inner, 0, None

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise Injected(f"injected failure on call {self.calls}")
        return self.inner(x)


def _models(mp_policy=fs.MixedPrecisionPolicy()):
    """(wrapped model, identical unwrapped reference); layers[1].norm2 is Flaky."""
    torch.manual_seed(0)
    model = TinyGPT()
    model.layers[1].norm2 = Flaky(model.layers[1].norm2)
    reference = copy.deepcopy(model)
    return fs.flex_shard(model, mp_policy=mp_policy), reference


def _clean_state(model) -> list:
    """What must hold after any step, failed or not; returns the violations."""
    state, problems = get_state(model), []
    problems += [f"bucket {b.name} is {b.state}" for b in state.buckets
                 if b.state is not BucketState.SHARDED]
    sharded = {id(p) for b in state.buckets for p in b.params}
    problems += [f"{n} is not a sharded param" for n, p in model.named_parameters()
                 if id(p) not in sharded]
    if _get_current_dispatch_mode_stack():
        problems.append(f"dispatch modes left: {_get_current_dispatch_mode_stack()}")
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        problems.append("saved-tensor hooks left on the stack")
    return problems


def _fail_once(model, where: str, x, y) -> None:
    """One training step that raises Injected `where` (forward, backward, or
    backward's regather of layer 0's bucket, which layer 1's backward prefetched)."""
    flaky = model.layers[1].norm2
    flaky.calls = 0
    flaky.fail_at = 1 if where == "forward" else None
    handle = None
    buckets = get_state(model).buckets
    if where == "backward":  # a tensor hook on layer 0's input: layer 1's grads are reduced
        def arm(module, args):
            args[0].register_hook(lambda grad: (_ for _ in ()).throw(Injected("in backward")))
        handle = model.layers[0].register_forward_pre_hook(arm)
    if where == "regather":
        handle = _FailRegather(next(b for b in buckets if b.name == "layers.0"))
    before = [b.counters.reduces for b in buckets]
    try:
        loss_fn(model(x), y).backward()
    except Injected:
        pass
    else:
        raise AssertionError(f"no failure was injected {where}")
    finally:
        flaky.fail_at = None
        if handle is not None:
            handle.remove()
    reduced = sum(b.counters.reduces > n for b, n in zip(buckets, before))
    if where != "forward" and not 0 < reduced < len(buckets):
        raise AssertionError(f"backward failed after {reduced} of {len(buckets)} reductions")


class _FailRegather:
    """Makes `bucket`'s gathers raise inside backward until removed."""

    def __init__(self, bucket) -> None:
        self.bucket = bucket
        bucket.gather.gather = self.gather  # an instance attribute shadows the method

    def gather(self, layout=None, new_tensors=False):
        if torch._C._current_graph_task_id() != -1:
            raise Injected("regather failed")
        gather = self.bucket.gather
        return type(gather).gather(gather, layout, new_tensors)

    def remove(self) -> None:
        del self.bucket.gather.gather


def _recover(where: str, steps: int = 3, fail_before: int = 1):
    """Train `steps` steps, with a failed attempt before step `fail_before`; compare
    every step's loss and the final params with the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, reference = _models()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    problems, losses = [], []
    for step in range(steps):
        x, y = batch(step, rank)
        if step == fail_before:
            _fail_once(model, where, x, y)
            problems += [f"after the failure: {p}" for p in _clean_state(model)]
            opt.zero_grad()  # drop the grads the failed backward left
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        dist.all_reduce(loss)
        xs, ys = zip(*(batch(step, r) for r in range(world)))
        ref_loss = loss_fn(reference(torch.cat(xs)), torch.cat(ys))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item() / world, ref_loss.item()))
    problems += _clean_state(model)
    problems += [f"bucket {b.name} holds unsharded storage" for b in get_state(model).buckets
                 if b.gather.unsharded is not None and b.gather.unsharded.allocated_bytes()]
    full, ref = fs.full_state_dict(model), reference.state_dict()
    worst = max(((full[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)).item()
                for k in ref)
    return problems, losses, worst


@pytest.mark.parametrize("where", ["forward", "backward", "regather"])
def test_failed_step_leaves_module_usable_and_in_parity(where):
    for problems, losses, worst in run_world(2, _recover, where):
        assert problems == []
        for got, want in losses:
            assert got == pytest.approx(want, rel=RTOL)
        assert worst < RTOL


# ---- a forward that raises, or runs inside an except block (world size 1, a float64
# cast so a bucket gathers and reshards)


def _cast_models(reshard: str):
    return _models(fs.MixedPrecisionPolicy(param_dtype=torch.float64,
                                           gather_format=RESHARD_PATHS[reshard]))


@pytest.mark.parametrize("reshard", list(RESHARD_PATHS))
def test_forward_inside_an_except_block_trains_and_leaves_a_clean_state(reshard):
    model, _ = _cast_models(reshard)
    x, y = batch(0, 0)
    try:
        raise KeyError("the user is handling some other error")
    except KeyError:
        loss_fn(model(x), y).backward()
    assert _clean_state(model) == []


@pytest.mark.parametrize("reshard", list(RESHARD_PATHS))
def test_forward_raising_in_a_block_leaves_a_usable_module(reshard):
    model, reference = _cast_models(reshard)
    x, y = batch(0, 0)
    model.layers[1].norm2.fail_at = 1
    with pytest.raises(Injected):
        model(x)
    assert _clean_state(model) == []
    loss = loss_fn(model(x), y)
    loss.backward()
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=RTOL)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in reference.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=RTOL, atol=1e-7)
