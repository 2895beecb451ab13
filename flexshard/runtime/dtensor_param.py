"""DTensor params (tensor parallelism): a bucket slot holds the param's
TP-local tensor; the module computes with a DTensor again.

A model parallelized with `parallelize_module` on the `tp` dim of a (dp, tp)
mesh has DTensor params. flex_shard shards each one's local tensor over dp,
as it shards a plain tensor: the slot's shape is the local shape. `TPSpec`
remembers the rest (mesh, placements, the global shape and where the local
tensor lies in it) so that

- forward installs `DTensor.from_local(unsharded local)`: TP's own modules see
  the DTensor they expect, and autograd hands the local gradient back to the
  bucket (from_local's backward first turns a Partial gradient into the
  param's placements over tp, e.g. the all-reduce of a sequence-parallel norm);
- checkpoints and full state dicts describe the param in the global tensor.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import torch

from ..compat import dtensor_local_offsets


class TPSpec(NamedTuple):
    """How a slot's local tensor sits in its DTensor param."""

    mesh: Any  # the DTensor's DeviceMesh (the tp slice, or the whole (dp, tp) mesh)
    placements: tuple  # the DTensor's placements on `mesh`
    shape: tuple  # the global (TP-unsharded) shape
    stride: tuple  # the global stride
    offset: tuple  # where this rank's local tensor starts in the global tensor, per dim
    local_shape: tuple  # the local tensor's shape (the slot's shape)

    def to_param(self, local: torch.Tensor) -> torch.Tensor:
        """The DTensor over `local` (differentiable: its grad is `local`'s)."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.shape), stride=self.stride)

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local block of a global tensor (a view)."""
        for dim, (start, size) in enumerate(zip(self.offset, self.local_shape)):
            if size != full.shape[dim]:
                full = full.narrow(dim, start, size)
        return full

    def full_of(self, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every TP rank's local tensor (a collective over tp)."""
        return self.to_param(local).full_tensor()

    @property
    def sharded_over_tp(self) -> bool:
        """Whether the local tensors of the TP ranks are different pieces (not replicas)."""
        return tuple(self.shape) != tuple(self.local_shape)


def tp_spec(param) -> TPSpec:
    """The TPSpec of a DTensor param on this rank."""
    return TPSpec(param.device_mesh, tuple(param.placements), tuple(param.shape),
                  tuple(param.stride()), dtensor_local_offsets(param),
                  tuple(param.to_local().shape))


def wrap_unsharded(specs: Optional[Sequence[Optional[TPSpec]]],
                   tensors: Sequence[Optional[torch.Tensor]]) -> list:
    """The tensors a module computes with: DTensors for TP slots."""
    if specs is None:
        return list(tensors)
    return [t if spec is None or t is None else spec.to_param(t)
            for spec, t in zip(specs, tensors)]


def shift_boxes(spec: TPSpec, boxes: tuple) -> tuple:
    """Boxes of the local tensor as boxes of the global tensor."""
    return tuple(box._replace(offsets=tuple(o + s for o, s in zip(box.offsets, spec.offset)))
                 for box in boxes)


def contiguous_stride(shape) -> tuple:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
