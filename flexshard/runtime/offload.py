"""CPU offload of one bucket: its storage buffer and sharded grads in host memory.

An offloaded bucket (`OffloadPolicy`) keeps its storage buffer (the sharded
params) in CPU memory, pinned when the compute device is CUDA, so the sharded
grads AutoGrad delivers and the optimizer state built from them live there too.
The model computes on the compute device. Per step (design.md, "CPU offload"):

- gather: on the copy-in stream, the whole storage buffer is copied to a
  compute-device *staged buffer* (H2D, `non_blocking` from pinned memory),
  which is the gather input when no cast is needed, else the source of the cast;
- reduce: the reduce-scatter runs on the compute device as for any bucket;
  `GradReduce.finish` copies each sharded grad back into a new host tensor (D2H,
  on the reduce stream) and records an event. The compute stream waits on it
  as usual; the *host* waits on it (`host_wait`) only when the grads are first
  read on the host: when the bucket's _Deliver node hands them to autograd
  at the end of backward, or when two forwards' grads are summed.

On a CPU compute device the same path runs with CPU-to-CPU copies (the staged
buffer is a separate tensor), which is what the CPU tests exercise.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..config import OffloadPolicy


class Offload:
    """Where one offloaded bucket's host and compute-device bytes live."""

    def __init__(self, policy: OffloadPolicy, compute_device: torch.device) -> None:
        self.policy = policy
        self.compute_device = torch.device(compute_device)
        self.grads_copied: Any = None  # event after the last D2H copy of sharded grads

    @property
    def pin(self) -> bool:
        """Page-locked host memory: only useful (and only possible) with CUDA."""
        return self.policy.pin_memory and self.compute_device.type == "cuda"

    @property
    def storage_device(self) -> torch.device:
        """Where the storage buffer lives: CPU, or meta while the model is on meta."""
        return self.compute_device if self.compute_device.type == "meta" else torch.device("cpu")

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor (pinned where it helps)."""
        return torch.empty(shape, dtype=dtype, device=self.storage_device, pin_memory=self.pin)

    def to_host(self, buffer: torch.Tensor) -> torch.Tensor:
        """`buffer` in host memory, pinned where it helps (the same tensor when it already is)."""
        if buffer.device != self.storage_device:
            host = self.host_empty(buffer.shape, buffer.dtype)
            return host if buffer.is_meta else host.copy_(buffer)
        if self.pin and not buffer.is_pinned():
            return buffer.pin_memory()
        return buffer

    def move(self, fn: Callable, buffer: torch.Tensor) -> torch.Tensor:
        """nn.Module._apply's `fn` (to_empty, .to, .cuda) moves the compute
        device; the storage stays in host memory (allocated there when it was
        on meta, pinned when the new compute device is CUDA)."""
        probe = torch.empty(0, dtype=torch.uint8, device=self.compute_device)
        self.compute_device = fn(probe).device
        if buffer.is_meta and self.compute_device.type != "meta":
            return self.host_empty(buffer.shape, buffer.dtype)  # to_empty: uninitialised
        return self.to_host(buffer)

    def stage(self, buffer: torch.Tensor, into: torch.Tensor = None) -> torch.Tensor:
        """Copy the host storage `buffer` to the compute device (H2D), into
        `into` or a new tensor made on the current (copy-in) stream."""
        if into is None:
            into = torch.empty(buffer.shape, dtype=buffer.dtype, device=self.compute_device)
        return into.copy_(buffer, non_blocking=True)  # async only from pinned memory
