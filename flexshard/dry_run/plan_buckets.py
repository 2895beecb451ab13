"""plan_buckets: automatic BucketSpecs under a byte budget, planned before
wrapping. It walks the module tree in execution order, traced from one forward
on `example_inputs` (else registration order), and groups parameters by size
(planning/budget.py)."""

from __future__ import annotations

import glob
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..config import BucketSpec
from ..planning.budget import budget_groups
from ..runtime.state import find_state


def plan_buckets(module: nn.Module, bucket_bytes: int, *,
                 example_inputs: Optional[Sequence] = None) -> list:
    """BucketSpecs for `module` with at most `bucket_bytes` of (unsharded)
    parameters each, in execution order. A module's own parameters are never
    split, so one bucket exceeds the budget when a single module's own
    parameters do. `example_inputs` (a tuple of forward args, or a dict of
    keyword args as a Hugging Face model takes them; e.g. on the meta device)
    lets one forward record the execution order; without it, registration order
    stands in for it."""
    _check_plan_args(module, bucket_bytes, example_inputs)
    if next(iter(module.parameters()), None) is None:
        raise ValueError("plan_buckets: the module has no parameters to bucket")
    groups = budget_groups(module, _execution_order(module, example_inputs), bucket_bytes)
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
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list, dict)):
        raise TypeError("plan_buckets: example_inputs must be a tuple of forward arguments "
                        "or a dict of keyword arguments, got "
                        f"{type(example_inputs).__name__}; wrap a single input as (x,)")


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
            if isinstance(example_inputs, dict):
                module(**example_inputs)
            else:
                module(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return {id(m): called.get(id(m), len(registered) + i) for i, m in enumerate(registered)}
