"""A user's own placement checked against the contract at wrap time, on every rank
alike (the same shapes and placements): a piece that does not match its
local_shape would fail on one rank while the others wait in a collective; pieces
that overlap or leave elements out, or a false rank_major(), train silently wrong.

Every check is of shapes, made on the meta device, except for params of at most
SMALL elements: their pieces are taken of an index tensor, which shows which
elements each rank holds. flexshard's own placements are tested, not checked.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..placements.contract import Placement

SMALL = 1 << 16  # elements: an index tensor's pieces are checked up to this size


def check_contract(fqn: str, label: str, placement: Placement, shape: torch.Size,
                   local_shapes: Sequence[torch.Size]) -> None:
    """Raise ValueError naming the param, its bucket and the rule its placement breaks."""
    if type(placement).__module__.startswith("flexshard."):
        return
    where = f"parameter {fqn!r} in bucket {label!r}: {placement!r}"
    numel, world = math.prod(shape), len(local_shapes)
    held = sum(math.prod(s) for s in local_shapes)
    if held != numel:
        raise ValueError(f"{where}: local_shape() gives the {world} ranks {held} elements of a "
                         f"{tuple(shape)} tensor of {numel}; each element must lie in exactly "
                         "one rank's piece")
    full = torch.empty(shape, device="meta")
    start = 0
    for rank, want in enumerate(local_shapes):
        try:
            piece = placement.shard(full, rank, world)
        except Exception:  # a shard() that needs data: the index check below, if small
            continue
        _check_piece(where, piece, want, rank)
        if placement.rank_major(shape) and piece.numel() and piece._base is full and not (
                piece.is_contiguous() and piece.storage_offset() == start):
            raise _not_rank_major(where)
        start += piece.numel()
    if numel <= SMALL:
        _check_elements(where, placement, shape, local_shapes)


def _check_elements(where: str, placement: Placement, shape, local_shapes) -> None:
    numel, world = math.prod(shape), len(local_shapes)
    index = torch.arange(numel).view(shape)
    pieces = [placement.shard(index, rank, world) for rank in range(world)]
    for rank, (piece, want) in enumerate(zip(pieces, local_shapes)):
        _check_piece(where, piece, want, rank)
    flat = torch.cat([p.reshape(-1) for p in pieces])
    if not torch.equal(flat.sort().values, index.reshape(-1)):
        raise ValueError(f"{where}: the ranks' pieces overlap or leave elements out; each "
                         "element must lie in exactly one rank's piece (an element held by "
                         "two ranks gets a gradient on one only)")
    if placement.rank_major(shape) and not torch.equal(flat, index.reshape(-1)):
        raise _not_rank_major(where)
    if not torch.equal(placement.unshard(pieces, shape), index):
        raise ValueError(f"{where}: unshard() of the ranks' pieces does not give the tensor "
                         "back; make unshard() join what shard() cut, in rank order")


def _check_piece(where: str, piece: torch.Tensor, want: torch.Size, rank: int) -> None:
    if tuple(piece.shape) != tuple(want):
        raise ValueError(f"{where}: shard() returned a piece of shape {tuple(piece.shape)} for "
                         f"rank {rank}, but local_shape() says {tuple(want)}; make shard() and "
                         "local_shape() agree")


def _not_rank_major(where: str) -> ValueError:
    return ValueError(f"{where}: rank_major() is True, but the pieces flattened and joined in "
                      "rank order are not the tensor flattened; return False (the bucket then "
                      "copies the gathered pieces into place)")
