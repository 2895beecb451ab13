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

import torch.nn as nn

from ..config import MixedPrecisionPolicy
from ..placements.shard import Shard
from .bucket_plan import plan_bucket_layouts
from .assign import default_buckets
from .options import check_modules, check_options, check_params, check_specs
from .plan import plan_wrap, shard_dim_note
from .report import ShardingPlan, bucket_plan

# flex_shard's keyword arguments a dry run takes, with flex_shard's defaults.
DRY_RUN_OPTIONS = {"buckets": None, "placement": Shard(0), "mp_policy": MixedPrecisionPolicy(),
                   "reshard_after_forward": True, "offload_policy": None}


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
    check_options(merged["placement"], merged["mp_policy"], merged["reshard_after_forward"],
                  merged["offload_policy"])
    return merged


def dry_run(module: nn.Module, mesh_shape: tuple, *, buckets=None, placement=Shard(0),
            mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
            reshard_after_forward=True, offload_policy=None) -> ShardingPlan:
    """The ShardingPlan flex_shard(module, **options) would make on a (R, S)
    mesh: flex_shard's own WrapPlan, and the layouts its buckets would have
    (mesh_shape and options already checked: see describe)."""
    replicas, shards = mesh_shape
    specs = default_buckets(module) if buckets is None else check_specs(buckets)
    named = dict(module.named_parameters())
    check_params(named)
    check_modules(module)
    plan = plan_wrap(module, named, specs, placement, mp_policy, reshard_after_forward,
                     shards, replicas=replicas, offload_policy=offload_policy,
                     note=shard_dim_note(mesh_shape if replicas > 1 else ()))
    names = {id(m): n for n, m in module.named_modules()}
    rows = tuple(_row(b, names) for b in plan.buckets)
    return ShardingPlan(replicas * shards, rows, mesh_shape)


def _row(planned, names: dict):
    """A bucket's record; backward regathers a resharding bucket (assuming
    autograd saves one of its params, as every matmul does)."""
    mesh_shape = planned.mesh_shape  # a bucket's own mesh, else the dry run's
    layouts = plan_bucket_layouts(planned.slots, planned.trainable, planned.mp_policy,
                                  mesh_shape[1], offload=planned.offload_policy is not None)
    hooked = planned.needs_hooks
    return bucket_plan(planned.spec.label, planned.slots, layouts, planned.trainable,
                       planned.reshard_after_forward,
                       names[id(planned.runner)] if hooked else None,
                       hooked and bool(planned.reshard_after_forward), mesh_shape)
