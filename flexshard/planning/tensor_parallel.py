"""DTensor params from tensor parallelism, checked and swapped for their local
tensors before planning; `TPSpec` records where each local tensor sits in its
DTensor.

A bucket slot holds a DTensor param's TP-local tensor, sharded over dp as a
plain tensor is (the slot's shape is the local shape). Forward installs
`DTensor.from_local(unsharded local)` (`TPSpec.to_param`, runtime/bucket.py):
TP's own modules see the DTensor they expect, and autograd hands the local
gradient back to the bucket (from_local's backward first turns a Partial
gradient into the param's placements over tp). Checkpoints and full state
dicts describe the param in the global tensor (checkpoint/state_dict.py).

flex_shard accepts a DTensor param when its mesh and flex_shard's mesh are
slices of one (dp, tp) mesh: each of the DTensor's mesh dims is either one of
flex_shard's dims, on which it must be Replicate(), or crosses flex_shard's
mesh at this rank only (checked on the ranks, as equal DeviceMeshes are
interchangeable in torch's caches): TP on mesh["tp"], flex_shard on mesh["dp"].
Every check runs on every rank before any collective.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

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


class LocalParams(NamedTuple):
    """The module's params with every DTensor replaced by its local tensor."""

    named: dict  # FQN -> plain tensor (the registered nn.Parameter)
    specs: dict  # FQN -> TPSpec, for the params that were DTensors
    restore: list  # (module, attr, original param): undo on a failed wrap


def dtensor_fqns(named: dict) -> list:
    from torch.distributed.tensor import DTensor

    return [fqn for fqn, p in named.items() if isinstance(p, DTensor)]


def check_dtensor_params(named: dict, mesh, bucket_meshes: Optional[dict] = None) -> None:
    """ValueError / NotImplementedError for DTensor params flex_shard cannot
    shard over their bucket's mesh: `bucket_meshes[fqn]` when the param's
    BucketSpec has a mesh of its own (experts over an expert-parallel group,
    one rank each included), else `mesh` (flex_shard's data-parallel mesh,
    which must shard over 2 ranks or more)."""
    fqns = dtensor_fqns(named)
    if not fqns:
        return
    bucket_meshes = bucket_meshes or {}
    for fqn in fqns:
        own = bucket_meshes.get(fqn, mesh)
        if own is None:
            raise ValueError(f"parameter {fqns[0]!r} is a DTensor (tensor parallel); pass "
                             "flex_shard the data-parallel slice of its mesh, e.g. mesh['dp'] of "
                             "init_device_mesh(..., ('dp', 'tp'))")
        _check_one(fqn, named[fqn], own)
        if own is mesh and own.size(own.ndim - 1) == 1:  # a bucket mesh of 1 rank is fine
            raise NotImplementedError(
                f"parameter {fqn!r} is a DTensor and flex_shard's mesh shards over 1 rank; "
                "flex_shard composes with tensor parallelism when the dp dim has 2 or more "
                "ranks: run the TP model without flex_shard")


def _check_one(fqn: str, param, mesh) -> None:
    _check_crossing(fqn, param.device_mesh, mesh)
    _check_placements(fqn, param, mesh)


def _check_crossing(fqn: str, own, mesh) -> None:
    """Each dim of the DTensor's mesh `own` that is not flex_shard's meets
    flex_shard's mesh at this rank only."""
    ours, me = set(mesh.mesh.flatten().tolist()), dist.get_rank()
    shared = _shared_dims(own, mesh)
    for dim in range(own.ndim):
        along = _ranks_along(own, dim)
        if dim not in shared and along & ours != {me}:  # TP's dim must cross flex_shard's
            raise ValueError(
                f"parameter {fqn!r} is a DTensor on mesh {_describe(own)}, which is not part of "
                f"flex_shard's mesh {_describe(mesh)}'s parent: its dim {dim} spans ranks "
                f"{sorted(along)}, {len(along & ours)} of them in flex_shard's mesh; make both "
                "from one init_device_mesh(..., mesh_dim_names=('dp', 'tp')): parallelize over "
                "mesh['tp'], flex_shard over mesh['dp']")


def _check_placements(fqn: str, param, mesh) -> None:
    """Replicate() on flex_shard's dims; Shard(d) or Replicate() elsewhere."""
    from torch.distributed.tensor import Replicate, Shard

    own = param.device_mesh
    for dim in _shared_dims(own, mesh):
        placement = param.placements[dim]
        if not isinstance(placement, Replicate):
            name = (own.mesh_dim_names or (None,) * own.ndim)[dim]
            raise ValueError(
                f"flex_shard's mesh {_describe(mesh)} includes mesh dim {name or dim!r}, on "
                f"which DTensor parameter {fqn!r} is already sharded ({placement!r}); flex_shard "
                "shards over the data-parallel dims only: pass e.g. mesh['dp'] and keep tensor "
                "parallelism on mesh['tp']")
    for placement in param.placements:
        if type(placement) not in (Shard, Replicate):  # _StridedShard, Partial, ...
            raise NotImplementedError(
                f"parameter {fqn!r} has DTensor placement {placement!r}; flex_shard shards "
                "DTensor params placed with Shard(d) or Replicate() only")


def _shared_dims(own, mesh) -> list:
    """The dims of a DTensor's mesh `own` that are also flex_shard's (`mesh`)."""
    if own == mesh:
        return list(range(own.ndim))
    ours = set(mesh.mesh_dim_names or ())
    return [d for d, name in enumerate(own.mesh_dim_names or ()) if name in ours]


def _ranks_along(mesh, dim: int) -> set:
    """The ranks of `mesh` that differ from this rank's coordinate in `dim` only."""
    index = list(mesh.get_coordinate())
    index[dim] = slice(None)
    return set(mesh.mesh[tuple(index)].flatten().tolist())


def _describe(mesh) -> str:
    return f"{tuple(mesh.shape)} {tuple(mesh.mesh_dim_names or ())}"


def to_local_params(module: nn.Module, named: dict) -> LocalParams:
    """Register each DTensor param's local tensor in its place (one new
    nn.Parameter per DTensor, shared by its tied aliases)."""
    fqns = dtensor_fqns(named)
    if not fqns:
        return LocalParams(named, {}, [])
    replaced: dict = {}  # id(DTensor param) -> (local param, spec)
    for fqn in fqns:
        param = named[fqn]
        if id(param) not in replaced:
            local = param.to_local().detach()
            replaced[id(param)] = (nn.Parameter(local, requires_grad=param.requires_grad),
                                   tp_spec(param))
    restore = []
    for sub in module.modules():
        for attr, param in list(sub._parameters.items()):
            if param is not None and id(param) in replaced:
                restore.append((sub, attr, param))
                sub._parameters[attr] = replaced[id(param)][0]
    local_named = {fqn: replaced[id(p)][0] if id(p) in replaced else p
                   for fqn, p in named.items()}
    specs = {fqn: replaced[id(named[fqn])][1] for fqn in fqns}
    return LocalParams(local_named, specs, restore)


def restore_params(local: LocalParams) -> None:
    """Put the DTensor params back (flex_shard failed after to_local_params)."""
    for sub, attr, param in local.restore:
        sub._parameters[attr] = param


def slot_specs(slots, specs: dict) -> Optional[tuple]:
    """Per slot of one bucket: its TPSpec or None; None when no slot has one."""
    out = tuple(specs.get(slot.fqn) for slot in slots)
    return out if any(s is not None for s in out) else None
