"""Full gradients and their norms by FQN, for debugging and logging (collectives,
like fs.full_state_dict: every rank calls them)."""

from __future__ import annotations

import numbers

import torch
import torch.nn as nn
from torch.profiler import record_function

from .runtime.hooks import check_call
from .runtime.sharded_grad import complete_norms, piece_norm, plain
from .runtime.state import get_state
from .wrap.names import state_dict_name


def full_grads(module: nn.Module) -> dict:
    """FQN -> the full gradient of each parameter of a flex_shard-ed `module`
    (as the unwrapped model's `.grad` after the same steps, keyed as its
    state dict: no wrapper's `_checkpoint_wrapped_module.`), on every rank;
    None where no rank has one. One small all-reduce and one all-gather per
    bucket (under tensor parallelism, then one gather over tp per DTensor param)."""
    out, keys, state = {}, _state_dict_keys(module), get_state(module)
    check_call(state, "fs.full_grads")  # every rank is here, not one alone
    for bucket in state.buckets:
        pieces = _agreed_grads(bucket, "full_grads")
        fulls = bucket.gather.gather_pieces([plain(g) if g is not None else None for g in pieces])
        specs = [w.tp for w in bucket.wiring]
        for param, slot, grad, full, spec in zip(bucket.params, bucket.slots, pieces, fulls,
                                                 specs):
            key = keys.get(id(param), slot.fqn)
            out[key] = None if grad is None else full if spec is None else spec.full_of(full)
    return out


def _state_dict_keys(module: nn.Module) -> dict:
    """id(param) -> its name in the unwrapped model's state dict (a tied
    param's first name; wrap/names.py)."""
    return {id(p): state_dict_name(module, name) for name, p in module.named_parameters()}


def grad_norms(module: nn.Module, norm_type: float = 2.0) -> dict:
    """FQN -> the `norm_type` norm of each parameter's full gradient (a 0-d
    float32 tensor, the same on every rank; None where no rank has a grad):
    per bucket one small all-reduce, then one all-reduce per group of ranks for
    the whole model, with no full gradient built."""
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real) or norm_type == 0:
        raise ValueError(f"grad_norms: norm_type must be a nonzero number (1, 2, inf, ...), "
                         f"got {norm_type!r}")
    fqns, local, specs, out, keys = [], [], [], {}, _state_dict_keys(module)
    for bucket in get_state(module).buckets:
        for i, grad in enumerate(_agreed_grads(bucket, "grad_norms")):
            key = keys.get(id(bucket.params[i]), bucket.slots[i].fqn)
            out[key] = None
            if grad is None:
                continue
            fqns.append(key)
            local.append(piece_norm(plain(grad), float(norm_type), torch.float32))
            spec = bucket.wiring[i].norms
            specs.append(None if spec is None else spec._replace(refusal=None))
    with record_function("FlexShard::grad_norms"):
        out.update(zip(fqns, complete_norms(local, specs, float(norm_type), agreed=True)))
    return out


def _agreed_grads(bucket, what: str) -> list:
    """The bucket's sharded grads (None per slot without one), checked to be
    None on every rank of the bucket alike (one all-reduce of flags)."""
    grads = [p.grad for p in bucket.params]
    if bucket.world_size == 1:
        return grads
    flags = torch.tensor([g is not None for g in grads], dtype=torch.int32,
                         device=bucket.compute_device)
    bucket.comm.all_reduce(flags, bucket.group)
    for slot, count in zip(bucket.slots, flags.tolist()):
        if count not in (0, bucket.world_size):
            raise ValueError(f"fs.{what}: parameter {slot.fqn!r} (bucket {bucket.name!r}) has a "
                             f"grad on {count} of its {bucket.world_size} ranks; call it on every "
                             "rank after the same backward (did some ranks zero the grads?)")
    return grads
