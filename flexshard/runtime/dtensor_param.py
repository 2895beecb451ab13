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
from typing import Optional, Sequence

import torch

from ..planning.tensor_parallel import TPSpec


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
