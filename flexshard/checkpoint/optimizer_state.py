"""Optimizers' state dicts: the first `step()` of an optimizer that updates a
wrapped model's sharded parameters attaches state-dict hooks to it, so
`optimizer.state_dict()` (and DCP's `get_state_dict(model, optimizer)`) wraps
per-element state (AdamW's exp_avg/exp_avg_sq, SGD's and Muon's momentum_buffer)
as the model's state dict wraps the params; `fs.full_optimizer_state_dict` gathers
it full. Exports check first, on every rank alike, what they cannot take.
"""

from __future__ import annotations

import weakref
import zlib

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..optim import check_optimizer
from ..runtime.hooks import check_call
from ..runtime.state import FlexShardState, get_state
from .pieces import ShardedPieces
from .state_dict import SlotRef, check_value_shape, local_value, sharded_value, slot_refs


def _param_keys(optimizer: torch.optim.Optimizer, state_dict: dict) -> list:
    """(key in state_dict["state"], param) pairs, matched by group order."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keys = [k for g in state_dict["param_groups"] for k in g["params"]]
    return list(zip(keys, params))


class _StepPreHook:
    """The one global optimizer step pre-hook of the process: it hands each
    stepping optimizer to every live wrapped model's OptimizerHooks.

    Registered once, on first use, and never removed: removing a global hook
    while torch iterates them (a model collected mid-step) would raise
    "OrderedDict mutated during iteration" in someone's optimizer.step(). The
    models are held weakly, so a collected model simply leaves the set."""

    def __init__(self) -> None:
        self._models: weakref.WeakSet = weakref.WeakSet()
        self.handle = None

    def add(self, hooks: "OptimizerHooks") -> None:
        if self.handle is None:
            self.handle = register_optimizer_step_pre_hook(self._on_step)
        self._models.add(hooks)

    def _on_step(self, optimizer, args, kwargs) -> None:
        for hooks in list(self._models):  # a snapshot: GC may shrink the set meanwhile
            hooks.attach(optimizer)


_STEP_PRE_HOOK = _StepPreHook()  # per process, like torch's own global hook registry


class OptimizerHooks:
    """Attaches state-dict hooks to each optimizer that steps a wrapped
    model's sharded parameters (found through the process's step pre-hook)."""

    def __init__(self, state: FlexShardState) -> None:
        self._state = weakref.ref(state)  # once the model is gone, every hook is a no-op
        # optimizer -> how many params it held when checked: a group added later
        # (add_param_group after the first step) is checked at the next step
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._hooked: weakref.WeakSet = weakref.WeakSet()
        self.optimizer_handles: list = []
        _STEP_PRE_HOOK.add(self)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Check `optimizer`'s params (again when it holds more), and hook it once it
        holds any of the model's sharded params."""
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        if self._seen.get(optimizer) == count:
            return
        self._seen[optimizer] = count
        state = self._state()
        if state is None:
            return
        refs = slot_refs(state)
        mine = [refs[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in refs]
        check_optimizer(optimizer, [(r.bucket, r.slot, r.tp is not None and r.tp.sharded_over_tp)
                                    for r in mine])
        if mine and optimizer not in self._hooked:
            self._hooked.add(optimizer)
            self.optimizer_handles += [
                optimizer.register_state_dict_post_hook(self._state_dict_post_hook),
                optimizer.register_load_state_dict_pre_hook(self._load_pre_hook)]
            self._keep_local_pieces(optimizer, state, refs)

    def _keep_local_pieces(self, optimizer, state, refs: dict) -> None:
        """State an optimizer loaded before its hooks attached (the resume
        pattern `new.load_state_dict(old.state_dict())` before new's first
        step) holds full-shape values: keep this rank's pieces of them, as the
        load hook would have. Each piece is the loaded value's own local
        tensor (shared with `old`, as torch's load shares plain tensors)."""
        for param in (p for g in optimizer.param_groups for p in g["params"]):
            ref, entry = refs.get(id(param)), optimizer.state.get(param)
            if ref is not None and entry:
                optimizer.state[param] = {
                    name: self._unwrap(state, ref, param, f"{ref.slot.fqn}.{name}", value)
                    for name, value in entry.items()}

    def _state_dict_post_hook(self, optimizer, state_dict: dict) -> dict:
        state = self._state()
        if state is None:  # the model is gone
            return state_dict
        refs = slot_refs(state)
        for key, param in _param_keys(optimizer, state_dict):
            ref = refs.get(id(param))
            if ref is not None and key in state_dict["state"]:
                state_dict["state"][key] = {  # a new dict: the optimizer's own is live state
                    name: self._wrap(state, ref, param, name, value)
                    for name, value in state_dict["state"][key].items()}
        return state_dict

    def _wrap(self, state, ref: SlotRef, param, name: str, value):
        if not isinstance(value, torch.Tensor) or name == "step":  # step: same on every rank
            return value
        if value.shape == param.shape:
            return sharded_value(state, ref, value, f"{ref.slot.fqn}.{name}")
        if value.dim() == 0:
            return value
        raise NotImplementedError(_unreshardable(name, ref.slot.fqn, value, param))

    def _load_pre_hook(self, optimizer, state_dict: dict) -> dict:
        state = self._state()
        if state is None:
            return state_dict
        refs = slot_refs(state)
        new_state = dict(state_dict["state"])
        for key, param in _param_keys(optimizer, state_dict):
            ref = refs.get(id(param))
            if ref is not None and key in new_state:
                fqn = ref.slot.fqn  # not by id(param): to_empty/.to make new param objects
                new_state[key] = {name: self._unwrap(state, ref, param, f"{fqn}.{name}", value)
                                  for name, value in new_state[key].items()}
        state_dict["state"] = new_state
        return state_dict

    def _unwrap(self, state, ref: SlotRef, param, key: str, value):
        if not isinstance(value, torch.Tensor) or key.endswith(".step"):
            return value
        from torch.distributed.tensor import DTensor

        if not isinstance(value, (ShardedPieces, DTensor)) and (
                value.shape == param.shape or value.dim() == 0):
            return value  # already this rank's piece, or a scalar
        check_value_shape(key, value, ref, "optimizer.load_state_dict")
        # a full tensor's piece may be a strided view (Shard(1)'s columns), which
        # torch's fused optimizers read as if dense: state is laid out as the param
        return local_value(state, ref, key, value).contiguous()


def _unreshardable(name: str, fqn: str, value: torch.Tensor, param) -> str:
    return (f"optimizer state {name!r} of parameter {fqn!r} has shape {tuple(value.shape)}, "
            f"not the sharded parameter's {tuple(param.shape)}; flexshard reshards only "
            "per-element optimizer state (AdamW, SGD, Muon momentum): a Shampoo "
            "preconditioner or Adafactor's factors cannot be exported or checkpointed through "
            "it (the model's params can: fs.save_checkpoint(directory, model))")


def check_optimizer_export(state, optimizer, site: str, same_params: bool = True) -> None:
    """Before `site` exports `optimizer`'s state, on every rank alike: no rank holds
    state flexshard cannot reshard (the owner alone raised, the others waited), and
    (`same_params`) the ranks' optimizers hold the same params (a list filtered by
    p.numel() does not, under Owned: each rank's export held only its own; DCP's
    checkpoints take such lists)."""
    refs = slot_refs(state)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = [[refs[id(p)].slot.fqn if id(p) in refs else "" for p in g["params"]]
             for g in optimizer.param_groups] if same_params else []
    problem = next((_unreshardable(n, refs[id(p)].slot.fqn, v, p) for p in params if id(p) in refs
                    for n, v in optimizer.state.get(p, {}).items()
                    if isinstance(v, torch.Tensor) and n != "step" and v.dim()
                    and v.shape != p.shape), None)
    agreed = check_call(state, site, zlib.crc32(repr(names).encode()), problem is not None)
    if problem is not None:
        raise NotImplementedError(problem)
    if agreed and agreed[1][0]:
        raise NotImplementedError(f"{site}: another rank's optimizer holds state flexshard cannot "
                                  "reshard (its error names it); every rank refuses the export")
    if agreed and agreed[0][0] != agreed[0][1]:
        raise ValueError(
            f"{site}: the optimizer holds different params on different ranks (this rank: "
            f"{len(params)}); build it over the same params on every rank, empty pieces "
            "included (model.parameters(), not a list filtered by p.numel())")


def full_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with each value shaped like a sharded param made
    the full tensor, as a one-process optimizer's, on every rank (torch.save it
    on rank 0). `optimizer.load_state_dict` of it reshards to any world size and
    placement. Collective: one gather per bucket and state name (the names
    agreed by one small object all-gather)."""
    import torch.distributed as dist

    state = get_state(module)
    check_optimizer_export(state, optimizer, "fs.full_optimizer_state_dict")  # every rank here
    out = optimizer.state_dict()
    refs, mine = slot_refs(state), {}
    for key, param in _param_keys(optimizer, out):
        ref, entry = refs.get(id(param)), optimizer.state.get(param, {})
        if ref is not None:
            mine[id(param)] = (key, entry)
    names = [sorted({n for p in b.params for n, v in mine.get(id(p), (None, {}))[1].items()
                     if n != "step" and _shaped_like(v, p)}) for b in state.buckets]
    group = state.mesh_group
    if group is not None and dist.get_world_size(group) > 1:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, names, group=group)
        names = [sorted(set().union(*(r[i] for r in every))) for i in range(len(names))]
    for bucket, bucket_names in zip(state.buckets, names):
        for name in bucket_names:
            pieces = [_state_piece(mine.get(id(p)), name, p) for p in bucket.params]
            fulls = bucket.gather.gather_pieces(pieces)
            for param, piece, full, wiring in zip(bucket.params, pieces, fulls, bucket.wiring):
                if piece is not None:
                    key = mine[id(param)][0]
                    out["state"][key] = {**out["state"][key], name: full if wiring.tp is None
                                         else wiring.tp.full_of(full)}
    return out


def _state_piece(found, name: str, param):
    """This rank's piece of a param's optimizer state `name`, or None."""
    value = found[1].get(name) if found is not None else None
    return value if _shaped_like(value, param) else None


def _shaped_like(value, param) -> bool:
    """Whether an optimizer state value is a tensor shaped like its param's
    piece (so sharded like it), not a scalar such as a step count."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape
