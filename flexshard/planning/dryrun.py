"""The dry run: the plan flex_shard would make of an unwrapped module on a
(replicate R, shard S) mesh, with no process group and no allocation.

It plans the way flex_shard does (the same default buckets, parameter
assignment, placement binding, running modules and bucket layouts), over the
S ranks of one shard group: FSDP2's HSDP convention shards each bucket over S
ranks and replicates it over R groups, the gradient reduced by a reduce-scatter
in the shard group and an all-reduce of the reduce segment across replicas.
Only shapes, dtypes and requires_grad are read, so meta-device modules work.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch.nn as nn

from ..config import BucketSpec, MixedPrecisionPolicy
from ..placements.shard import Shard
from ..runtime.bucket import BucketLayouts, needs_hooks, plan_bucket_layouts
from .assign import (
    assign_params,
    default_buckets,
    param_aliases,
    plan_slots,
    reshards_after_forward,
    running_module,
)
from .options import check_options, check_params, check_specs
from .report import ShardingPlan, bucket_plan, regathers

# flex_shard's keyword arguments a dry run takes, with flex_shard's defaults.
DRY_RUN_OPTIONS = {"buckets": None, "placement": Shard(0), "mp_policy": MixedPrecisionPolicy(),
                   "reshard_after_forward": True}


def check_mesh_shape(mesh_shape) -> tuple:
    """(R, S) as two positive ints."""
    fix = "pass mesh_shape=(R, S): R replicas of S-rank shard groups, (1, n) for n ranks"
    if not isinstance(mesh_shape, (tuple, list)):
        raise TypeError(f"mesh_shape must be a tuple of two ints, got {mesh_shape!r}; {fix}")
    if len(mesh_shape) != 2:
        raise ValueError(f"mesh_shape must have two entries (replicate, shard), got "
                         f"{tuple(mesh_shape)!r}; {fix}")
    for dim, size in zip(("replicate", "shard"), mesh_shape):
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"mesh_shape's {dim} size must be an int, got {size!r}; {fix}")
        if size < 1:
            raise ValueError(f"mesh_shape's {dim} size must be >= 1, got {size}; {fix}")
    return tuple(mesh_shape)


def check_dry_run_options(options: dict) -> dict:
    """flex_shard's keyword arguments for a dry run, defaults filled in."""
    unknown = sorted(set(options) - set(DRY_RUN_OPTIONS))
    if unknown:
        raise TypeError(f"describe got unexpected keyword argument(s) {unknown}; a dry run takes "
                        f"mesh_shape and flex_shard's {', '.join(DRY_RUN_OPTIONS)}")
    merged = {**DRY_RUN_OPTIONS, **options}
    check_options(merged["placement"], merged["mp_policy"], merged["reshard_after_forward"])
    return merged


def dry_run(module: nn.Module, mesh_shape: tuple, *, buckets=None, placement=Shard(0),
            mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
            reshard_after_forward: bool = True) -> ShardingPlan:
    """The ShardingPlan flex_shard(module, **options) would make on a (R, S)
    mesh, bucket by bucket as api._build decides (mesh_shape and options
    already checked: see describe)."""
    replicas, shards = mesh_shape
    specs = default_buckets(module) if buckets is None else check_specs(buckets)
    named = dict(module.named_parameters())
    check_params(named)
    members = assign_params(list(named), specs)
    slot_plans = [plan_slots(spec, names, named, placement, shards)
                  for spec, names in zip(specs, members)]
    aliases = param_aliases(module)
    planned = [_bucket(module, spec, slots, named, aliases, mp_policy, reshard_after_forward,
                        mesh_shape) for spec, slots in zip(specs, slot_plans)]
    resharding = {id(b.runner) for b in planned if b.hooked and b.reshard}
    names = {id(m): n for n, m in module.named_modules()}
    rows = tuple(
        bucket_plan(spec.label, slots, b.layouts, b.trainable, b.reshard,
                    names[id(b.runner)] if b.hooked else None,
                    b.hooked and regathers(module, b.runner, resharding, names), mesh_shape)
        for spec, slots, b in zip(specs, slot_plans, planned))
    return ShardingPlan(replicas * shards, rows, mesh_shape)


class _Planned(NamedTuple):
    """What flex_shard's _build decides for one bucket, short of allocating it."""

    runner: Any  # nn.Module whose forward runs it
    reshard: bool
    trainable: list  # requires_grad per slot
    layouts: BucketLayouts
    hooked: bool


def _bucket(module: nn.Module, spec: BucketSpec, slots: Sequence, named: dict, aliases: dict,
            mp_policy: MixedPrecisionPolicy, reshard: bool, mesh_shape: tuple) -> _Planned:
    owners = [owner for s in slots for _, _, owner in aliases[id(named[s.fqn])]]
    runner = running_module(module, owners)
    trainable = [named[s.fqn].requires_grad for s in slots]
    layouts = plan_bucket_layouts(slots, trainable, spec.mp_policy or mp_policy, mesh_shape[1])
    # Every rank of the world takes part in the gradient's reduction, so the
    # bucket is hooked whenever the whole world (not only its shard group) has 2+ ranks.
    hooked = needs_hooks(slots, layouts.storage, layouts.gather, mesh_shape[0] * mesh_shape[1])
    return _Planned(runner, reshards_after_forward(spec, reshard, runner, module), trainable,
                    layouts, hooked)
