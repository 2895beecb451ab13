"""Forward hooks on the modules that run buckets: unshard before, reshard after."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .bucket import Bucket, BucketState
from .recompute import RecomputeRegion


def _cast_floating(tree, dtype):
    if dtype is None:
        return tree

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def install_params(aliases: Sequence[Sequence[tuple]], tensors: Sequence[torch.Tensor]) -> None:
    """Point every (module, attr) alias of each slot at the given tensor."""
    for slot_aliases, tensor in zip(aliases, tensors):
        for module, attr in slot_aliases:
            module._parameters[attr] = tensor


class ModuleHooks:
    """Unshard `buckets` before `module`'s forward and reshard them after."""

    def __init__(self, module: nn.Module, buckets: Sequence[Bucket], aliases: Sequence) -> None:
        self.module, self.buckets, self.aliases = module, list(buckets), list(aliases)
        self.mp = self.buckets[0].mp
        reshard = any(b.reshard_after_forward for b in self.buckets)
        self.region = RecomputeRegion(self.buckets) if reshard else None
        self.handles = [
            module.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
            module.register_forward_hook(self.post_forward, with_kwargs=True),
            module.register_forward_hook(self.after_error, with_kwargs=True, always_call=True),
        ]

    def pre_forward(self, module, args, kwargs):
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.mp.param_dtype)
        if self.region is not None:
            self.region.enter(module, args, kwargs)
        for bucket, aliases in zip(self.buckets, self.aliases):
            install_params(aliases, bucket.unshard())
        return args, kwargs

    def post_forward(self, module, args, kwargs, output):
        self._reshard()
        if self.region is not None:
            self.region.exit()
        return _cast_floating(output, self.mp.output_dtype)

    def after_error(self, module, args, kwargs, output):
        """Runs after every forward (always_call). When the forward or a pre-hook
        raised, post_forward did not run: reshard and abort the checkpoint here so
        the module stays usable. After post_forward it finds nothing to do."""
        self._reshard()
        if self.region is not None:
            self.region.abort()

    def _reshard(self) -> None:
        for bucket, aliases in zip(self.buckets, self.aliases):
            if bucket.state is not BucketState.SHARDED:
                install_params(aliases, bucket.params)
                bucket.mark_resharded()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
