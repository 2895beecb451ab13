"""benchmarks/meters.py's MemoryMeter counts the storages that hold bytes: a wrapper
subclass (torchao's float8 weight, here torch's TwoTensor) by its inner tensors'
storages, never by its own placeholder, whose size follows its shape, dtype and
storage offset rather than any allocation."""

import torch
from torch.testing._internal.two_tensor import TwoTensor

from benchmarks.meters import MemoryMeter, footprint

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
