"""Parameters and modules registered on a wrapped model after flex_shard.

flex_shard shards the parameters it finds at wrap time. A parameter set later
(`layer.weight = nn.Parameter(...)`, LoRA adapters, weight tying, a resized
embedding) would be in no bucket: each rank would train its own copy with
unsynchronised gradients, and a later forward would put the bucket's param
back in its place. So every module of a wrapped model is tagged with the
model's `RegistrationGuard`, and torch's global registration hooks (one pair
per process) raise, on every rank, at the assignment itself. Re-assigning the
same sharded param, or registering a module that holds only sharded params
(an activation-checkpoint wrapper around a block), is allowed.
"""

from __future__ import annotations

import contextlib
import functools

import torch.nn as nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

_TAG = "_flexshard_registration_guard"  # in each module's __dict__: its model's guard


class RegistrationGuard:
    """One wrapped model's check of later registrations; `buckets` is the
    model's list of buckets (their params are the sharded params)."""

    def __init__(self, root: nn.Module, buckets: list) -> None:
        self.buckets, self.paused = buckets, 0
        self.names: dict = {}  # id(module) -> its FQN prefix in the model
        self.tag(root, "")
        _install_hooks()

    def __deepcopy__(self, memo):
        return None  # a copy of a submodule is no part of the model: nothing to guard

    def tag(self, module: nn.Module, prefix: str) -> None:
        for name, sub in module.named_modules(prefix=prefix.rstrip(".")):
            sub.__dict__[_TAG] = self
            self.names[id(sub)] = f"{name}." if name else ""

    @contextlib.contextmanager
    def pause(self):
        """flexshard's own registrations (init_parameters' full-size params)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    @staticmethod
    def name_in_wrapped_model(module: nn.Module):
        """`module`'s FQN in a model flex_shard wrapped ('' for its root), else None."""
        guard = module.__dict__.get(_TAG)
        return None if guard is None else guard.names.get(id(module), "?.").rstrip(".")

    def _sharded(self) -> set:
        return {id(p) for b in self.buckets for p in b.params}

    def check_parameter(self, module: nn.Module, name: str, param) -> None:
        if self.paused or param is None or module._parameters.get(name) is param:
            return
        fqn = self.names.get(id(module), "?.") + name
        what = "replaced by another" if name in module._parameters else "added as a new"
        raise ValueError(
            f"parameter {fqn!r} was {what} nn.Parameter after flex_shard; flex_shard shards "
            "the parameters it found when wrapping, so this one would train unsharded, "
            "unsynchronised across ranks. Replace, add or tie parameters before flex_shard; to "
            f"write new values into a sharded one, load them: "
            f"model.load_state_dict({{{fqn!r}: full_tensor}}, strict=False)")

    def check_module(self, parent: nn.Module, name: str, module) -> None:
        if self.paused or module is None:
            return
        prefix = f"{self.names.get(id(parent), '?.')}{name}."
        sharded = self._sharded()
        new = [f"{prefix}{n}" for n, p in module.named_parameters() if id(p) not in sharded]
        if new:
            raise ValueError(
                f"module {prefix[:-1]!r} was registered after flex_shard with parameter(s) "
                f"{new[:4]}{' ...' if len(new) > 4 else ''} that flex_shard never sharded; "
                "they would train unsharded, unsynchronised across ranks. Add or replace "
                "modules before flex_shard (a wrapper that holds only already-sharded params, "
                "such as an activation-checkpoint wrapper, may be added after)")
        self.tag(module, prefix)


def _on_parameter(module, name, param):
    guard = module.__dict__.get(_TAG)
    if guard is not None:
        guard.check_parameter(module, name, param)


def _on_module(parent, name, module):
    guard = parent.__dict__.get(_TAG)
    if guard is not None:
        guard.check_module(parent, name, module)


@functools.cache  # one pair of global hooks per process, like torch's own registry
def _install_hooks() -> tuple:
    return (register_module_parameter_registration_hook(_on_parameter),
            register_module_module_registration_hook(_on_module))
