"""An int reshard_after_forward N (FSDP2's "reshard to a smaller group"): what a
rank keeps of a bucket's forward gather for backward.

The shard group's S ranks form S/N post-forward groups of N consecutive ranks.
Rank r, index i = r mod N in its group, keeps segments i*S/N .. (i+1)*S/N - 1
of each gather group's block of the gather output; the group's all-gather of
those slices, rank-major per gather group, is the whole gather output again, so
backward's regather stays within N ranks.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from ..compat import tensor_version
from ..planning.layout import BucketLayout


class PostForwardShard(NamedTuple):
    """This rank's 1/N of a forward's gather output, kept for backward."""

    send: torch.Tensor  # its S/N segments of the gather output (gather layout), per group
    group: Any  # the N consecutive shard ranks backward all-gathers within
    version: int  # storage version at forward: a later write makes it stale
    ranks: int  # S/N: how many ranks' segments `send` holds


def keep_slice(gathered: torch.Tensor, layout: BucketLayout, rank: int, n: int, group,
               storage: torch.Tensor) -> PostForwardShard:
    """The slice of `gathered` rank `rank` keeps in its post-forward group of `n`: of
    each gather group's block, the S/N segments of that group's share (one copy)."""
    ranks = layout.world_size // n
    first = (rank % n) * ranks
    parts = [block.view(layout.world_size, -1)[first:first + ranks].reshape(-1)
             for block in layout.group_parts(gathered, layout.world_size)]
    kept = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
    return PostForwardShard(kept, group, tensor_version(storage), ranks)


def usable(shard: Optional[PostForwardShard], storage: torch.Tensor) -> Optional[PostForwardShard]:
    """`shard` while the sharded params are still those it was cut from."""
    if shard is None or shard.version != tensor_version(storage):
        return None
    return shard
