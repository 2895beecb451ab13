"""Optimizers over sharded parameters: whole matrices for Muon, shards for the rest.

Muon orthogonalizes each weight matrix as a whole, so it cannot run on a row
shard without collectives. Put the matrices in Owned buckets: each rank then
holds some matrices whole (their sharded param IS the full matrix, its sharded
grad the full mean grad) and runs Muon on those alone, with no collective in
the optimizer step; every other parameter is an ordinary shard for AdamW.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn as nn

from .runtime.state import get_state

MatrixFilter = Callable[[str, torch.Size], bool]


class MuonSplit(NamedTuple):
    """This rank's trainable sharded params, split by optimizer kind."""

    matrices: list  # the picked matrices: whole on the rank that holds each, else empty
    others: list  # every other param's shard: for an elementwise optimizer (AdamW)


def _is_2d(fqn: str, shape: torch.Size) -> bool:
    return len(shape) == 2


def split_for_muon(module: nn.Module, is_matrix: Optional[MatrixFilter] = None) -> MuonSplit:
    """Split a flex_shard-ed module's params for Muon + an elementwise optimizer.

    `is_matrix(fqn, full_shape)` picks the params Muon updates (default: every
    2-D param). Each picked param must be whole on one rank (fs.Owned()).
    Both lists hold the same params on every rank, empty pieces included (Muon
    and AdamW skip them at no cost): code that takes the norm of a list's grads
    (clip_grad_norm_ per optimizer) makes a collective per grad, which must
    line up across ranks.
    """
    pick = is_matrix or _is_2d
    matrices, others = [], []
    for bucket in get_state(module).buckets:
        for slot, param in zip(bucket.slots, bucket.params):
            if not param.requires_grad:
                continue
            if not pick(slot.fqn, slot.shape):
                others.append(param)
                continue
            holders = [r for r, s in enumerate(slot.local_shapes) if s.numel()]
            if len(holders) > 1 or (holders and slot.local_shapes[holders[0]] != slot.shape):
                raise ValueError(
                    f"parameter {slot.fqn!r} in bucket {bucket.name!r} is picked for Muon but "
                    f"{slot.placement} splits it across ranks; Muon needs whole matrices: "
                    "give it placement fs.Owned() (or leave it out with is_matrix)")
            if len(slot.shape) != 2:
                raise ValueError(
                    f"parameter {slot.fqn!r} in bucket {bucket.name!r} has shape "
                    f"{tuple(slot.shape)}; torch.optim.Muon takes 2-D params only, so leave "
                    "it out with is_matrix")
            matrices.append(param)
    return MuonSplit(matrices, others)
