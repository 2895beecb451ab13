"""Reshard-after-forward: unsharded storage is freed after forward and backward
recomputes only the gather, never the block's other ops."""

from __future__ import annotations

import gc
import weakref

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import make_model

_COMPUTE = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
            "native_layer_norm", "gelu"}


class OpCounter(TorchDispatchMode):
    """Counts forward compute ops (matmuls, attention, norms) that reach the kernels."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _COMPUTE:
            self.count += 1
        return func(*args, **(kwargs or {}))


def record_unsharded(model) -> list:
    """Weak references to every unsharded param any bucket of `model` gathers."""
    from flexshard.runtime.state import get_state

    refs = []
    for bucket in get_state(model).buckets:
        def gather(layout=None, new_tensors=False, _orig=bucket.gather.gather):
            outs = _orig(layout, new_tensors)
            refs.append([weakref.ref(t) for t in outs])
            return outs
        bucket.gather.gather = gather  # an instance attribute shadows the method
    return refs


def holds_memory(refs) -> bool:
    """Whether one of the gathered params still holds its storage: alive, and not
    freed by a resize (the params a bucket makes once live on over freed storage)."""
    tensors = [r() for r in refs]
    return any(t is not None and t.untyped_storage().nbytes() > 0 for t in tensors)


def backward_compute_ops(reshard: bool) -> int:
    """Rank body: compute ops that run during backward."""
    import torch.distributed as dist

    model = fs.flex_shard(make_model(), reshard_after_forward=reshard)
    x, y = batch(0, dist.get_rank())
    loss = loss_fn(model(x), y)
    with OpCounter() as counter:
        loss.backward()
    return counter.count


def test_backward_recomputes_only_the_gather():
    with_reshard = run_world(2, backward_compute_ops, True)
    without = run_world(2, backward_compute_ops, False)
    assert with_reshard == without
    assert with_reshard[0] > 0


def alive_gathers_after_forward(reshard: bool) -> list:
    """Rank body: buckets whose unsharded params are alive between forward and backward."""
    import torch.distributed as dist

    model = fs.flex_shard(make_model(), reshard_after_forward=reshard)
    refs = record_unsharded(model)
    x, y = batch(0, dist.get_rank())
    loss = loss_fn(model(x), y)
    gc.collect()
    gathered = len(refs)
    alive = sum(holds_memory(bucket) for bucket in refs)
    loss.backward()
    del loss
    gc.collect()
    return [alive, gathered, sum(holds_memory(b) for b in refs)]


@pytest.mark.parametrize("world", [2, 3])
def test_unsharded_storage_freed_after_forward(world):
    for alive, gathered, after_backward in run_world(world, alive_gathers_after_forward, True):
        assert gathered == 3  # 2 blocks + root in forward
        assert alive == 1, "only the root bucket (no reshard) keeps unsharded params"
        assert after_backward == 0


def test_without_reshard_storage_lives_until_backward():
    for alive, gathered, after_backward in run_world(2, alive_gathers_after_forward, False):
        assert (alive, gathered, after_backward) == (3, 3, 0)
