"""describe(): the plan of a wrapped model, or a dry run of an unwrapped one."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ..planning.bucket_plan import BucketLayouts
from ..planning.dry_run_plan import check_dry_run_options, check_mesh_shape, dry_run
from ..planning.report import ShardingPlan, bucket_plan
from ..runtime.state import FlexShardState, find_state


def describe(module: nn.Module, mesh_shape: Optional[tuple] = None,
             **flex_shard_kwargs) -> ShardingPlan:
    """The sharding plan of `module`; `print` it for a table.

    `describe(model)` on a wrapped model: the plan flex_shard made. With
    `mesh_shape=(R, S)` on an unwrapped model (real or on the meta device):
    the plan `flex_shard(model, **flex_shard_kwargs)` would make on R replicas
    of S-rank shard groups (FSDP2's HSDP; (1, n) is n ranks), computed without
    a process group or any allocation. Keyword arguments: flex_shard's
    `buckets`, `placement`, `mp_policy` and `reshard_after_forward`.

    Per bucket: its module, parameters, placements, dtypes, bytes per rank,
    padding, collectives and wire bytes per training step (one forward and
    one backward; a bucket regathers in backward when its module or an
    enclosing one reshards after forward). For the model: per-rank bytes of
    params, grads and AdamW state (`param_bytes`, `grad_bytes`, `adamw_bytes`).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"describe expects an nn.Module, got {type(module).__name__}")
    _check_no_mesh(mesh_shape, flex_shard_kwargs)
    state = find_state(module)
    if mesh_shape is None:
        if flex_shard_kwargs:
            raise ValueError(
                f"describe got flex_shard options {sorted(flex_shard_kwargs)} without mesh_shape; "
                "pass mesh_shape=(R, S) to dry-run an unwrapped module with them")
        if state is None:
            raise TypeError(
                f"{type(module).__name__} is not wrapped by flex_shard; call fs.flex_shard(module) "
                "first, or pass mesh_shape=(R, S) to plan it without wrapping")
        return wrapped_plan(module, state)
    mesh_shape = check_mesh_shape(mesh_shape)
    options = check_dry_run_options(flex_shard_kwargs)
    wrapped = [name or "<root>" for name, sub in module.named_modules() if find_state(sub) is not None]
    if wrapped:
        raise ValueError(
            f"describe(mesh_shape=...) plans an unwrapped module, but {wrapped[0]!r} is already "
            "wrapped by flex_shard (its parameters are shards); call describe(module) for the "
            "plan it made, or dry-run a fresh copy (the meta device costs no memory)")
    return dry_run(module, mesh_shape, **options)


def _check_no_mesh(mesh_shape, options: dict) -> None:
    """A dry run takes a mesh's shape, never a mesh (no process group needed)."""
    if "mesh" not in options:
        return
    if mesh_shape is not None:
        raise ValueError("describe got both mesh= and mesh_shape=; a dry run needs only the "
                         "shape: drop mesh=")
    raise ValueError("describe takes mesh_shape=(R, S), not mesh=: a dry run needs no process "
                     "group; pass mesh_shape=(1, n) for a 1-D mesh of n ranks")


def wrapped_plan(module: nn.Module, state: FlexShardState) -> ShardingPlan:
    """What flex_shard made of `module` (wrapped, with `state`). A bucket that
    reshards after forward regathers in backward, unless autograd saved none of
    its params in the last forward (an embedding's weight)."""
    names = {id(m): n for n, m in module.named_modules()}
    runners = {id(b): h.module for h in state.hooks for b in h.buckets}
    mesh_shape = (state.replicate_size, state.world_size)
    rows = []
    for bucket in state.buckets:
        shape = (bucket.replicate_size, bucket.world_size)  # its own mesh's, or the model's
        runner = runners.get(id(bucket))
        layouts = BucketLayouts(bucket.storage.layout, bucket.gather.layout, bucket.grads.layout,
                                bucket.gather.wire, bucket.gather.layout)  # the one it gathers over
        trainable = [i in set(bucket.grad_slots) for i in range(len(bucket.slots))]
        regather = bool(bucket.gather.reshard_after_forward)  # refilled before its block's backward
        rows.append(bucket_plan(
            bucket.name, bucket.slots, layouts, trainable, bucket.gather.reshard_after_forward,
            None if runner is None else names.get(id(runner), ""),
            runner is not None and regather, shape))
    return ShardingPlan(state.replicate_size * state.world_size, tuple(rows), mesh_shape)
