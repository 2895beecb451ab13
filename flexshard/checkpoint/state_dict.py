"""State dicts of a wrapped module and of its optimizers.

`module.state_dict()` gives each sharded parameter as a value that carries the
full shape and where this rank's piece lies in it (a DTensor for DTensor-like
Shard(dim) chunks, else a `ShardedPieces`), so torch.distributed.checkpoint
saves at N ranks and loads at M ranks with any placements. `load_state_dict`
accepts those values, DTensors of any layout and full tensors, and copies this
rank's piece into the sharded parameters in place (they view the bucket's
storage and are never rebound).

Optimizers' state dicts: optimizer_state.py.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn as nn

from ..compat import ASSIGN_METADATA_KEY, persistent_buffer_names
from ..runtime.bucket import BucketState
from ..runtime.hooks import check_call
from ..runtime.state import FlexShardState, get_state
from ..wrap.names import state_dict_name
from .agreement import ABSENT, PRESENT, UNCOMPARED, check_sources_agree, checksum
from .pieces import (LivePieces, ShardedPieces, dtensor_shard, live_dtensor, piece_boxes,
                     shards_in_rank_order)


class SlotRef(NamedTuple):
    """One sharded parameter: its bucket and slot index."""

    bucket: object
    index: int

    @property
    def slot(self):
        return self.bucket.slots[self.index]

    @property
    def tp(self):
        """The slot's TPSpec when the param was a DTensor (tensor parallel), else None."""
        return self.bucket.wiring[self.index].tp

    @property
    def shape(self) -> tuple:
        """The full shape: the global one for a DTensor param."""
        return tuple(self.tp.shape) if self.tp is not None else tuple(self.slot.shape)


def group_values(ref: SlotRef) -> bool:
    """Whether each group of ranks holds its own values under this name: a
    plain tensor in a bucket on its own sub-mesh (experts), which the ranks of
    other groups load from other tensors."""
    return ref.bucket.on_sub_mesh and ref.tp is None


def slot_refs(state: FlexShardState) -> dict:
    """id(sharded param) -> SlotRef."""
    return {id(p): SlotRef(b, i) for b in state.buckets for i, p in enumerate(b.params)}


def named_slots(module: nn.Module, state: FlexShardState) -> dict:
    """Every name of a sharded parameter -> SlotRef: its names (tied aliases
    included) as the unwrapped model's state dict gives them, then, where a
    wrapper makes them differ, as named_parameters() does (wrap/names.py)."""
    for bucket in state.buckets:
        _check_sharded(bucket)
    refs = slot_refs(state)
    named = [(name, refs[id(p)]) for name, p in module.named_parameters(remove_duplicate=False)
             if id(p) in refs]
    out = {state_dict_name(module, name): ref for name, ref in named}
    out.update((name, ref) for name, ref in named if name not in out)
    return out


# Sharded values: local piece <-> value with the full shape.


def sharded_value(state: FlexShardState, ref: SlotRef, local: torch.Tensor,
                  key: str) -> torch.Tensor:
    """`local` (this rank's piece of the slot, or a tensor shaped like it) as
    a value with the full shape that DCP saves and reshards; `key` names it
    in errors."""
    slot, bucket = ref.slot, ref.bucket  # on the bucket's mesh (its own, or the model's)
    if bucket.mesh is None:  # world size 1 without a process group: the piece is the tensor
        return local
    if ref.tp is not None:  # the dp pieces of the TP-local tensor, placed in the global one
        return LivePieces(local, ref.shape, slot_boxes(ref))
    placements = dtensor_placements(bucket, slot)
    if placements is not None:
        return live_dtensor(local, bucket.mesh, placements, slot.shape,
                            _contiguous_stride(slot.shape), key)
    # Under HSDP the replicas hold the same boxes; DCP saves each chunk once.
    boxes = piece_boxes(slot.placement, slot.shape, bucket.rank, bucket.world_size)
    return LivePieces(local, slot.shape, boxes)


def slot_boxes(ref: SlotRef) -> tuple:
    """Where this rank's piece lies in the full tensor (the global one under TP)."""
    slot, bucket = ref.slot, ref.bucket
    boxes = piece_boxes(slot.placement, slot.shape, bucket.rank, bucket.world_size)
    if ref.tp is None:
        return boxes
    return tuple(box._replace(offsets=tuple(o + s for o, s in zip(box.offsets, ref.tp.offset)))
                 for box in boxes)


def dtensor_placements(bucket, slot):
    """The DTensor placements of a slot on its bucket's mesh ((Replicate(),
    Shard(d)) under HSDP), or None when its pieces are not DTensor chunks."""
    dshard = dtensor_shard(slot.placement, slot.shape, bucket.world_size)
    if dshard is not None and not shards_in_rank_order(bucket.mesh):
        dshard = None  # a DTensor would place the pieces by mesh position: give the boxes
    if dshard is None or bucket.mesh.ndim == 1:
        return None if dshard is None else (dshard,)
    from torch.distributed.tensor import Replicate

    return (Replicate(), dshard)


def _contiguous_stride(shape) -> tuple:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def check_value_shape(key: str, value, ref: SlotRef, what: str = "load_state_dict") -> None:
    """ValueError naming `key` when `value` is not a tensor of the full shape."""
    shape = ref.shape
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: {key!r} is a {type(value).__name__}, expected a tensor of "
                        f"shape {shape}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{what}: {key!r} has shape {tuple(value.shape)} but the parameter is "
                         f"{shape}; load a checkpoint of the same model")


def local_value(state: FlexShardState, ref: SlotRef, key: str, value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a full-shape `value` (ShardedPieces, DTensor or a
    full tensor). A DTensor of another layout is gathered (a collective)."""
    from torch.distributed.tensor import DTensor

    slot, bucket = ref.slot, ref.bucket
    local_shape = slot.local_shapes[bucket.rank]
    if isinstance(value, ShardedPieces):
        if value.boxes != slot_boxes(ref):
            raise ValueError(f"{key!r} holds the pieces of another layout; load a sharded "
                             "checkpoint with torch.distributed.checkpoint.load into "
                             "model.state_dict(), or pass full tensors")
        return value.local
    if isinstance(value, DTensor):
        same = (bucket.mesh is not None and value.device_mesh == bucket.mesh and ref.tp is None
                and tuple(value.placements) == dtensor_placements(bucket, slot))
        if same and tuple(value.to_local().shape) == tuple(local_shape):
            return value.to_local()
        value = value.full_tensor()
    if ref.tp is not None:
        value = ref.tp.local_of(value)
    if bucket.mesh is None:
        return value
    return slot.placement.shard(value, bucket.rank, bucket.world_size)


# Module hooks: on every module that registers a sharded param (tied aliases
# included), so the state dict of any submodule carries full shapes too.


def _check_sharded(bucket) -> None:
    held = "" if bucket.held is None else " (model.unshard() holds it: call model.reshard() first)"
    if bucket.state != BucketState.SHARDED:
        raise RuntimeError(f"bucket {bucket.name!r} is {bucket.state.value}{held}: state dicts "
                           "are only available outside forward and backward")


class _OwnerHooks:
    """State-dict hooks of one module for its sharded params (attr -> SlotRef)."""

    def __init__(self, state: FlexShardState, refs: dict) -> None:
        self.state, self.refs = state, refs

    def state_dict_post(self, module, state_dict, prefix, local_metadata) -> None:
        for attr, ref in self.refs.items():
            key = prefix + attr
            if key in state_dict:
                _check_sharded(ref.bucket)
                ref.bucket.check_viewed(ref.index)  # a tensor swapped in would save old values
                value = state_dict[key]  # the Parameter itself under keep_vars=True
                state_dict[key] = sharded_value(self.state, ref, value.detach(), key)
                if value.requires_grad:  # keep_vars: which params train, as torch tells
                    state_dict[key].requires_grad_(True)

    def load_pre(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                 unexpected_keys, error_msgs) -> None:
        present = {prefix + a: ref for a, ref in self.refs.items() if prefix + a in state_dict}
        if present and local_metadata.get(ASSIGN_METADATA_KEY, False):
            raise NotImplementedError(
                "load_state_dict(assign=True) would replace flexshard's sharded parameters, "
                "which are views into their bucket's storage; call "
                "load_state_dict(state_dict) without assign")
        for key, ref in present.items():
            _check_sharded(ref.bucket)
            check_value_shape(key, state_dict[key], ref)
        for key, ref in present.items():
            state_dict[key] = local_value(self.state, ref, key, state_dict[key])


def _owner_refs(state: FlexShardState) -> list:
    """[(module, {attr: SlotRef})] for every module registering a sharded param."""
    owners: dict = {}
    for bucket in state.buckets:
        for index, wiring in enumerate(bucket.wiring):
            for module, attr in wiring.aliases:
                owners.setdefault(id(module), (module, {}))[1][attr] = SlotRef(bucket, index)
    return list(owners.values())


# Optimizer hooks.


class StateDictHooks:
    """The state-dict hooks of one wrapped model: on its root module, and on
    each optimizer that steps its sharded parameters."""

    def __init__(self, module: nn.Module, state: FlexShardState, optimizers) -> None:
        self.optimizers = optimizers  # optimizer_state.OptimizerHooks
        # first: it must see the full tensors before the owners' hooks take their pieces
        self.handles: list = [module.register_load_state_dict_pre_hook(
            functools.partial(_full_values_agree, state))]
        for owner, owned in _owner_refs(state):
            hooks = _OwnerHooks(state, owned)
            self.handles += [  # a partial: torch tags the hook, a bound method takes no tag
                owner.register_state_dict_post_hook(functools.partial(hooks.state_dict_post)),
                owner.register_load_state_dict_pre_hook(hooks.load_pre)]

    def remove(self) -> None:
        for handle in self.handles + self.optimizers.optimizer_handles:
            handle.remove()


def _full_values_agree(state: FlexShardState, module, state_dict, prefix, *args) -> None:
    """load_state_dict's pre-hook on the root: when the state dict holds full
    plain tensors for sharded params (each rank's own source), every rank checks
    that the ranks hold the same values before any piece is copied."""
    from torch.distributed.tensor import DTensor

    names = names_by_slot(module, state)
    found = {fqn: next((state_dict[prefix + n] for n in aliases if prefix + n in state_dict),
                       None) for fqn, aliases in names.items()}
    full = {fqn: v for fqn, v in found.items() if isinstance(v, torch.Tensor)
            and not isinstance(v, (ShardedPieces, DTensor))}
    if not full:  # DCP's and DSD's sharded values: nothing read from a full source
        return
    refs = {ref.slot.fqn: ref for ref in slot_refs(state).values()}
    sums = [UNCOMPARED if group_values(refs[fqn]) else ABSENT if fqn not in full else
            checksum(lambda s, v=full[fqn]: v if s is None else v[s], full[fqn].shape)
            for fqn in names]
    check_sources_agree(state, [aliases[0] for aliases in names.values()], sums, None,
                        "load_state_dict")


# Full state dicts.


def full_state_dict(module: nn.Module) -> dict:
    """The unwrapped model's state_dict() on every rank: every key of it (tied
    parameters under each of their names, persistent buffers; no wrapper's
    `_checkpoint_wrapped_module.` or `_orig_mod.`) as a full tensor. A buffer
    is this rank's own (buffers are not sharded). Collective: one gather per
    bucket (under tensor parallelism, then one gather over tp per DTensor param)."""
    state = get_state(module)
    check_call(state, "fs.full_state_dict")  # every rank is here, not one alone
    fulls = {}
    with torch.no_grad():
        for bucket in state.buckets:
            gathered = bucket.gather.gather(bucket.storage.layout)
            specs = [w.tp for w in bucket.wiring]
            for slot, full, spec in zip(bucket.slots, gathered, specs):
                fulls[slot.fqn] = full.clone() if spec is None else spec.full_of(full)
    slots = named_slots(module, state)
    out = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        ref = slots.get(name)  # a tied name shares its tensor, as in the plain state dict
        out[state_dict_name(module, name)] = (fulls[ref.slot.fqn] if ref is not None
                                              else param.detach().clone())
    out.update({key: buf.detach().clone() for key, buf in persistent_buffers(module).items()})
    return out


def load_full_state_dict(module: nn.Module, state_dict: dict) -> None:
    """Load full tensors (keyed as the unwrapped model's state dict, or as
    named_parameters() names them) into the sharded parameters, and the
    persistent buffers the state dict holds into the module's. A tied
    parameter loads from any of its names; the state dict of the unwrapped
    model, which holds every name of it, is accepted when those tensors are
    equal. Collective (one small all-gather): before anything is written, the
    ranks compare checksums of their parameters, and every rank raises a
    ValueError naming the tensors that differ (checkpoint/agreement.py).
    Buffers are not sharded: each rank loads its own source's, as
    full_state_dict gives each rank its own."""
    state = get_state(module)
    names = names_by_slot(module, state)
    buffers = buffer_names(module)
    entries = [aliases[0] for aliases in names.values()] + list(buffers)  # alike on every rank
    found, sums, error = None, [], None
    try:  # a failure here is raised after the collective, so no rank waits in it
        found = _check_full_state_dict(state, names, buffers, state_dict)
        refs = {ref.slot.fqn: ref for ref in slot_refs(state).values()}
        sums = [UNCOMPARED if group_values(refs[fqn]) else _full_checksum(state_dict, keys[0])
                for fqn, keys in found.params.items()]
        sums += [ABSENT if key is None else PRESENT for key in found.buffers.values()]
    except Exception as e:  # noqa: BLE001 (re-raised as it is by check_sources_agree)
        error = e
    check_sources_agree(state, entries, sums, error, "load_full_state_dict")
    _load_buffers(buffers, found.buffers, state_dict)
    refs = {ref.slot.fqn: ref for ref in slot_refs(state).values()}
    for bucket in state.buckets:
        bucket.load_full(lambda fqn: _tp_local(refs[fqn], state_dict[found.params[fqn][0]]))


class _Found(NamedTuple):
    """The keys of a full state dict: slot FQN -> the names of it the state
    dict holds; buffer state-dict name -> the key holding it (None: absent)."""

    params: dict
    buffers: dict


def _check_full_state_dict(state, names: dict, buffers: dict, state_dict: dict) -> _Found:
    """Every check before load_full_state_dict writes: keys, shapes, tied values."""
    present = {fqn: [n for n in aliases if n in state_dict] for fqn, aliases in names.items()}
    missing = sorted(names[fqn][0] for fqn, found in present.items() if not found)
    known = {n for aliases in list(names.values()) + [a for _, a in buffers.values()]
             for n in aliases}
    unexpected = sorted(set(state_dict) - known)
    if missing or unexpected:
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys "
                       f"{unexpected}; the state dict must hold every parameter of the module "
                       "(a tied parameter under one or more of its names) and may hold its "
                       "persistent buffers")
    shapes = {ref.slot.fqn: ref.shape for ref in slot_refs(state).values()}
    for fqn, found in present.items():
        for key in found:
            if tuple(state_dict[key].shape) != tuple(shapes[fqn]):
                raise ValueError(f"load_full_state_dict: {key!r} has shape "
                                 f"{tuple(state_dict[key].shape)} but the parameter is "
                                 f"{tuple(shapes[fqn])}")
        check_tied_values(found, state_dict.__getitem__, "load_full_state_dict")
    held = {name: next((a for a in aliases if a in state_dict), None)
            for name, (_, aliases) in buffers.items()}
    _check_buffer_shapes(buffers, held, state_dict)
    return _Found(present, held)


def _full_checksum(state_dict: dict, key: str) -> int:
    """The agreement checksum of state_dict[key]."""
    value = state_dict[key]
    return checksum(lambda slices: value if slices is None else value[slices], value.shape)


def persistent_buffers(module: nn.Module) -> dict:
    """State-dict name -> buffer, for the buffers a state dict holds
    (non-persistent ones left out)."""
    return {name: buf for name, (buf, _) in buffer_names(module).items()}


def buffer_names(module: nn.Module) -> dict:
    """State-dict name -> (persistent buffer, the names a source may hold it
    under: that one, then named_buffers()' where a wrapper makes it differ)."""
    out = {}
    for prefix, sub in module.named_modules():
        for attr in persistent_buffer_names(sub):
            raw = f"{prefix}.{attr}" if prefix else attr
            name = state_dict_name(module, raw)
            out[name] = (getattr(sub, attr), list(dict.fromkeys([name, raw])))
    return out


def _check_buffer_shapes(buffers: dict, held: dict, state_dict: dict) -> None:
    for name, key in held.items():
        buf = buffers[name][0]
        if key is not None and tuple(state_dict[key].shape) != tuple(buf.shape):
            raise ValueError(f"load_full_state_dict: buffer {key!r} has shape "
                             f"{tuple(state_dict[key].shape)} in the state dict but "
                             f"{tuple(buf.shape)} in the module; load a state dict of the same "
                             "model configuration")


def _load_buffers(buffers: dict, held: dict, state_dict: dict) -> None:
    """Copy the persistent buffers `state_dict` holds into the module's, in place."""
    with torch.no_grad():
        for name, key in held.items():
            if key is not None:
                buffers[name][0].copy_(state_dict[key])


def _tp_local(ref: SlotRef, full: torch.Tensor) -> torch.Tensor:
    """A full tensor as the slot holds it: its TP-local block for a DTensor param."""
    return full if ref.tp is None else ref.tp.local_of(full)


def names_by_slot(module: nn.Module, state: FlexShardState) -> dict:
    """slot FQN -> every name of that sharded param (tied aliases included):
    the state dict's names first, then named_parameters()' (`named_slots`)."""
    out: dict = {}
    for name, ref in named_slots(module, state).items():
        out.setdefault(ref.slot.fqn, []).append(name)
    return out


def check_tied_values(keys: list, read, what: str) -> None:
    """ValueError naming two keys of one tied parameter whose tensors differ
    (`read(key)` gives a key's tensor, or the part of it this rank reads)."""
    first = read(keys[0]) if len(keys) > 1 else None
    for key in keys[1:]:
        if not torch.equal(read(key), first):
            raise ValueError(f"{what}: {keys[0]!r} and {key!r} name one tied parameter but "
                             "hold different values; tie the weights before saving, or keep "
                             "only one of the keys")
