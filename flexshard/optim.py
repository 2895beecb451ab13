"""Optimizers over sharded parameters: whole matrices for Muon, shards for the rest.

Muon orthogonalizes each weight matrix as a whole, so it cannot run on a row
shard without collectives. Put the matrices in Owned buckets: each rank then
holds some matrices whole (their sharded param IS the full matrix, its sharded
grad the full mean grad) and runs Muon on those alone, with no collective in
the optimizer step; every other parameter is an ordinary shard for AdamW.
"""

from __future__ import annotations

import math
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
        for slot, param, wiring in zip(bucket.slots, bucket.params, bucket.wiring):
            if not param.requires_grad:
                continue
            if not pick(slot.fqn, slot.shape):
                others.append(param)
                continue
            if wiring.tp is not None and wiring.tp.sharded_over_tp:
                raise ValueError(
                    f"parameter {slot.fqn!r} in bucket {bucket.name!r} is picked for Muon but "
                    "tensor parallelism splits it across ranks (each holds a TP block, whatever "
                    "its flex_shard placement); Muon needs whole matrices: leave it out with "
                    "is_matrix, or keep it out of the TP plan")
            if not whole_on_one_rank(slot):
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


def whole_on_one_rank(slot) -> bool:
    """Whether one rank holds all of the param (Owned, or a world of one)."""
    holders = [shape for shape in slot.local_shapes if math.prod(shape)]
    return len(holders) <= 1 and all(tuple(h) == tuple(slot.shape) for h in holders)


# torch optimizers whose update of a param reads more than each element's own
# state: on a rank's pieces they would step by the piece's statistics
_WHOLE_TENSOR = {
    "Muon": "orthogonalizes each matrix as a whole",
    "Adafactor": "factors each param's second moment by rows and columns and scales its "
                 "step by the param's RMS",
}


def check_optimizer(optimizer: torch.optim.Optimizer, sharded: list) -> None:
    """Refuse, at an optimizer's first step, a torch optimizer that would train
    flex_shard's pieces wrong. `sharded`: (bucket, slot, split over TP) of each
    of the model's params it holds. Every rank knows every slot's split, so
    every rank holding such a param raises."""
    kind = type(optimizer)
    if not sharded or kind.__module__.split(".")[:2] != ["torch", "optim"]:
        return
    if kind.__name__ == "LBFGS":
        split = [(b, s) for b, s, tp in sharded if b.world_size > 1 or tp]
        if split:
            bucket, slot = split[0]
            raise NotImplementedError(
                f"torch.optim.LBFGS flattens every param's grad into one vector and steps by "
                f"its dot products and line search; on flex_shard's params (such as "
                f"{slot.fqn!r} in bucket {bucket.name!r}) each rank sees only its own "
                "pieces, so the ranks would step apart, or hang in a line search. Use an "
                "optimizer that updates each element from its own state (SGD, AdamW), or "
                "run LBFGS on one process")
        return
    why = _WHOLE_TENSOR.get(kind.__name__)
    if why is None:
        return  # elementwise: every piece steps as its part of the whole would
    for bucket, slot, tp in sharded:
        if tp:
            raise ValueError(
                f"torch.optim.{kind.__name__} {why}, but parameter {slot.fqn!r} in bucket "
                f"{bucket.name!r} is split across ranks by tensor parallelism: each rank would "
                "step its TP block as if it were the whole tensor. Leave the TP-split params "
                "out of its param groups (no flex_shard placement makes a TP block whole), or "
                "use an elementwise optimizer (AdamW) for them")
        if not whole_on_one_rank(slot):
            raise ValueError(
                f"torch.optim.{kind.__name__} {why}, but parameter {slot.fqn!r} in bucket "
                f"{bucket.name!r} is split across ranks ({slot.placement}): "
                "each rank would step its piece as if it were the whole tensor. Give the "
                "params it updates placement fs.Owned() (each whole on one rank; "
                "fs.optim.split_for_muon picks Muon's matrices), or use an elementwise "
                "optimizer (AdamW) for them")
        if kind.__name__ == "Adafactor" and not math.prod(slot.local_shapes[bucket.rank]):
            raise ValueError(
                f"torch.optim.Adafactor divides by each param's numel, and parameter "
                f"{slot.fqn!r} in bucket {bucket.name!r} is an empty piece on this rank "
                "(another rank holds it whole): give Adafactor this rank's non-empty pieces "
                "([p for p in params if p.numel()]) and clip with fs.clip_grad_norm_(model, "
                "max_norm), which does not depend on each rank's list")
