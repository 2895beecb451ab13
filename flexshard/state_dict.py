"""Full (unsharded) state dicts of a wrapped module."""

from __future__ import annotations

import torch
import torch.nn as nn

from .state import get_state


def full_state_dict(module: nn.Module) -> dict:
    """Full parameters on every rank, keyed by the original FQNs (one gather per bucket)."""
    out = {}
    with torch.no_grad():
        for bucket in get_state(module).buckets:
            fulls = bucket.gather_params(bucket.storage.layout)
            for slot, full in zip(bucket.slots, fulls):
                out[slot.fqn] = full.clone()
    return out


def load_full_state_dict(module: nn.Module, state_dict: dict) -> None:
    """Load full tensors (keyed by FQN) into the sharded parameters; no collective."""
    state = get_state(module)
    expected = {s.fqn: s.shape for b in state.buckets for s in b.slots}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys "
                       f"{unexpected}; the state dict must hold exactly the module's parameters")
    for fqn, shape in expected.items():
        if tuple(state_dict[fqn].shape) != tuple(shape):
            raise ValueError(f"load_full_state_dict: {fqn!r} has shape "
                             f"{tuple(state_dict[fqn].shape)} but the parameter is {tuple(shape)}")
    for bucket in state.buckets:
        bucket.load_full(lambda fqn: state_dict[fqn])
