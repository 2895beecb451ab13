"""How flex_shard reads a DeviceMesh: which ranks shard, which replicate.

A 1-D mesh shards over all its ranks. A 2-D mesh is HSDP, FSDP2's convention:
dim 0 replicates, dim 1 shards. Every placement works along the shard dim
(Owned owners and RaggedShard units are shard-group ranks); a bucket gathers
and reduce-scatters within its shard group, then all-reduces the reduced
shards across the replicate group.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from ..compat import root_mesh


class MeshGroups(NamedTuple):
    """The process groups and ranks of one mesh, as flex_shard uses them."""

    mesh: Any  # DeviceMesh, or None at world size 1 without a process group
    shard_group: Any  # gathers and reduce-scatters run here (None without a process group)
    shard_rank: int
    shard_size: int
    replicate_group: Any  # None for a 1-D mesh or one replica (R == 1)
    replicate_size: int
    mesh_group: Any  # every rank of the mesh: plan checks, checkpoint barriers
    mesh_rank: int  # this rank's rank in mesh_group
    mesh_size: int

    @property
    def shape(self) -> tuple:
        """(replicas, shard size)."""
        return (self.replicate_size, self.shard_size)


def single_process() -> MeshGroups:
    """World size 1 without a process group."""
    return MeshGroups(None, None, 0, 1, None, 1, None, 0, 1)


def mesh_groups(mesh) -> MeshGroups:
    """The groups of a 1-D or 2-D DeviceMesh (the caller checked ndim)."""
    if mesh.ndim == 1:
        group = mesh.get_group()
        rank, size = mesh.get_local_rank(), mesh.size()
        return MeshGroups(mesh, group, rank, size, None, 1, group, rank, size)
    replicas, shards = mesh.size(0), mesh.size(1)
    shard_rank = mesh.get_local_rank(1)
    replicate_group = mesh.get_group(0) if replicas > 1 else None
    whole = _whole_group(mesh)
    return MeshGroups(mesh, mesh.get_group(1), shard_rank, shards, replicate_group, replicas,
                      whole, dist.get_rank(group=whole), replicas * shards)


def files_group(mesh, tp_meshes) -> tuple:
    """(group, rank in it, size) of the ranks that write one checkpoint of a model
    with DTensor params: the ranks of flex_shard's mesh times those of the params'
    TP meshes, within the mesh all were sliced from. Along that root's other dims
    (pipeline stages, other models of the job) each writes its own, as without TP."""
    grid = root_mesh(mesh).mesh
    where = dict(zip(grid.flatten().tolist(), itertools.product(*map(range, grid.shape))))
    mine = where[dist.get_rank()]
    members = {r for m in (mesh, *tp_meshes) for r in m.mesh.flatten().tolist()}
    varies = {d for r in members for d, c in enumerate(where[r]) if c != mine[d]}
    ranks = grid[tuple(slice(None) if d in varies else c for d, c in enumerate(mine))]
    group = _group_of(sorted(ranks.flatten().tolist()))
    return group, dist.get_rank(group=group), ranks.numel()


def _whole_group(mesh) -> Optional[Any]:
    """A process group of every rank in `mesh` (see _group_of)."""
    return _group_of(sorted(mesh.mesh.flatten().tolist()))


def _group_of(ranks: list) -> Optional[Any]:
    """A process group of `ranks` (sorted): the default group when they are the
    whole world, else a new group (only they take part in making it)."""
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks, use_local_synchronization=True)


class Subgroups:
    """Process groups of some ranks of one shard group, made once each: the
    post-forward groups of an int reshard_after_forward (FSDP2's 'reshard to a
    smaller group'), and under fs.compile the groups across them."""

    def __init__(self, shard_group) -> None:
        # Global ranks in shard-group rank order (what an all-gather orders by).
        self.ranks = tuple(dist.get_process_group_ranks(shard_group)) if shard_group else (0,)
        self._groups: dict = {}

    def of(self, shard_rank: int, size: int):
        """The group of the `size` consecutive shard ranks holding `shard_rank`."""
        first = shard_rank - shard_rank % size
        return self._group(self.ranks[first:first + size])

    def across(self, shard_rank: int, size: int):
        """The group of the shard ranks at `shard_rank`'s place in each group of
        `size` consecutive ones (every `size`-th from `shard_rank % size`)."""
        return self._group(self.ranks[shard_rank % size::size])

    def _group(self, ranks: tuple):
        """Only its members make it (use_local_synchronization), when they first need it."""
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
        return self._groups[ranks]
