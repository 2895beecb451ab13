"""benchmarks/harness/meters.py's MemoryMeter counts the storages that hold bytes: a wrapper
subclass (torchao's float8 weight, here torch's TwoTensor) by its inner tensors'
storages, never by its own placeholder, whose size follows its shape, dtype and
storage offset rather than any allocation."""

import torch
from torch.testing._internal.two_tensor import TwoTensor

from benchmarks.harness.meters import MemoryMeter, footprint

N = 1024


def test_a_wrapper_subclass_counts_its_inner_storages():
    a_base, b_base = torch.zeros(1 << 18), torch.zeros(1 << 19)  # 1 MiB and 2 MiB
    offset = (1 << 18) - N  # both inner tensors at this offset: the placeholder's 1 MiB
    t = TwoTensor(a_base[offset:], b_base[offset:offset + N])
    meter = MemoryMeter()
    meter.register([t], "param")
    inner = footprint(a_base.untyped_storage()) + footprint(b_base.untyped_storage())
    assert meter.live == inner == 3 << 20
    with meter:
        doubled = t * 2  # a new TwoTensor: two new inner storages of N floats
    assert type(doubled) is TwoTensor
    assert meter.live == inner + footprint(doubled.a.untyped_storage()) \
        + footprint(doubled.b.untyped_storage())


def test_coalesced_collectives_count_as_collectives_not_copies():
    """The engine's gather groups launch c10d's coalesced ops: both meters count them as
    collectives (with their bytes), never as copies."""
    import torch.distributed as dist

    from benchmarks.harness.fake_world import fake_world
    from benchmarks.harness.op_counter import COPY_OPS, OpCounter
    from benchmarks.harness.meters import TrafficMeter, is_collective
    from flexshard.compat import all_gather_single, coalescing_manager, reduce_scatter_single

    names = ("c10d::allgather_into_tensor_coalesced_", "c10d::reduce_scatter_tensor_coalesced_")
    assert all(is_collective(n) and n not in COPY_OPS for n in names)
    if dist.is_initialized():  # fake_world needs the default group
        return
    with fake_world(4):
        ins, outs = [torch.ones(8), torch.ones(16)], [torch.empty(32), torch.empty(64)]
        with OpCounter() as counter, TrafficMeter() as traffic:
            with coalescing_manager(None):
                for o, i in zip(outs, ins):
                    all_gather_single(o, i)
            with coalescing_manager(None):
                for o, i in zip(ins, outs):
                    reduce_scatter_single(o, i)
    assert {n: counter.ops[n] for n in names} == dict.fromkeys(names, 1)
    assert not counter.copy_bytes and not traffic.copies
    kinds = {n.split("::")[1].strip("_") for n in names}
    assert set(traffic.collectives) == kinds
    assert traffic.collective_bytes["allgather_into_tensor_coalesced"] == 4 * (32 + 64)
