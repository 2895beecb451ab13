"""Memory bounds: unsharded storage lives no longer than it must (reshard after
forward, prefetch window, evaluation, several forwards), and 50 steps leave
nothing behind. Live bytes are tracked on CPU with weak references."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import make_model
from training_helpers import UnshardedTracker, check_against_reference, settled, train


def _in_flight(model) -> list:
    from flexshard.runtime.state import get_state

    return [b.name for b in get_state(model).buckets if b.gather.inflight is not None]


def forward_window(depth: int) -> dict:
    """Rank body: after each block's forward, which buckets hold unsharded storage
    and which gathers are in flight (3rd step: orders recorded, prefetch active)."""
    model = fs.flex_shard(make_model(layers=3))
    model.set_prefetch_depth(depth)
    train(model, 2)
    tracker = UnshardedTracker(model)
    seen = {}
    live = lambda: sorted(tracker.live_bytes())  # noqa: E731
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(i, (settled(live, ["root"]), _in_flight(model))))
    x, y = batch(2, torch.distributed.get_rank())
    loss = loss_fn(model(x), y)
    after_forward = settled(live, ["root"])
    loss.backward()
    return {"blocks": seen, "after_forward": after_forward,
            "after_backward": settled(live, []), "in_flight_after": _in_flight(model)}


def test_reshard_after_forward_bounds_unsharded_storage():
    for depth in (1, 2):
        for facts in run_world(2, forward_window, depth):
            for i, (live, flying) in facts["blocks"].items():
                # Block i's own params are gone once its forward returns; only the
                # root's (kept for backward) remain, plus the next `depth` gathers.
                assert live == ["root"], (i, live)
                assert flying == [f"layers.{j}" for j in range(i + 1, min(i + 1 + depth, 3))]
            assert facts["after_forward"] == ["root"]
            assert facts["after_backward"] == [] and facts["in_flight_after"] == []


def eval_and_multi_forward() -> dict:
    """Rank body: evaluation under no_grad, then two forwards before one backward."""
    model = fs.flex_shard(make_model())
    tracker = UnshardedTracker(model)
    rank = torch.distributed.get_rank()
    live = lambda: sorted(tracker.live_bytes())  # noqa: E731
    with torch.no_grad():
        model(batch(0, rank)[0])
    after_eval = settled(live, [])
    loss = sum(loss_fn(model(x), y) for x, y in (batch(1, rank), batch(2, rank)))
    after_two = settled(live, ["root"])
    loss.backward()
    return {"eval": after_eval, "two": after_two, "end": settled(live, []),
            "params_sharded": _modules_hold_sharded_params(model)}


def _modules_hold_sharded_params(model) -> bool:
    from flexshard.runtime.state import get_state

    sharded = {id(p) for b in get_state(model).buckets for p in b.params}
    return {id(p) for p in model.parameters()} == sharded


def test_eval_and_several_forwards_free_their_storage():
    for facts in run_world(2, eval_and_multi_forward):
        assert facts["eval"] == [], "evaluation reshards every bucket, the root's too"
        assert facts["two"] == ["root"]  # one root copy per forward, kept for backward
        assert facts["end"] == [] and facts["params_sharded"]


def two_forwards_training() -> tuple:
    model = fs.flex_shard(make_model())

    def step(model, i, x, y):
        half = x.shape[0] // 2
        with torch.no_grad():  # an evaluation pass in the middle changes nothing
            model(x)
        loss = (loss_fn(model(x[:half]), y[:half]) + loss_fn(model(x[half:]), y[half:])) / 2
        loss.backward()
        return loss

    return train(model, 3, step), fs.full_state_dict(model)


def reference_two_forwards(model, i, x, y):
    """Each rank's two half-batches, averaged over the ranks."""
    per_rank = x.shape[0] // 2
    losses = []
    for r in range(2):
        px, py = x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]
        half = per_rank // 2
        losses.append((loss_fn(model(px[:half]), py[:half]) + loss_fn(model(px[half:]), py[half:])) / 2)
    loss = sum(losses) / 2
    loss.backward()
    return loss


def test_several_forwards_before_backward_parity():
    losses, full = run_world(2, two_forwards_training)[0]
    check_against_reference(losses, full, 2, 3, model=make_model(), step_fn=reference_two_forwards)


class Allocations(TorchDispatchMode):
    """Weak references to the storage of every tensor an op creates (outputs
    that are not an input's storage: in-place ops and views allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict = {}  # data_ptr -> (weakref to storage, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                s = t.untyped_storage()
                made = self.made.get(s.data_ptr())
                # A new storage at the address of a dead one replaces it.
                if s.data_ptr() not in inputs and (made is None or made[0]() is None):
                    self.made[s.data_ptr()] = (weakref.ref(s), s.nbytes())
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.made.values() if ref() is not None)


def fifty_steps() -> tuple:
    """Rank body: bytes created during each step that are still alive after it,
    and what the runtime's bookkeeping holds at the end."""
    from flexshard.runtime.state import get_state

    model = fs.flex_shard(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, left = torch.distributed.get_rank(), []
    for step in range(50):
        x, y = batch(step, rank)
        with Allocations() as allocations:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        left.append(settled(allocations.live_bytes, 0) if step else allocations.live_bytes())
    state = get_state(model)
    queue = state.buckets[0].reduce_queue
    book = (len(queue), len(state.prefetcher._launched), len(state.prefetcher.forward.buckets),
            len(state.prefetcher.backward.buckets))
    return left, book


def test_fifty_steps_do_not_grow():
    for left, book in run_world(2, fifty_steps):
        # Step 0 creates AdamW's state; later steps keep nothing they allocate.
        assert left[0] > 0
        assert left[1:] == [0] * 49
        # No reduction or prefetch outstanding; orders of 3 (forward) and 2 buckets.
        assert book == (0, 0, 3, 2)
