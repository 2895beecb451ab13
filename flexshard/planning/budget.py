"""Automatic BucketSpecs under a byte budget, planned before wrapping.

`plan_buckets` walks the module tree in execution order (traced from one
forward on `example_inputs`, else registration order): a module whose
parameters fit the byte budget becomes one bucket; a module that does not fit
keeps its own parameters, plus those of children that still fit alongside
them, in its bucket, and recurses into the other children. Children of a
container (ModuleList, ModuleDict) are never merged, so each bucket runs on
the deepest module that can run it (merging blocks would move their gather
up to the container's parent).
"""

from __future__ import annotations

import glob
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..config import BucketSpec
from ..runtime.state import find_state
from .assign import CONTAINERS


def plan_buckets(module: nn.Module, bucket_bytes: int, *,
                 example_inputs: Optional[Sequence] = None) -> list:
    """BucketSpecs for `module` with at most `bucket_bytes` of (unsharded)
    parameters each, in execution order. A module's own parameters are never
    split, so one bucket exceeds the budget when a single module's own
    parameters do. `example_inputs` (a tuple of forward args, e.g. on the meta
    device) lets one forward record the execution order; without it,
    registration order stands in for it."""
    _check_plan_args(module, bucket_bytes, example_inputs)
    canonical = {id(p): fqn for fqn, p in module.named_parameters()}
    if not canonical:
        raise ValueError("plan_buckets: the module has no parameters to bucket")
    order = _execution_order(module, example_inputs)
    planner = _Planner(canonical, order, bucket_bytes, dict(module.named_parameters()))
    groups = planner.groups(module, "")
    return [BucketSpec([glob.escape(f) for f in fqns], name=name or "root") for name, fqns in groups]


def _check_plan_args(module, bucket_bytes, example_inputs) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"plan_buckets expects an nn.Module, got {type(module).__name__}")
    if find_state(module) is not None:
        raise ValueError("plan_buckets: the module is already wrapped by flex_shard; plan "
                         "first, then pass the specs as flex_shard(module, buckets=...)")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int):
        raise TypeError(f"plan_buckets: bucket_bytes must be an int, got {bucket_bytes!r}")
    if bucket_bytes <= 0:
        raise ValueError(f"plan_buckets: bucket_bytes must be positive, got {bucket_bytes}")
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        raise TypeError("plan_buckets: example_inputs must be a tuple of forward arguments, "
                        f"got {type(example_inputs).__name__}; wrap a single input as (x,)")


def _execution_order(module: nn.Module, example_inputs) -> dict:
    """id(submodule) -> rank in execution order (first call), uncalled ones last."""
    registered = [m for _, m in module.named_modules()]
    if example_inputs is None:
        return {id(m): i for i, m in enumerate(registered)}
    called: dict = {}

    def record(mod, args) -> None:
        called.setdefault(id(mod), len(called))

    handles = [m.register_forward_pre_hook(record) for m in registered]
    try:
        with torch.no_grad():
            module(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return {id(m): called.get(id(m), len(registered) + i) for i, m in enumerate(registered)}


class _Planner:
    """The recursive grouping of plan_buckets."""

    def __init__(self, canonical: dict, order: dict, budget: int, named: dict) -> None:
        self.order, self.budget = order, budget
        self.bytes = {fqn: p.numel() * p.element_size() for fqn, p in named.items()}
        self.owner = {fqn: fqn.rpartition(".")[0] for fqn in canonical.values()}
        self.fqns = list(canonical.values())

    def subtree(self, prefix: str) -> list:
        return [f for f in self.fqns
                if not prefix or self.owner[f] == prefix or self.owner[f].startswith(prefix + ".")]

    def size(self, fqns) -> int:
        return sum(self.bytes[f] for f in fqns)

    def groups(self, module: nn.Module, prefix: str) -> list:
        """(name, fqns) groups of `module`'s subtree, in execution order."""
        everything = self.subtree(prefix)
        if self.size(everything) <= self.budget:
            return [(self.common_owner(everything), everything)] if everything else []
        mine = [f for f in everything if self.owner[f] == prefix]
        rest: list = []
        absorb = not isinstance(module, CONTAINERS)
        children = sorted(module.named_children(), key=lambda c: self.order.get(id(c[1]), 0))
        for name, child in children:
            sub = f"{prefix}.{name}" if prefix else name
            fqns = self.subtree(sub)
            if absorb and fqns and self.size(mine) + self.size(fqns) <= self.budget:
                mine += fqns
            else:
                rest += self.groups(child, sub)
        return ([(self.common_owner(mine), mine)] if mine else []) + rest

    def common_owner(self, fqns) -> str:
        """The deepest module path holding all `fqns` (names the group)."""
        parts = [self.owner[f].split(".") if self.owner[f] else [] for f in fqns]
        common = []
        for level in zip(*parts):
            if any(x != level[0] for x in level):
                break
            common.append(level[0])
        return ".".join(common)
