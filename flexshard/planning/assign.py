"""Which parameters go in which bucket, which piece of each parameter every
rank holds, and which module runs each bucket."""

from __future__ import annotations

import fnmatch
import re
from typing import Sequence

import torch.nn as nn

from ..config import BucketSpec
from ..placements.contract import Placement
from ..runtime.layout import SlotPlan, bind_placements

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def default_buckets(module: nn.Module) -> list:
    """One bucket per child of every outermost nn.ModuleList, plus a root bucket."""
    specs, taken = [], []
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or any(name.startswith(t) for t in taken):
            continue
        for i, _ in enumerate(sub):
            prefix = f"{name}.{i}" if name else str(i)
            specs.append(BucketSpec(f"{prefix}.*", name=prefix))
        taken.append(f"{name}." if name else "")
    names = [fqn for fqn, _ in module.named_parameters()]
    matched = [[f for f in names if m.match(f)] for m in map(_matcher, specs)]
    claimed = {f for hits in matched for f in hits}
    specs = [s for s, hits in zip(specs, matched) if hits]
    rest = [fqn for fqn in names if fqn not in claimed]
    if rest:
        specs.append(BucketSpec(rest, name="root"))
    return specs


def _matcher(spec: BucketSpec) -> re.Pattern:
    """One compiled regex matching what any of the spec's fnmatch patterns
    matches (fnmatch.fnmatchcase per FQN and pattern is slow on big models)."""
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in spec.patterns))


def assign_params(fqns: Sequence[str], specs: Sequence[BucketSpec]) -> list:
    """The FQNs of each spec's bucket; every FQN in exactly one bucket."""
    members: list = [[] for _ in specs]
    matchers = [_matcher(s) for s in specs]
    for fqn in fqns:
        hits = [i for i, m in enumerate(matchers) if m.match(fqn)]
        if not hits:
            raise ValueError(
                f"parameter {fqn!r} matches no BucketSpec; add a pattern that matches it "
                f"(e.g. BucketSpec('{fqn}')) or a catch-all bucket")
        if len(hits) > 1:
            names = ", ".join(repr(specs[i].label) for i in hits)
            raise ValueError(
                f"parameter {fqn!r} matches several buckets ({names}); make the patterns "
                "disjoint so each parameter falls in exactly one bucket")
        members[hits[0]].append(fqn)
    for spec, names in zip(specs, members):
        if not names:
            raise ValueError(
                f"bucket {spec.label!r} (patterns {list(spec.patterns)}) matches no parameter; "
                "fix its patterns or drop the BucketSpec (patterns match FQNs as "
                "module.named_parameters() reports them)")
    return members


def plan_slots(spec: BucketSpec, names: Sequence[str], named: dict, default,
               world_size: int) -> list:
    """The SlotPlan of each of the bucket's params: its placement (the spec's,
    else `default`; a callable is asked per param) checked and bound over
    `world_size` ranks. flex_shard and the dry run both plan through here."""
    choice = spec.placement if spec.placement is not None else default
    entries = []
    for fqn in names:
        param = named[fqn]
        placement = choice if isinstance(choice, Placement) else choice(fqn, param)
        if not isinstance(placement, Placement):
            raise TypeError(f"the placement callable of bucket {spec.label!r} returned "
                            f"{placement!r} for parameter {fqn!r}; it must return a Placement "
                            "such as fs.Shard(0)")
        try:
            placement.check(param.shape, world_size)
        except ValueError as e:
            raise ValueError(f"parameter {fqn!r} in bucket {spec.label!r}: {e}") from None
        entries.append((param.shape, param.dtype.itemsize, placement))
    bound = bind_placements(entries, world_size)
    return [SlotPlan(fqn, named[fqn].shape, named[fqn].dtype, pl,
                     tuple(pl.local_shape(named[fqn].shape, r, world_size)
                           for r in range(world_size)))
            for fqn, pl in zip(names, bound)]


def param_aliases(module: nn.Module) -> dict:
    """id(param) -> [(owner module, attr, owner FQN)] for every place a parameter is
    registered, a shared submodule under each of its paths (so the running module
    covers every path that calls it)."""
    aliases: dict = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is not None:
                aliases.setdefault(id(p), []).append((mod, attr, mod_name))
    return aliases


def claimed_elsewhere(aliases: Sequence[tuple], specs: Sequence[BucketSpec], own: int) -> list:
    """(alias FQN, bucket label) for each alias of a parameter of bucket `own`
    whose FQN another bucket's patterns match (a tied or shared parameter
    the user's buckets split)."""
    out = []
    for _, attr, owner in aliases:
        fqn = f"{owner}.{attr}" if owner else attr
        for i, spec in enumerate(specs):
            if i != own and any(fnmatch.fnmatchcase(fqn, p) for p in spec.patterns):
                out.append((fqn, spec.label))
    return out


def running_module(root: nn.Module, owner_fqns: Sequence[str]) -> nn.Module:
    """The smallest module whose forward runs all `owner_fqns`: their deepest
    common ancestor, moved up past containers that have no forward."""
    parts = [f.split(".") if f else [] for f in owner_fqns]
    common: list = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    while True:
        mod = root.get_submodule(".".join(common))
        if not common or not isinstance(mod, CONTAINERS):
            return mod
        common.pop()


def reshards_after_forward(spec: BucketSpec, default: bool, runner: nn.Module,
                           root: nn.Module) -> bool:
    """The spec's reshard_after_forward, else `default`, except that the root
    module's bucket keeps its params by default (backward needs them first)."""
    if spec.reshard_after_forward is not None:
        return spec.reshard_after_forward
    return default and runner is not root


def _within(fqn: str, ancestor: str) -> bool:
    return not ancestor or fqn == ancestor or fqn.startswith(ancestor + ".")


def used_in_nested_runner(owner_fqns: Sequence[str], runner: str, runners: Sequence[str]) -> bool:
    """Whether a module registering one of a bucket's params (`owner_fqns`)
    lies inside another running module nested in the bucket's own (`runner`):
    a shared module or tied param used inside another bucket's forward."""
    return any(other != runner and _within(other, runner) and _within(owner, other)
               for owner in owner_fqns for other in runners)
