"""The bucket plan: automatic BucketSpecs before wrapping, a readable report after.

`plan_buckets` walks the module tree in execution order (traced from one
forward on `example_inputs`, else registration order): a module whose
parameters fit the byte budget becomes one bucket; a module that does not fit
keeps its own parameters, plus those of children that still fit alongside
them, in its bucket, and recurses into the other children. Children of a
container (ModuleList, ModuleDict) are never merged, so each bucket runs on
the deepest module that can run it (merging blocks would move their gather
up to the container's parent).

`describe` reports what flex_shard made of a model: a ShardingPlan of one
BucketPlan per bucket, printable as a table.
"""

from __future__ import annotations

import glob
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from .bucketing import CONTAINERS
from .config import BucketSpec
from .state import find_state, get_state


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


# ---------------------------------------------------------------- the report


class BucketPlan(NamedTuple):
    """One bucket as flex_shard built it."""

    name: str
    module: str  # FQN of the module whose forward runs it ('' = root, None = no hooks)
    params: tuple  # FQNs
    shapes: tuple  # full shapes
    placements: tuple  # bound Placement per param
    dtypes: tuple  # storage dtype per param
    gather_dtypes: tuple  # dtype on the wire / of the unsharded param
    local_bytes: tuple  # per rank: bytes of its pieces (no padding)
    unsharded_bytes: int  # bytes of the unsharded params (gather dtype)
    padding_bytes: int  # bytes a gather moves beyond the pieces (alignment, uneven ranks)
    reshard_after_forward: bool
    gathers_per_step: int  # all-gathers in one forward + backward
    reduces_per_step: int  # reduce-scatters in one backward


class ShardingPlan(NamedTuple):
    """describe(model): the buckets in BucketSpec order; str() is a table."""

    world_size: int
    buckets: tuple

    @property
    def gathers_per_step(self) -> int:
        return sum(b.gathers_per_step for b in self.buckets)

    @property
    def reduces_per_step(self) -> int:
        return sum(b.reduces_per_step for b in self.buckets)

    def __str__(self) -> str:
        return _table(self)


def describe(module: nn.Module) -> ShardingPlan:
    """What flex_shard made of `module`: per bucket its module, parameters,
    placements, dtypes, bytes and collectives per training step (one forward
    and one backward through every bucket; a bucket regathers in backward when
    its module or an enclosing one reshards after forward)."""
    state = get_state(module)
    names = {id(m): n for n, m in module.named_modules()}
    runners = {id(b): (h.module, h.buckets) for h in state.hooks for b in h.buckets}
    resharding = {id(h.module) for h in state.hooks if any(b.reshard_after_forward for b in h.buckets)}
    rows = []
    for bucket in state.buckets:
        runner = runners.get(id(bucket))
        regather = runner is not None and _inside_region(module, runner[0], resharding, names)
        rows.append(_bucket_plan(bucket, state.world_size,
                                 None if runner is None else names.get(id(runner[0]), ""), regather))
    return ShardingPlan(state.world_size, tuple(rows))


def _inside_region(root: nn.Module, runner: nn.Module, resharding: set, names: dict) -> bool:
    """Whether backward regathers: the runner or one of its ancestors reshards."""
    parts = names[id(runner)].split(".") if names[id(runner)] else []
    return any(id(root.get_submodule(".".join(parts[:i]))) in resharding
               for i in range(len(parts) + 1))


def _bucket_plan(bucket, world_size: int, module_name, regather: bool) -> BucketPlan:
    storage, gather = bucket.storage.layout, bucket.gather_layout
    collective = module_name is not None and world_size > 1
    return BucketPlan(
        name=bucket.name, module=module_name,
        params=tuple(s.fqn for s in bucket.slots),
        shapes=tuple(tuple(s.shape) for s in bucket.slots),
        placements=tuple(s.placement for s in bucket.slots),
        dtypes=tuple(s.dtype for s in bucket.slots),
        gather_dtypes=tuple(r.dtype for r in gather.regions),
        local_bytes=tuple(sum(r.nbytes[rank] for r in storage.regions) for rank in range(world_size)),
        unsharded_bytes=gather.ideal_bytes,
        padding_bytes=gather.wire_bytes - gather.ideal_bytes,
        reshard_after_forward=bucket.reshard_after_forward,
        gathers_per_step=(1 + regather) if collective else 0,
        reduces_per_step=1 if collective and bucket.grad_slots else 0)


_COLUMNS = ("bucket", "module", "params", "dtype", "local bytes/rank", "unsharded", "padding",
            "reshard", "gathers", "reduces")


def _table(plan: ShardingPlan) -> str:
    rows = [_COLUMNS]
    for b in plan.buckets:
        dtypes = ",".join(sorted({str(d).replace("torch.", "") for d in b.gather_dtypes}))
        local = f"{min(b.local_bytes):,}..{max(b.local_bytes):,}"
        module = "-" if b.module is None else (b.module or "<root>")
        rows.append((b.name, module, str(len(b.params)), dtypes, local, f"{b.unsharded_bytes:,}",
                     f"{b.padding_bytes:,}", "yes" if b.reshard_after_forward else "no",
                     str(b.gathers_per_step), str(b.reduces_per_step)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for b in plan.buckets:
        lines.append(f"{b.name}:")
        for fqn, shape, pl, dt in zip(b.params, b.shapes, b.placements, b.dtypes):
            lines.append(f"  {fqn}  {tuple(shape)}  {pl!r}  {str(dt).replace('torch.', '')}")
    lines.append(f"world size {plan.world_size}: {plan.gathers_per_step} all-gathers and "
                 f"{plan.reduces_per_step} reduce-scatters per step")
    return "\n".join(lines)
