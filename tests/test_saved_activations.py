"""Reshard after forward keeps exactly the activations the unwrapped model keeps:
autograd saves the same bytes with and without flexshard (apart from the root
bucket's unsharded params, which it keeps for backward), each block's forward
runs once per step, no TorchDispatchMode of ours sees the block's ops, and a
regathered bucket is let go as soon as its reduce-scatter is launched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from flexshard.compat import get_dispatch_stack_at, len_torch_dispatch_stack
from flexshard.runtime.state import get_state
from harness import run_world
from models import batch, loss_fn
from reference import make_model
from test_memory import Allocations
from training_helpers import RESHARD_PATHS, UnshardedTracker, settled

CONFIGS = [(placement, dtype) for placement in ("shard", "ragged", "owned")
           for dtype in (None, torch.bfloat16)]
PLACEMENTS = {"shard": fs.Shard(0), "ragged": fs.RaggedShard(), "owned": fs.Owned()}


def _live_after_forward(model, x, want=None, exclude=lambda made: 0) -> tuple:
    """(bytes of the storages the forward allocated that are alive after it,
    less `exclude(those allocations)`, the output). The comm backend lets go of a finished
    gather's buffers a moment after wait() returns: given `want`, read until
    it equals `want` or a few seconds have passed. Without one (the unwrapped
    model, no collectives) nothing is let go late: read once, not for the
    whole wait."""
    with Allocations() as made:
        out = model(x)
    live = lambda: made.live_bytes() - exclude(made)  # noqa: E731
    return (live() if want is None else settled(live, want)), out


def saved_bytes(placement: str, dtype, reshard: bool) -> tuple:
    """Rank body: bytes alive after forward, unwrapped and wrapped (less the
    buckets' unsharded params), and which buckets' unsharded params are alive."""
    reference = make_model(layers=3)
    model = fs.flex_shard(copy.deepcopy(reference), placement=PLACEMENTS[placement],
                          reshard_after_forward=reshard,
                          mp_policy=fs.MixedPrecisionPolicy(param_dtype=dtype))
    if dtype is not None:
        reference = reference.to(dtype)
    x, _ = batch(0, dist.get_rank())
    for _ in range(2):  # step 2 runs with the prefetcher following recorded orders
        loss_fn(model(x), x).backward()
    tracker = UnshardedTracker(model)
    want, ref_out = _live_after_forward(reference, x)
    got, out = _live_after_forward(model, x, want, tracker.live_bytes_among)
    alive = sorted(tracker.live_bytes())
    del ref_out, out
    return want, got, alive


@pytest.mark.parametrize("placement,dtype", CONFIGS)
def test_saved_bytes_equal_unwrapped(placement, dtype):
    for want, got, alive in run_world(2, saved_bytes, placement, dtype, True):
        assert want > 0
        assert got == want, f"flexshard keeps {got - want:+d} bytes beyond the unwrapped model"
        assert alive == ["root"]  # the blocks' unsharded params died after their forward


def test_saved_bytes_equal_unwrapped_without_reshard():
    for want, got, alive in run_world(2, saved_bytes, "shard", None, False):
        assert got == want
        assert alive == ["layers.0", "layers.1", "layers.2", "root"]


def _dispatch_modes() -> list:
    return [get_dispatch_stack_at(i) for i in range(len_torch_dispatch_stack())]


def forward_calls_and_modes() -> dict:
    """Rank body: per block, forward calls in one step and the dispatch modes
    active while its forward and its backward run."""
    model = fs.flex_shard(make_model(layers=3))
    calls, modes = {}, []
    probe = lambda *_: modes.append(str(_dispatch_modes()))  # noqa: E731
    for i, layer in enumerate(model.layers):
        def pre(module, args, i=i):
            calls[i] = calls.get(i, 0) + 1
            probe()

        def post(module, args, out):
            out.register_hook(probe)  # runs in backward, when the block's output grad is known
        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
        layer.up.register_forward_pre_hook(probe)  # inside the block's forward
        layer.up.register_full_backward_hook(probe)  # inside the block's backward
    x, y = batch(0, dist.get_rank())
    for _ in range(2):
        calls.clear()
        loss_fn(model(x), y).backward()
    return {"calls": calls, "modes": modes}


def test_block_forward_runs_once_per_step_under_no_dispatch_mode():
    for facts in run_world(2, forward_calls_and_modes):
        assert facts["calls"] == {0: 1, 1: 1, 2: 1}
        assert facts["modes"] == ["[]"] * (2 * 3 * 4)  # 2 steps, 3 blocks, 4 probes


def _regathered(bucket) -> bool:
    """Whether a resharding bucket holds params refilled for backward: its params
    made once, filled."""
    unsharded = bucket.gather.unsharded
    return bool(bucket.gather.reshard_after_forward) and unsharded is not None and unsharded.filled


def backward_window(reshard: str) -> dict:
    """Rank body: which buckets hold regathered params when each block's
    backward is done (its input's grad is known)."""
    model = fs.flex_shard(make_model(layers=3), mp_policy=fs.MixedPrecisionPolicy(
        gather_format=RESHARD_PATHS[reshard]))
    buckets = get_state(model).buckets
    seen = {}
    for i, layer in enumerate(model.layers):
        def pre(module, args, i=i):
            args[0].register_hook(lambda g: seen.__setitem__(
                i, [b.name for b in buckets if _regathered(b)]))
        layer.register_forward_pre_hook(pre)
    x, y = batch(0, dist.get_rank())
    for _ in range(2):
        loss_fn(model(x), y).backward()
    after = [b.name for b in buckets if _regathered(b)]
    return {"seen": seen, "after": after, "gathers": [b.counters.gathers for b in buckets]}


# When block i's input grad is known, the params made once of block i-1 are already
# refilled (by a hook on block i-1's output, which is block i's input), by either way.
REGATHERED = {"in place": {2: ["layers.1"], 1: ["layers.0"], 0: []},
              "refilled by decode": {2: ["layers.1"], 1: ["layers.0"], 0: []}}


@pytest.mark.parametrize("reshard", list(RESHARD_PATHS))
def test_regathered_params_go_when_the_reduce_is_launched(reshard):
    for facts in run_world(2, backward_window, reshard):
        # Once block i's backward is done, its reduce-scatter is launched and the
        # bucket holds nothing.
        assert facts["seen"] == REGATHERED[reshard]
        assert facts["after"] == []
        assert facts["gathers"] == [4, 4, 4, 2]  # 2 steps: forward + one regather each


@pytest.mark.parametrize("reshard", list(RESHARD_PATHS))
def test_changing_shards_between_forward_and_backward_raises(reshard):
    model = _cast_model(reshard)
    x, y = batch(0, 0)
    loss = loss_fn(model(x), y)
    with torch.no_grad():
        model.layers[1].up.weight.mul_(2)  # as an optimizer step would
    with pytest.raises(RuntimeError, match=r"bucket 'layers.1': its sharded params changed "
                                           r"between forward and backward"):
        loss.backward()


def _cast_model(reshard: str):
    return fs.flex_shard(make_model(), mp_policy=fs.MixedPrecisionPolicy(
        param_dtype=torch.float64, gather_format=RESHARD_PATHS[reshard]))


@pytest.mark.parametrize("reshard", list(RESHARD_PATHS))
def test_in_place_change_of_a_saved_activation_raises_as_autograd_does(reshard):
    model = _cast_model(reshard)
    seen = []
    model.layers[0].up.register_forward_hook(lambda m, a, out: seen.append(out))
    x, y = batch(0, 0)
    loss = loss_fn(model(x), y)
    with torch.no_grad():
        seen[0].mul_(2)  # gelu saved its input, the up projection's output
    # autograd's own message
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch."
                                           r"DoubleTensor \[4, 11, 50\]\](, which is output 0 "
                                           r"of \w+,)? is at version 1"):
        loss.backward()


@pytest.mark.parametrize("reshard", list(RESHARD_PATHS))
def test_forward_without_backward_frees_its_graph(reshard):
    import gc
    import weakref

    model = _cast_model(reshard)
    refs = []
    # q, k and v are views of it; attention saves them and its own output
    model.layers[1].qkv.register_forward_hook(
        lambda m, a, out: refs.append(weakref.ref(out.untyped_storage())))
    x, _ = batch(0, 0)
    out = model(x)
    assert refs[0]() is not None
    del out
    gc.collect()
    assert refs[0]() is None, "a saved activation outlived its dropped graph"
