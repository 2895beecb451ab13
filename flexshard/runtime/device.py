"""The device's streams and events, behind one small interface.

A bucket runs its data path on side streams ordered by events (design.md,
"Streams and buffers"): the copy-in (cast) before its all-gather on
`copy_in`, the all-gather on `gather`, gradient packing, the reduce-scatter
and the divide/cast of its output on `reduce`. The compute stream is whatever
stream is current when the bucket is called (a forward may run on any
stream), and it only ever waits on events, never on the whole device.

`HostContext` (CPU, meta) runs everything in program order, so its streams
are names and its events are None; `CudaContext` has real streams. Tests
subclass HostContext to record the ordering; the runtime never asks which
one it has.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch


class HostContext:
    """Program order: every stream is the one CPU thread; record/wait do nothing."""

    copy_in: Any = "copy_in"
    gather: Any = "gather"
    reduce: Any = "reduce"
    # Reduce-scatters left in flight while the next bucket's backward runs. On a
    # host, none: the collective runs on the backend's threads, on the cores the
    # backward computes on, so overlapping it bought 2-7% of wall time, while its
    # input (and gloo's input-sized copy) sat beside the next block's grads and
    # regathered params, above FSDP2's peak (design.md, "Streams and buffers").
    reduces_in_flight: int = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> Any:
        """The compute stream: the one current now."""
        return "compute"

    def on(self, stream: Any):
        """Run the block's ops on `stream`."""
        return nullcontext()

    def record(self, stream: Optional[Any] = None) -> Any:
        """An event marking everything queued so far on `stream` (default: current)."""
        return None

    def wait(self, event: Any, stream: Optional[Any] = None) -> None:
        """Make `stream` (default: current) wait for `event`; never the host."""

    def adopt(self, tensor: torch.Tensor, stream: Any) -> None:
        """`tensor`, allocated while another stream was current, is now used by
        `stream`: keep the allocator from reusing it before `stream` is done."""

    def synchronize(self, event: Any) -> None:
        """Make the host wait for `event` (before it reads what a device copied
        into host memory: CPU offload's sharded grads)."""


class CudaContext(HostContext):
    """One CUDA device: three side streams made once, events per use."""

    reduces_in_flight = 1  # the reduce stream overlaps the next block's backward

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # High priority for the gather side, as its consumer (the next block's
        # forward) waits on it; the reduce side has slack until backward ends.
        self.copy_in = torch.cuda.Stream(device, priority=-1)
        self.gather = torch.cuda.Stream(device, priority=-1)
        self.reduce = torch.cuda.Stream(device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def on(self, stream: Any):
        return torch.cuda.stream(stream)

    def record(self, stream: Optional[Any] = None) -> Any:
        event = torch.cuda.Event()
        event.record(stream if stream is not None else self.current())
        return event

    def wait(self, event: Any, stream: Optional[Any] = None) -> None:
        (stream if stream is not None else self.current()).wait_event(event)

    def adopt(self, tensor: torch.Tensor, stream: Any) -> None:
        # The one deliberate record_stream: a gather launched under one compute
        # stream and consumed under another (design.md, "the one exception").
        tensor.record_stream(stream)

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


class DeviceContexts:
    """One context per device a model's buckets live on, shared by its buckets
    (so they share streams). A bucket moved by to_empty() finds its new one."""

    def __init__(self) -> None:
        self._by_device: dict = {}

    def get(self, device: torch.device) -> HostContext:
        if device not in self._by_device:
            cls = CudaContext if device.type == "cuda" else HostContext
            self._by_device[device] = cls(device)
        return self._by_device[device]

    def set(self, device: torch.device, context: HostContext) -> None:
        """Use `context` for `device` (tests: a recording context)."""
        self._by_device[device] = context


class DeviceSite:
    """Where one bucket computes, looked up at each call (a move changes it): the
    compute device (the storage's, or an offloaded bucket's compute device), its
    context in the model's shared `contexts`, and the storage's device."""

    def __init__(self, storage, offload, contexts: DeviceContexts) -> None:
        self.storage, self.offload, self.contexts = storage, offload, contexts

    @property
    def compute_device(self) -> torch.device:
        return self.storage_device if self.offload is None else self.offload.compute_device

    @property
    def storage_device(self) -> torch.device:
        return self.storage.buffer.device

    @property
    def ctx(self) -> HostContext:
        """Streams and events of the compute device."""
        return self.contexts.get(self.compute_device)


@contextmanager
def on_stream(context: HostContext, stream: Any, after: Any):
    """Run the block on `stream` once it waited for the event `after`."""
    with context.on(stream):
        context.wait(after, stream)
        yield
