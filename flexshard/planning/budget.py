"""BucketSpecs under a byte budget: the grouping, from parameter sizes and an
execution order (dry_run/plan_buckets.py's `plan_buckets` measures both from a module).

A module whose parameters fit the byte budget becomes one bucket; a module that
does not fit keeps its own parameters, plus those of children that still fit
alongside them, in its bucket, and recurses into the other children. Children
of a container (ModuleList, ModuleDict) are never merged, so each bucket runs on
the deepest module that can run it (merging blocks would move their gather up
to the container's parent).
"""

from __future__ import annotations

import torch.nn as nn

from .assign import CONTAINERS


def budget_groups(module: nn.Module, order: dict, bucket_bytes: int) -> list:
    """(name, fqns) per bucket of `module`, in execution order (`order`: id(submodule)
    -> its rank in execution order), each within `bucket_bytes` unless one module's
    own parameters exceed it."""
    canonical = {id(p): fqn for fqn, p in module.named_parameters()}
    planner = _Planner(canonical, order, bucket_bytes, dict(module.named_parameters()))
    return planner.groups(module, "")


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
