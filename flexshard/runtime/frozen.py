"""Which params train, agreed by every rank at each training forward.

Freezing a param after flex_shard is fine when every rank freezes it (its grad is left
out of the reduce). A rank that freezes a param the others train adds zeros to their
averaged gradient, and its pieces never update; one that freezes a whole bucket skips the
bucket's reduce-scatter while the others wait in it. A rule on `p.numel()` does this
quietly: under Owned or an uneven split a rank's piece may be empty. So at each forward
under grad, before its first collective, the ranks compare a checksum of which params
train: host values over a gloo group of the model's ranks (no device sync), made once
per set of ranks. Where they differ every rank raises, naming what it freezes.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import torch
import torch.distributed as dist

_GROUPS: dict = {}  # ranks -> gloo group: one per set of ranks, whatever the models


class FrozenAgreement:
    """The check of one wrapped model (`buckets`, over the ranks of its mesh's `group`)."""

    def __init__(self, buckets: Sequence, group) -> None:
        self.buckets = list(buckets)
        # torch's "fake" backend runs one rank of a world in one process: none to ask
        real = group is not None and dist.get_backend(group) != "fake"
        self.ranks = tuple(sorted(dist.get_process_group_ranks(group))) if real else ()
        self.trains = any(b.grad_slots for b in self.buckets)

    def check(self) -> None:
        if len(self.ranks) < 2 or not self.trains:
            return
        flags = bytes(p.requires_grad for b in self.buckets for p in b.params)
        sig = zlib.crc32(flags)
        both = torch.tensor([sig, -sig], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=_group(self.ranks))
        if both[0] != -both[1]:
            raise ValueError(
                f"the ranks disagree on which parameters train: rank {dist.get_rank()} "
                f"freezes {self._frozen()} (requires_grad_(False) after flex_shard). Every rank "
                "must freeze the same parameters, or the rank that freezes one adds zeros to "
                "the others' averaged gradient. A rule on p.numel() or p.shape sees this "
                "rank's piece, not the parameter: choose by name, p.ndim, or the full shape, "
                "model.state_dict()[name].shape")

    def _frozen(self) -> str:
        """This rank's params frozen since the wrap (a few, then a count)."""
        names = [repr(b.slots[i].fqn) for b in self.buckets for i in b.grad_slots
                 if not b.params[i].requires_grad]
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        return ", ".join(names[:4]) + more if names else "none of the trainable ones"


def _group(ranks: tuple):
    if ranks not in _GROUPS:
        if dist.get_backend() == "gloo" and ranks == tuple(range(dist.get_world_size())):
            _GROUPS[ranks] = dist.group.WORLD
        else:
            _GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo",
                                            use_local_synchronization=True)
    return _GROUPS[ranks]
