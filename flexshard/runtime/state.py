"""The one state object flex_shard attaches to the wrapped module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
import torch.nn as nn

from .comm import Comm

_ATTR = "_flexshard_state"


@dataclass
class FlexShardState:
    """Everything flexshard keeps for one wrapped model."""

    mesh: Any  # DeviceMesh, or None at world size 1 without a process group
    group: Any  # the shard group (mesh dim 1 under HSDP): gathers, reduce-scatters, norms
    rank: int  # in the shard group
    world_size: int  # of the shard group
    comm: Comm
    buckets: list = field(default_factory=list)  # Bucket, in BucketSpec order
    hooks: list = field(default_factory=list)  # ModuleHooks, one per running module
    prefetcher: Any = None  # Prefetcher: execution orders and gathers launched ahead
    root_hooks: Any = None  # RootHooks: where the wrapped module's forward starts and ends
    state_dict_hooks: Any = None  # checkpoint: StateDictHooks, its OptimizerHooks
    replicate_group: Any = None  # HSDP's mesh dim 0; None for a 1-D mesh or one replica
    replicate_size: int = 1
    mesh_group: Any = None  # every rank of the mesh: plan check, checkpoint files
    mesh_rank: int = 0
    mesh_size: int = 1
    # Checkpoint files and their barriers: the mesh group, or under tensor
    # parallelism every rank of the (dp, tp) mesh (None: the mesh group).
    files_group: Any = None
    files_rank: int = 0
    groups: Any = None  # mesh.MeshGroups of flex_shard's mesh (the fields above, as one record)
    bucket_meshes: dict = field(default_factory=dict)  # id(mesh) -> (mesh, MeshGroups): buckets'
    #                                                   own meshes (BucketSpec.mesh)
    subgroups: dict = field(default_factory=dict)  # id(shard group) -> mesh.Subgroups
    whole_step: bool = False  # fs.compile ran: the graph gathers and reduces (no hooks)
    unset_buffers: Any = None  # checkpoint.unset_buffers.UnsetBuffers: to_empty()'s, until written
    registration: Any = None  # registration.RegistrationGuard: params set after wrapping raise
    async_saves: Any = None  # checkpoint.async_save.AsyncSaves: the save in flight, its group


def files_group(state: FlexShardState) -> tuple:
    """(group, this rank in it, its size) that checkpoint files are written by."""
    if state.files_group is None:
        return state.mesh_group, state.mesh_rank, state.mesh_size
    return state.files_group, state.files_rank, dist.get_world_size(state.files_group)


def attach_state(module: nn.Module, state: FlexShardState) -> None:
    module.__dict__[_ATTR] = state


def find_state(module: nn.Module) -> Optional[FlexShardState]:
    return module.__dict__.get(_ATTR)


def get_state(module: nn.Module) -> FlexShardState:
    """The module's FlexShardState; TypeError if flex_shard was never applied."""
    state = find_state(module)
    if state is None and isinstance(module._modules.get("_orig_mod"), nn.Module):
        return get_state(module._orig_mod)  # torch.compile(model)'s OptimizedModule
    if state is None:
        raise TypeError(
            f"{type(module).__name__} is not wrapped by flex_shard; call "
            "fs.flex_shard(module) first")
    return state
