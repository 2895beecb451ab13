"""The user's Parameter objects stay the model's parameters across wrapping.

A bucket's sharded params are views into its storage buffer, and they must share
the buffer's version counter (the gather and the reshard checks read it), which
`param.data = view` would not. So flex_shard swaps each original Parameter's
tensor for its view (torch.utils.swap_tensors): the object the user holds (in an
optimizer built before flex_shard, in a dict of named_parameters(), in a
parameter group) becomes the sharded param, in place. Its attributes and its
gradient hooks stay with it. A param the swap cannot take (a tensor subclass, a
DTensor, one with weak references or held by an autograd graph) is replaced by
a new object, as FSDP2 does, and remembered: an optimizer that steps it raises
(see `mark_stale`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..compat import POST_ACCUMULATE_GRAD_HOOKS

_BACKWARD_HOOKS = "_backward_hooks"  # Tensor.register_hook's dict (a public attribute)


def adopt(original: torch.Tensor, new: nn.Parameter) -> Optional[nn.Parameter]:
    """`original` made into `new` (same object, `new`'s tensor: a view of the
    storage) and returned, its attributes and hooks kept; None when it cannot
    be (then `new` stands in for it)."""
    if type(original) is not nn.Parameter or type(new) is not nn.Parameter:
        return None  # a subclass or DTensor: swapping would change its class
    attrs = original.__dict__
    hooks = {name: getattr(original, name) for name in (_BACKWARD_HOOKS, POST_ACCUMULATE_GRAD_HOOKS)}
    try:  # refuses (before changing anything) a tensor with weak references or other owners
        torch.utils.swap_tensors(original, new)
    except RuntimeError:
        return None
    original.__dict__, new.__dict__ = attrs, {}  # swap_tensors moved them to `new`
    for name, value in hooks.items():
        if value is not None:  # the setters install the hooks on the new tensor
            setattr(original, name, value)
    return original


def replace_keeping(old: nn.Parameter, new: nn.Parameter) -> nn.Parameter:
    """`old` made into `new` in place (a device move, to_empty()), else `new`
    carrying `old`'s post-accumulate-grad hooks."""
    kept = adopt(old, new)
    if kept is not None:
        return kept
    hooks = getattr(old, POST_ACCUMULATE_GRAD_HOOKS, None)
    if hooks:
        setattr(new, POST_ACCUMULATE_GRAD_HOOKS, hooks)
    return new


_STALE_ATTR = "_flexshard_replaced"  # on a param flex_shard replaced: its FQN


def mark_stale(param: torch.Tensor, fqn: str) -> None:
    """Remember that `param` (the user's object) no longer trains: an optimizer
    step over it raises (see `_check_step`)."""
    param.__dict__[_STALE_ATTR] = fqn
    _install_step_check()


@functools.cache  # one global hook per process, like torch's registry of them
def _install_step_check():
    return register_optimizer_step_pre_hook(_check_step)


def _check_step(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            fqn = param.__dict__.get(_STALE_ATTR)
            if fqn is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameter {fqn!r} as it was before "
                    "flex_shard, which replaced it with its sharded param (it could not keep "
                    "the object: a tensor subclass or DTensor, or one something else "
                    "referenced); the step would train nothing. Build the optimizer after "
                    "flex_shard: opt = torch.optim.SGD(model.parameters(), ...)")
