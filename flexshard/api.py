"""flex_shard(): validate the user's request, plan the buckets, wrap the module."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .bucket import Bucket
from .bucketing import assign_params, default_buckets, param_aliases, running_module
from .comm import Comm
from .config import BucketSpec, MixedPrecisionPolicy
from .fingerprint import check_ranks_agree
from .hooks import ModuleHooks, install_params
from .layout import SlotPlan, bind_placements
from .placements.contract import Placement
from .placements.shard import Shard
from .state import FlexShardState, attach_state, find_state, get_state
from .state_dict import StateDictHooks


class FlexShardModule:
    """Mixin a wrapped module becomes an instance of (like FSDP2's FSDPModule)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """When False, backward accumulates unreduced gradients and issues no
        gradient collective; the next synced backward reduces the sum."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync expects a bool, got {requires_gradient_sync!r}")
        for bucket in get_state(self).buckets:
            bucket.requires_gradient_sync = requires_gradient_sync


def flex_shard(module: nn.Module, mesh: Optional[DeviceMesh] = None, *,
               buckets: Optional[Sequence[BucketSpec]] = None,
               placement: Placement = Shard(0),
               mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
               reshard_after_forward: bool = True,
               comm: Optional[Comm] = None) -> nn.Module:
    """Shard `module`'s parameters over a 1-D mesh, bucket by bucket.

    Returns the same module, now also a FlexShardModule. Outside forward and
    backward its parameters are this rank's local shards.
    """
    _check_args(module, mesh, placement, mp_policy, reshard_after_forward)
    specs = default_buckets(module) if buckets is None else _check_specs(buckets)
    named = dict(module.named_parameters())
    _check_params(named)
    members = assign_params(list(named), specs)
    rank, world_size = _rank_and_world(mesh)
    plans = [_plan_slots(spec, names, named, placement, world_size)
             for spec, names in zip(specs, members)]
    device = _param_device(named)
    mesh = mesh if mesh is not None else _default_mesh(device, world_size)
    state = FlexShardState(mesh, mesh.get_group() if mesh is not None else None,
                           rank, world_size, comm or Comm())
    check_ranks_agree(state, specs, plans, named, mp_policy, reshard_after_forward)
    _build(module, state, specs, plans, named, mp_policy, reshard_after_forward, device)
    attach_state(module, state)
    state.state_dict_hooks = StateDictHooks(module, state)
    cls = type(module)
    module.__class__ = type(f"FlexShard{cls.__name__}", (FlexShardModule, cls), {})
    return module


def _check_args(module, mesh, placement, mp_policy, reshard_after_forward) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"flex_shard expects an nn.Module, got {type(module).__name__}")
    if find_state(module) is not None or isinstance(module, FlexShardModule):
        raise ValueError(f"{type(module).__name__} is already wrapped by flex_shard; "
                         "call flex_shard once, on the root module, with all its buckets")
    for name, sub in module.named_modules():
        if name and find_state(sub) is not None:
            raise ValueError(f"submodule {name!r} is already wrapped by flex_shard; "
                             "wrap only the root module, with one BucketSpec per group")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(f"mesh must be 1-D, got a {mesh.ndim}-D mesh of shape "
                         f"{tuple(mesh.shape)}; pass a 1-D slice such as mesh['dp']")
    if not isinstance(placement, Placement) and not callable(placement):
        raise TypeError(f"placement {placement!r} is not a Placement or a callable "
                        "(fqn, param) -> Placement; use e.g. fs.Shard(0)")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a fs.MixedPrecisionPolicy, got {mp_policy!r}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")


def _check_specs(buckets) -> list:
    if isinstance(buckets, (str, BucketSpec)) or not hasattr(buckets, "__iter__"):
        raise TypeError(f"buckets must be a list of fs.BucketSpec, got {buckets!r}; "
                        "e.g. buckets=[fs.BucketSpec('layers.*')]")
    specs = list(buckets)
    if not specs:
        raise ValueError("buckets is empty; pass buckets=None for one bucket per block, "
                         "or at least one fs.BucketSpec")
    for i, spec in enumerate(specs):
        if not isinstance(spec, BucketSpec):
            raise TypeError(f"buckets[{i}] is {type(spec).__name__}, not a fs.BucketSpec")
    labels = [s.label for s in specs]
    for label in labels:
        if labels.count(label) > 1:
            raise ValueError(f"two buckets are named {label!r}; give each BucketSpec a unique name")
    return specs


def _check_params(named: dict) -> None:
    from torch.distributed.tensor import DTensor

    if not named:
        raise ValueError("the module has no parameters to shard")
    for fqn, p in named.items():
        if isinstance(p, DTensor):
            raise NotImplementedError(
                f"parameter {fqn!r} is a DTensor; flex_shard shards plain tensors. Apply "
                "flex_shard before other parallelisms, or pass a module with local parameters")


def _rank_and_world(mesh) -> tuple:
    if mesh is not None:
        return mesh.get_local_rank(), mesh.size()
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _param_device(named: dict) -> torch.device:
    devices = {p.device for p in named.values()}
    if len(devices) > 1:
        where = {str(d): next(f for f, p in named.items() if p.device == d) for d in devices}
        raise ValueError(f"parameters live on several devices {where}; move the module to one "
                         "device (or the meta device) before flex_shard")
    return devices.pop()


def _default_mesh(device: torch.device, world_size: int) -> Optional[DeviceMesh]:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    device_type = device.type
    if device_type == "meta":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world_size,))


def _plan_slots(spec: BucketSpec, names, named, default, world_size) -> list:
    choice = spec.placement if spec.placement is not None else default
    entries = []
    for fqn in names:
        param = named[fqn]
        placement = choice if isinstance(choice, Placement) else choice(fqn, param)
        if not isinstance(placement, Placement):
            raise TypeError(f"the placement callable of bucket {spec.label!r} returned "
                            f"{placement!r} for parameter {fqn!r}; it must return a Placement "
                            "such as fs.Shard(0)")
        try:
            placement.check(param.shape, world_size)
        except ValueError as e:
            raise ValueError(f"parameter {fqn!r} in bucket {spec.label!r}: {e}") from None
        entries.append((param.shape, param.dtype.itemsize, placement))
    bound = bind_placements(entries, world_size)
    return [SlotPlan(fqn, named[fqn].shape, named[fqn].dtype, pl,
                     tuple(pl.local_shape(named[fqn].shape, r, world_size)
                           for r in range(world_size)))
            for fqn, pl in zip(names, bound)]


def _build(module, state, specs, plans, named, mp_policy, reshard, device) -> None:
    aliases = param_aliases(module)
    by_runner: dict = {}
    for spec, slots in zip(specs, plans):
        slot_aliases = [aliases[id(named[s.fqn])] for s in slots]
        runner = running_module(module, [fqn for a in slot_aliases for _, _, fqn in a])
        bucket_reshard = (spec.reshard_after_forward if spec.reshard_after_forward is not None
                          else reshard and runner is not module)
        bucket = Bucket(spec.label, slots, [named[s.fqn].requires_grad for s in slots],
                        spec.mp_policy or mp_policy, bucket_reshard, state.group,
                        state.rank, state.world_size, state.comm, device)
        bucket.load_full(lambda fqn: named[fqn].detach())
        pairs = [[(m, a) for m, a, _ in a] for a in slot_aliases]
        install_params(pairs, bucket.params)
        state.buckets.append(bucket)
        state.aliases.append(pairs)
        if bucket.needs_hooks:
            by_runner.setdefault(id(runner), (runner, []))[1].append((bucket, pairs))
    for runner, entries in by_runner.values():
        state.hooks.append(ModuleHooks(runner, [b for b, _ in entries], [p for _, p in entries]))
