"""The wrap plan: everything flex_shard decides about a model before building
its buckets, in one pass (`plan_wrap`).

Per bucket: its BucketSpec, its slots (placements checked and bound), every
(module, attr) registering each param, the module whose forward runs it, and
its resolved flags. api.py checks that the ranks agree on it
(fingerprint.py) and builds the runtime from it.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional, Sequence

import torch.nn as nn

from ..config import BucketSpec, MixedPrecisionPolicy, OffloadPolicy
from ..placements.contract import Placement
from ..placements.owned import Owned
from ..placements.ragged import RaggedShard
from ..placements.shard import Shard
from ..placements.subclass import check_pieces, subclass_gather
from .bucket_plan import hooks_needed
from .layout import SlotPlan, bind_placements
from .assign import (
    alias_names,
    assign_params,
    claimed_elsewhere,
    param_aliases,
    running_module,
    used_in_nested_runner,
)
from .options import resolve_reshard
from .placement_check import check_contract
from .owners import balance_owners


class PlannedBucket(NamedTuple):
    """One bucket as flex_shard will build it."""

    spec: BucketSpec
    slots: tuple  # SlotPlan per param, placement bound
    trainable: tuple  # requires_grad per slot
    aliases: tuple  # per slot: every (module, attr) registering the param
    runner: nn.Module  # the module whose forward unshards the bucket
    mp_policy: MixedPrecisionPolicy  # the spec's, else flex_shard's
    reshard_after_forward: object  # bool, or int N (post-forward groups of N ranks): the
    #                               spec's, else flex_shard's (never on the root module)
    needs_hooks: bool  # False when the sharded params are the full ones (runtime.bucket)
    used_in_nested_runner: bool  # a param is used inside another hooked bucket's runner
    mesh_shape: tuple  # (replicas, shard size) of the bucket's mesh (its own or flex_shard's)
    offload_policy: Optional[OffloadPolicy] = None  # the spec's, else flex_shard's; None: no offload
    above_owners: bool = False  # the runner is an ancestor of the module running every param
    #                             (its `"X.*"` pattern): a forward of X may checkpoint that module


def mesh_shape(mesh) -> tuple:
    """(replicas, shard size) of a 1-D or 2-D DeviceMesh."""
    return (1, mesh.size()) if mesh.ndim == 1 else (mesh.size(0), mesh.size(1))


class WrapPlan(NamedTuple):
    """Every bucket of a model, in BucketSpec order."""

    buckets: tuple  # PlannedBucket


def shard_dim_note(mesh_shape: tuple) -> str:
    """What ends a placement error on a 2-D (HSDP) mesh: the group it splits over."""
    if len(mesh_shape) != 2:
        return ""
    return (f" (under HSDP placements split over the shard group, dim 1 of the "
            f"{tuple(mesh_shape)} mesh: {mesh_shape[1]} rank(s))")


def plan_wrap(module: nn.Module, named: dict, specs: Sequence[BucketSpec], placement,
              mp_policy: MixedPrecisionPolicy, reshard_after_forward,
              world_size: int, *, replicas: int = 1, note: str = "",
              offload_policy: Optional[OffloadPolicy] = None,
              dtensors: frozenset = frozenset()) -> WrapPlan:
    """Assign `named` (module.named_parameters()) to `specs`, bind placements
    (`placement` unless a spec names its own) and find each bucket's modules.
    Raises on parameters that match no or several specs and on placements
    that cannot split their parameter; warns on tied params the specs split.
    `replicas`: HSDP's replicate size (grads are all-reduced over it); `note`
    ends placement errors (which group the placements split over). A spec
    with its own mesh is planned on that mesh's (replicas, shard size).
    `offload_policy`: flex_shard's, which a BucketSpec's overrides (False: none).
    `dtensors`: FQNs of params that were DTensors (their buckets always hook: forward
    installs them as DTensors again)."""
    members = assign_params(list(named), specs, alias_names(module))
    shapes = [(replicas, world_size) if spec.mesh is None else mesh_shape(spec.mesh)
              for spec in specs]
    loads: dict = {}  # bytes per rank so far, per group size: placements balance over the model
    planned = [plan_slots(spec, names, named, placement, shape[1],
                          note if spec.mesh is None else _bucket_mesh_note(shape),
                          loads.setdefault(shape[1], [0] * shape[1]))
               for spec, names, shape in zip(specs, members, shapes)]
    slots = _balanced_owners([b for b, _ in planned], [f for _, f in planned],
                             [shape[1] for shape in shapes])
    for spec, bucket in zip(specs, slots):  # subclasses that gather themselves need every rank
        for s in bucket:
            if s.subclass is not None:
                check_pieces(s.fqn, spec.label, s.subclass, s.local_shapes)
    registered = param_aliases(module)
    # Per bucket, per slot: [(module, attr, module FQN)] of every registration.
    aliases = [[registered[id(named[s.fqn])] for s in bucket] for bucket in slots]
    owners = [[fqn for a in bucket for _, _, fqn in a] for bucket in aliases]
    runners = [running_module(module, fqns, spec.patterns) for fqns, spec in zip(owners, specs)]
    above = [r is not running_module(module, fqns) for r, fqns in zip(runners, owners)]
    for spec, bucket, bucket_aliases, runner in zip(specs, slots, aliases, runners):
        _warn_split_aliases(module, runner, spec, specs, bucket, bucket_aliases)
    mps = [spec.mp_policy or mp_policy for spec in specs]
    offloads = [_offload(spec, offload_policy) for spec in specs]
    hooked = [hooks_needed(bucket, mp, shape[1], shape[0], off is not None,
                           sub_mesh=shape[0] * shape[1] < replicas * world_size)
              or any(s.fqn in dtensors for s in bucket)
              for bucket, mp, shape, off in zip(slots, mps, shapes, offloads)]
    nested = _nested_use(module, runners, owners, hooked)
    return WrapPlan(tuple(
        PlannedBucket(
            spec=spec, slots=tuple(bucket),
            trainable=tuple(named[s.fqn].requires_grad for s in bucket),
            aliases=tuple(tuple((m, attr) for m, attr, _ in a) for a in bucket_aliases),
            runner=runner, mp_policy=mp,
            reshard_after_forward=_reshard(spec, reshard_after_forward, runner is module,
                                           shape[1]),
            needs_hooks=needs, used_in_nested_runner=nest, mesh_shape=shape, offload_policy=off,
            above_owners=up)
        for spec, bucket, bucket_aliases, runner, mp, needs, nest, shape, off, up
        in zip(specs, slots, aliases, runners, mps, hooked, nested, shapes, offloads, above)))


def _offload(spec: BucketSpec, default: Optional[OffloadPolicy]) -> Optional[OffloadPolicy]:
    """The spec's offload policy (False: none), else flex_shard's."""
    if spec.offload_policy is None:
        return default
    return spec.offload_policy or None


def plan_slots(spec: BucketSpec, names: Sequence[str], named: dict, default,
               world_size: int, note: str = "", load: Optional[list] = None) -> list:
    """The SlotPlans of one bucket's params (`names`), placements checked and
    bound, and per slot whether flex_shard chose its owner (an `Owned()`, which
    the model-wide owner pass may move); `load` (bytes per rank of the buckets
    before, updated) lets them balance over the whole model."""
    choice = spec.placement if spec.placement is not None else default
    if isinstance(choice, type):
        raise TypeError(f"the placement of bucket {spec.label!r} is the class {choice.__name__}, "
                        f"not a placement: pass an instance, such as {choice.__name__}() or "
                        "fs.Shard(0)")
    entries = []
    for fqn in names:
        param = named[fqn]
        placement = choice if isinstance(choice, Placement) else choice(fqn, param)
        if placement is choice and param.dim() == 0 and isinstance(choice, (Shard, RaggedShard)):
            placement = Owned()  # a split given to the whole bucket: a scalar has nothing to split
        if not isinstance(placement, Placement):
            raise TypeError(f"the placement callable of bucket {spec.label!r} returned "
                            f"{placement!r} for parameter {fqn!r}; it must return a Placement "
                            "such as fs.Shard(0)")
        try:
            placement.check(param.shape, world_size)
        except ValueError as e:
            raise ValueError(f"parameter {fqn!r} in bucket {spec.label!r}: {e}{note}") from None
        entries.append((param.shape, param.dtype.itemsize, placement))
    bound = bind_placements(entries, world_size, load)
    slots = [SlotPlan(fqn, named[fqn].shape, named[fqn].dtype, pl,
                      tuple(pl.local_shape(named[fqn].shape, r, world_size)
                            for r in range(world_size)),
                      subclass_gather(fqn, named[fqn]))
             for fqn, pl in zip(names, bound)]
    for slot in slots:
        check_contract(slot.fqn, spec.label, slot.placement, slot.shape, slot.local_shapes)
    return slots, [isinstance(p, Owned) and p.rank is None for _, _, p in entries]


def _balanced_owners(slots: list, free: list, sizes: list) -> list:
    """Each bucket's slots after the model-wide owner pass (owners.py), run
    over the buckets of each shard group size together."""
    out = list(slots)
    for size in sorted(set(sizes)):
        group = [i for i, s in enumerate(sizes) if s == size]
        for i, balanced in zip(group, balance_owners([slots[i] for i in group],
                                                     [free[i] for i in group], size)):
            out[i] = balanced
    return out


def _reshard(spec: BucketSpec, default, on_root: bool, shard_size: int):
    """The spec's reshard_after_forward, else flex_shard's (an int checked on the
    root's bucket too), resolved on the bucket's shard group; by default never for
    the bucket the root module runs: backward needs its params at once."""
    if spec.reshard_after_forward is not None:
        return resolve_reshard(spec.reshard_after_forward, shard_size, spec.label)
    value = resolve_reshard(default, shard_size, spec.label)
    return False if on_root else value


def _bucket_mesh_note(shape: tuple) -> str:
    return f" (the bucket's own mesh {shape}: placements split over its {shape[1]} shard rank(s))"


def _warn_split_aliases(module, runner, spec, specs, slots, slot_aliases) -> None:
    """A tied/shared param whose other FQN another bucket claims stays correct (its
    bucket runs on a module covering every use) but may be gathered far earlier."""
    for slot, aliases in zip(slots, slot_aliases):
        for fqn, label in claimed_elsewhere(aliases, specs, specs.index(spec)):
            where = next((n for n, m in module.named_modules() if m is runner), "?") or "root"
            warnings.warn(
                f"parameter {slot.fqn!r} (bucket {spec.label!r}) is also registered as {fqn!r}, "
                f"which bucket {label!r} matches; a parameter lives in one bucket, so "
                f"{spec.label!r} runs on module {where!r} (covering both uses) and stays "
                "unsharded through its forward. Put both FQNs in one BucketSpec to make "
                "this explicit", stacklevel=4)  # flex_shard's caller


def _nested_use(module: nn.Module, runners: list, owners: list, hooked: list) -> list:
    """Per bucket: whether it is hooked and a module registering one of its params
    (`owners`) lies inside another hooked bucket's (nested) running module."""
    names = {id(m): n for n, m in module.named_modules()}
    hooked_runners = [names[id(r)] for r, h in zip(runners, hooked) if h]
    return [h and used_in_nested_runner(fqns, names[id(r)], hooked_runners)
            for r, fqns, h in zip(runners, owners, hooked)]
