"""The model-wide owner pass: which rank owns each `Owned()` tensor, chosen over
every bucket of the model at once so that no rank carries much more than the mean.

`Owned()` binds bucket by bucket (largest first onto the rank holding the fewest
bytes so far), and a choice made one bucket at a time cannot see the buckets
after it: a root bucket whose two largest tensors land on ranks the blocks left
even makes those two the heavy ones for the whole run (params, grads and
optimizer state all follow the owner). The pass tries two assignments and keeps
the better (lower heaviest rank, then fewer gathered bytes):

- the bound one, as `bind` left it;
- a bucket-local one: each bucket's free tensors split largest first within the
  bucket alone (its gather segment as small as that greedy finds), then each
  bucket's per-rank sets dealt to ranks, the most uneven bucket first, its
  largest set onto the lightest rank so far.

Both then go through swaps: within one bucket, the free tensors of two ranks
trade places when that makes the two ranks' loads closer without growing the
bucket's segment (the bytes one rank sends and every gather output holds). Every
swap lowers the sum of squared loads, so the swaps end. Tensors the user pinned
(`Owned(rank=k)`) and every other placement stay where they are.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..placements.owned import Owned
from .layout import SlotPlan, piece_bytes


class _Bucket(NamedTuple):
    """A bucket's free tensors' bytes and the bytes of everything else, per rank."""

    sizes: tuple  # bytes of each free Owned tensor (its piece, alignment included)
    fixed: torch.Tensor  # [rank] bytes of the bucket's other pieces


def balance_owners(buckets: Sequence[Sequence[SlotPlan]], free: Sequence[Sequence[bool]],
                   world_size: int) -> list:
    """`buckets` (bound SlotPlans, one shard group size) with the owners of
    their `free` slots (an `Owned()` flex_shard bound) chosen as above.
    Deterministic: every rank computes the same result."""
    if world_size < 2 or not any(any(f) for f in free):
        return [list(b) for b in buckets]
    parts = [_bucket(slots, flags, world_size) for slots, flags in zip(buckets, free)]
    bound = [[s.placement.rank for s, f in zip(slots, flags) if f]
             for slots, flags in zip(buckets, free)]
    best = min((_swapped(parts, owners, world_size)
                for owners in (bound, _dealt(parts, bound, world_size))),
               key=lambda owners: _score(parts, owners))
    return [_rebound(slots, flags, owners, world_size)
            for slots, flags, owners in zip(buckets, free, best)]


def _bucket(slots, flags, world_size: int) -> _Bucket:
    fixed = torch.zeros(world_size, dtype=torch.int64)
    sizes = []
    for slot, is_free in zip(slots, flags):
        if is_free:
            sizes.append(piece_bytes(slot, slot.placement.rank))
        else:
            fixed += torch.tensor([piece_bytes(slot, r) for r in range(world_size)])
    return _Bucket(tuple(sizes), fixed)


def _per_rank(part: _Bucket, owners: Sequence[int]) -> torch.Tensor:
    """The bucket's bytes per rank with its free tensors on `owners`."""
    out = part.fixed.clone()
    for size, rank in zip(part.sizes, owners):
        out[rank] += size
    return out


def _score(parts, owners) -> tuple:
    """(heaviest rank's bytes, sum of the buckets' segments): lower is better."""
    per_rank = [_per_rank(p, o) for p, o in zip(parts, owners)]
    load = torch.stack(per_rank).sum(dim=0)
    return int(load.max()), sum(int(b.max()) for b in per_rank)


def _dealt(parts, bound, world_size: int) -> list:
    """The bucket-local assignment: each bucket split largest first on its own
    (or as bound, where that split's segment would be larger), then its
    per-rank sets dealt out over the model (largest set to the lightest rank),
    the most uneven buckets first. A bucket whose other pieces differ between
    ranks keeps its split where it is (moving it could grow its segment)."""
    owners = [_smaller_segment(p, o, _split(p, world_size)) for p, o in zip(parts, bound)]
    load = torch.zeros(world_size, dtype=torch.int64)
    movable = []
    for i, p in enumerate(parts):
        if bool((p.fixed == p.fixed[0]).all()):
            movable.append(i)
        else:
            load += _per_rank(p, owners[i])
    spread = {i: _per_rank(parts[i], owners[i]) for i in movable}
    for i in sorted(movable, key=lambda i: (-int(spread[i].max() - spread[i].min()), i)):
        sets = sorted(range(world_size), key=lambda r: (-int(spread[i][r]), r))
        lightest = sorted(range(world_size), key=lambda r: (int(load[r]), r))
        move = dict(zip(sets, lightest))
        owners[i] = [move[r] for r in owners[i]]
        load += _per_rank(parts[i], owners[i])
    return owners


def _smaller_segment(part: _Bucket, bound: list, split: list) -> list:
    """`split` unless its heaviest rank holds more of the bucket than `bound`'s."""
    return split if _per_rank(part, split).max() <= _per_rank(part, bound).max() else bound


def _split(part: _Bucket, world_size: int) -> list:
    """Largest first onto the rank with the fewest of the bucket's bytes."""
    held = part.fixed.clone()
    owners = [0] * len(part.sizes)
    for k in sorted(range(len(part.sizes)), key=lambda k: (-part.sizes[k], k)):
        rank = int(torch.argmin(held))  # the first lightest
        owners[k] = rank
        held[rank] += part.sizes[k]
    return owners


def _swapped(parts, owners, world_size: int) -> list:
    """`owners` after swaps of two ranks' free tensors within a bucket, best
    first, while one lowers the sum of squared loads without growing a segment."""
    owners = [list(o) for o in owners]
    free = torch.stack([_per_rank(_Bucket(p.sizes, torch.zeros_like(p.fixed)), o)
                        for p, o in zip(parts, owners)])  # [bucket, rank]
    fixed = torch.stack([p.fixed for p in parts])
    segment = (free + fixed).max(dim=1).values
    load = (free + fixed).sum(dim=0)
    # Each swap strictly improves, so the swaps end; the bound caps the wrap-time cost
    # (Llama-3 8B over 8 ranks, 33 buckets: 35 swaps over both starting points).
    for _ in range(2 * (world_size + len(parts))):
        best = _best_swap(free, fixed, segment, load)
        if best is None:
            break
        b, r, s = best
        moved = free[b, r] - free[b, s]
        free[b, [r, s]] = free[b, [s, r]]
        load[r] -= moved
        load[s] += moved
        owners[b] = [s if o == r else r if o == s else o for o in owners[b]]
    return owners


def _best_swap(free: torch.Tensor, fixed: torch.Tensor, segment: torch.Tensor,
               load: torch.Tensor):
    """(bucket, heavier rank, lighter rank) of the swap that lowers the sum of
    squared loads the most, or None. The heavier rank is one of the _ROWS
    heaviest (every rank in worlds up to that size), the lighter any rank
    (ties: the lowest bucket, then ranks)."""
    rows = torch.argsort(load, descending=True, stable=True)[:_ROWS]  # [k]
    gap = load[rows, None] - load[None, :]  # [k, s]
    shed = free[:, rows]  # [bucket, k]
    moved = shed[:, :, None] - free[:, None, :]  # [bucket, k, s]: bytes the heavier one sheds
    grows = torch.maximum(fixed[:, rows, None] + free[:, None, :],
                          fixed[:, None, :] + shed[:, :, None]) > segment[:, None, None]
    ok = (moved > 0) & (moved < gap[None]) & ~grows
    if not bool(ok.any()):
        return None
    gain = torch.where(ok, moved * (gap[None] - moved), -1)  # half the drop in sum of squares
    b, rest = divmod(int(torch.argmax(gain)), gain.shape[1] * gain.shape[2])  # the first best
    k, s = divmod(rest, gain.shape[2])
    return b, int(rows[k]), s


# Heavier ranks a swap search considers per step: all of them up to this world
# size; beyond it the search stays O(buckets x ranks) per swap.
_ROWS = 16


def _rebound(slots, flags, owners, world_size: int) -> list:
    """The bucket's slots with its free ones on `owners` (unchanged ones kept)."""
    it = iter(owners)
    return [_rebind(slot, next(it), world_size) if is_free else slot
            for slot, is_free in zip(slots, flags)]


def _rebind(slot: SlotPlan, rank: int, world_size: int) -> SlotPlan:
    if slot.placement.rank == rank:
        return slot
    placement = Owned(rank)
    return slot._replace(placement=placement, local_shapes=tuple(
        placement.local_shape(slot.shape, r, world_size) for r in range(world_size)))
