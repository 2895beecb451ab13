"""Meta-device models: move bucket storage with the module, initialise shards.

Build the model on the meta device, flex_shard it (storage stays on meta, so
nothing is allocated), then `module.to_empty(device=...)` allocates only this
rank's storage and `module.init_parameters()` fills it one module at a time:
each module's own parameters are materialised at full size, initialised by
its `reset_parameters()` (or a user function), cut into this rank's pieces
and freed. With every rank seeded alike, the result equals initialising the
unsharded model in `model.modules()` order, random inits included.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from ..runtime.bucket import BucketState


def apply_to_buckets(state, fn, apply_rest: Callable) -> None:
    """nn.Module._apply for a wrapped module: `apply_rest` (the plain _apply)
    moves everything but the sharded params, each bucket moves its storage."""
    for bucket in state.buckets:
        if bucket.state is not BucketState.SHARDED or bucket.held is not None:
            raise RuntimeError(
                f"cannot move or convert the module while bucket {bucket.name!r} is "
                f"{bucket.state.value}; call module.reshard() and finish backward first")
        bucket.check_apply(fn)
    state.prefetcher.drop_all()
    for bucket in state.buckets:  # unregistered, so apply_rest skips them: storage moves below
        bucket.install([None] * len(bucket.slots))
    try:
        apply_rest()
        for bucket in state.buckets:
            bucket.apply_to_storage(fn)
    finally:
        for bucket in state.buckets:
            bucket.install_sharded()


def init_parameters(module: nn.Module, state, init_fn: Optional[Callable] = None) -> None:
    """Initialise the sharded params module by module (see the module docstring)."""
    owners = _owners(module, state)
    if init_fn is None:
        _check_resettable(module, owners)
        init_fn = _reset
    for name, sub in module.named_modules():
        entries = owners.get(id(sub), [])
        _materialize(sub, entries)
        try:
            with torch.no_grad():
                init_fn(sub)
                for attr, bucket, index in entries:
                    _store_piece(sub, attr, bucket, index, name)
        finally:
            for attr, bucket, index in entries:
                sub._parameters[attr] = bucket.params[index]


def _owners(module: nn.Module, state) -> dict:
    """id(submodule) -> [(attr, bucket, slot index)] of the sharded params it registers."""
    where = {id(p): (b, i) for b in state.buckets for i, p in enumerate(b.params)}
    owners: dict = {}
    for _, sub in module.named_modules():
        for attr, p in sub._parameters.items():
            if p is not None and id(p) in where:
                owners.setdefault(id(sub), []).append((attr, *where[id(p)]))
    for bucket in state.buckets:
        if bucket.storage.buffer.is_meta:
            raise ValueError(f"bucket {bucket.name!r} is still on the meta device; call "
                             "module.to_empty(device=...) before init_parameters()")
    return owners


def _check_resettable(module: nn.Module, owners: dict) -> None:
    for name, sub in module.named_modules():
        if id(sub) in owners and not callable(getattr(sub, "reset_parameters", None)):
            attr, bucket, index = owners[id(sub)][0]
            raise ValueError(
                f"parameter {bucket.slots[index].fqn!r} is registered on "
                f"{type(sub).__name__} {name or '<root>'!r}, which has no "
                "reset_parameters(); pass init_parameters(init_fn) with a function of the "
                "module that initialises it (a Hugging Face model's own: "
                "init_parameters(model._init_weights))")


def _reset(sub: nn.Module) -> None:
    if callable(getattr(sub, "reset_parameters", None)):
        sub.reset_parameters()


def _materialize(sub: nn.Module, entries) -> None:
    """Full-size, uninitialised params for `sub`'s own sharded params, installed on it."""
    for attr, bucket, index in entries:
        slot, param = bucket.slots[index], bucket.params[index]
        sub._parameters[attr] = nn.Parameter(
            # On the compute device (not an offloaded bucket's host memory), so init
            # functions run, and draw random numbers, where the unsharded model's would.
            torch.empty(_full_shape(bucket, index), dtype=slot.dtype, device=bucket.compute_device),
            requires_grad=param.requires_grad)


def _full_shape(bucket, index) -> tuple:
    """The shape init functions see: the global one for a DTensor param (TP), so
    that every TP rank keeps its block of the unsharded model's values."""
    spec = bucket.wiring[index].tp
    return tuple(bucket.slots[index].shape) if spec is None else tuple(spec.shape)


def _store_piece(sub, attr, bucket, index, name) -> None:
    """Copy this rank's piece of what `sub` now registers under `attr` into storage."""
    value = sub._parameters[attr]
    slot, shape = bucket.slots[index], _full_shape(bucket, index)
    if value is None or tuple(value.shape) != shape:
        raise ValueError(
            f"the init function left {name + '.' if name else ''}{attr} as "
            f"{None if value is None else tuple(value.shape)}, expected a tensor of shape "
            f"{shape}; initialise the parameter in place")
    value = value.detach()
    if bucket.wiring[index].tp is not None:
        value = bucket.wiring[index].tp.local_of(value)  # this TP rank's block
    piece = slot.placement.shard(value.to(slot.dtype), bucket.rank, bucket.world_size)
    bucket.storage.views[index].copy_(piece)
