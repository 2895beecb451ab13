"""Which parameters go in which bucket, and which module runs each bucket."""

from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Optional, Sequence

import torch.nn as nn

from ..compat import CHECKPOINT_WRAPPED_MODULE, COMPILED_ORIG_MOD
from ..config import BucketSpec

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
WRAPPER_ATTRS = (CHECKPOINT_WRAPPED_MODULE, COMPILED_ORIG_MOD)


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


def assign_params(fqns: Sequence[str], specs: Sequence[BucketSpec],
                  aliases: Sequence[str] = ()) -> list:
    """The FQNs of each spec's bucket; every FQN in exactly one bucket, every
    pattern matching at least one FQN or one of `aliases` (the other names of
    tied or shared params: plan_wrap warns when a bucket claims one)."""
    matchers = [_matcher(s) for s in specs]
    hits = {fqn: [i for i, m in enumerate(matchers) if m.match(fqn)] for fqn in fqns}
    matched: list = [[] for _ in specs]  # per spec: the FQNs its patterns match
    for fqn, found in hits.items():
        for i in found:
            matched[i].append(fqn)
    every = list(fqns) + list(aliases)
    for spec, names in zip(specs, matched):  # a typo names itself, before its fallout
        check_patterns(spec, names, aliases, every)
    members: list = [[] for _ in specs]
    for fqn, found in hits.items():
        if not found:
            raise ValueError(
                f"parameter {fqn!r} matches no BucketSpec; add a pattern that matches it "
                f"(e.g. BucketSpec('{fqn}'), or '{fqn}' among a bucket's patterns): every "
                "parameter falls in exactly one bucket")
        if len(found) > 1:
            names = ", ".join(repr(specs[i].label) for i in found)
            raise ValueError(
                f"parameter {fqn!r} matches several buckets ({names}); make the patterns "
                "disjoint so each parameter falls in exactly one bucket")
        members[found[0]].append(fqn)
    return members


_WILDCARDS = re.compile(r"[*?[]")


def check_patterns(spec: BucketSpec, matched: Sequence[str], aliases: Sequence[str],
                   every: Sequence[str]) -> None:
    """Raise naming the first of `spec`'s patterns that matches none of the
    FQNs the spec matches (`matched`) nor, in a bucket with params, the
    `aliases`; and the names (of `every`) nearest to it."""
    if len(spec.patterns) == 1 and matched:
        return
    for pattern in spec.patterns:
        if _matches_any(pattern, matched) or (matched and _matches_any(pattern, aliases)):
            continue
        alias = next((a for a in aliases if fnmatch.fnmatchcase(a, pattern)), None)
        near = difflib.get_close_matches(pattern, _names_and_prefixes(every), n=3, cutoff=0.6)
        hint = f" (nearest: {', '.join(map(repr, near))})" if near else ""
        if alias is not None:
            hint = f" but {alias!r}, the second name of a parameter registered first elsewhere"
        raise ValueError(
            f"pattern {pattern!r} of bucket {spec.label!r} matches no parameter{hint}; fix the "
            "pattern or drop it. Patterns are fnmatch strings matched against FQNs as "
            "module.named_parameters() reports them")


def _matches_any(pattern: str, names: Sequence[str]) -> bool:
    if not _WILDCARDS.search(pattern):
        return pattern in names
    return any(fnmatch.fnmatchcase(f, pattern) for f in names)


def _names_and_prefixes(fqns: Sequence[str]) -> list:
    """The FQNs, and each module prefix as a pattern ('layers.0.*'): what a
    pattern that matches nothing was probably meant to be."""
    prefixes = {".".join(f.split(".")[:i]) + ".*" for f in fqns for i in range(1, f.count(".") + 1)}
    return list(fqns) + sorted(prefixes)


def alias_names(module: nn.Module) -> list:
    """The names params are registered under beyond their first (tied, shared)."""
    first = {fqn for fqn, _ in module.named_parameters()}
    return [fqn for fqn, _ in module.named_parameters(remove_duplicate=False) if fqn not in first]


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


def running_module(root: nn.Module, owner_fqns: Sequence[str], patterns: Sequence[str] = ()
                   ) -> nn.Module:
    """The module whose forward gathers a bucket: the one its patterns name when
    each is `"X.*"` for one module X holding every owner (as FSDP2's
    `fully_shard(X)`: X's own code may read its children's params), else the
    smallest module whose forward runs all `owner_fqns`: their deepest common
    ancestor, moved up past containers that have no forward."""
    parts = [f.split(".") if f else [] for f in owner_fqns]
    common: list = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    named = _named_module(patterns)
    if named is not None and common[:len(named)] == named:
        # past the wrappers' attributes: a checkpoint_wrapper or torch.compile wrapper
        # runs its inner module's forward, which holds the params (and is recomputed)
        while len(named) < len(common) and common[len(named)] in WRAPPER_ATTRS:
            named = common[:len(named) + 1]
        mod = root.get_submodule(".".join(named))
        if not isinstance(mod, CONTAINERS):
            return mod
    while True:
        mod = root.get_submodule(".".join(common))
        if not common or not isinstance(mod, CONTAINERS):
            return mod
        common.pop()


def checkpoint_wrappers(root: nn.Module, runner: nn.Module) -> list:
    """The modules around `runner` when an activation checkpoint wrapper holds it
    (each wrapper up the chain, a torch.compile wrapper above one included), else
    []: a user compiles the wrapper, while the bucket's hooks sit on `runner`."""
    holder = {id(getattr(m, a)): (m, a) for m in root.modules() for a in WRAPPER_ATTRS
              if isinstance(getattr(m, a, None), nn.Module)}
    chain, current = [], runner
    while id(current) in holder:
        current, attr = holder[id(current)]
        chain.append((current, attr))
    if not any(attr == CHECKPOINT_WRAPPED_MODULE for _, attr in chain):
        return []
    return [m for m, _ in chain]


def _named_module(patterns: Sequence[str]) -> Optional[list]:
    """X's path when the patterns are one `"X.*"` without other wildcards, else None."""
    if len(set(patterns)) != 1:
        return None
    (pattern,) = set(patterns)
    if not pattern.endswith(".*") or any(c in pattern[:-2] for c in "*?["):
        return None
    return pattern[:-2].split(".")


def _within(fqn: str, ancestor: str) -> bool:
    return not ancestor or fqn == ancestor or fqn.startswith(ancestor + ".")


def used_in_nested_runner(owner_fqns: Sequence[str], runner: str, runners: Sequence[str]) -> bool:
    """Whether a module registering one of a bucket's params (`owner_fqns`)
    lies inside another running module nested in the bucket's own (`runner`):
    a shared module or tied param used inside another bucket's forward."""
    return any(other != runner and _within(other, runner) and _within(owner, other)
               for owner in owner_fqns for other in runners)
