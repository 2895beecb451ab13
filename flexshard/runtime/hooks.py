"""Forward hooks on the modules that run buckets: unshard before, reshard after."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .bucket import Bucket, BucketState
from .compiled import run_eagerly
from .prefetch import Prefetcher
from .reduction import in_backward
from .reshard import SavedParams


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

    def __init__(self, module: nn.Module, buckets: Sequence[Bucket], aliases: Sequence,
                 prefetcher: Prefetcher, saved: SavedParams) -> None:
        self.module, self.buckets, self.aliases = module, list(buckets), list(aliases)
        self.prefetcher, self.queue = prefetcher, self.buckets[0].reduce_queue
        self.queue.listeners.append(self.reshard_kept)
        self.mp = self.buckets[0].mp
        self.saved = saved  # the model's registry of unsharded storages and its hooks
        self._pushed = False  # this forward pushed the saved-tensor hooks
        self._post_ran = True  # post_forward ran since the last pre_forward
        self.handles = [
            # eager even inside a compiled module: a graph break at each (runtime/compiled.py)
            module.register_forward_pre_hook(run_eagerly(self.pre_forward), with_kwargs=True),
            module.register_forward_hook(run_eagerly(self.post_forward), with_kwargs=True),
            module.register_forward_hook(run_eagerly(self.after_error), with_kwargs=True,
                                         always_call=True),
        ]

    def pre_forward(self, module, args, kwargs):
        self._post_ran = False
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.mp.param_dtype)
        for bucket in self.buckets:
            if bucket.pin_handle is not None:  # module.unshard(async_op=True) not waited yet
                bucket.pin_handle.wait()
        if in_backward():  # a recompute: the pass must end by resharding what it gathers
            self.queue.watch_backward()
        handled = torch.is_grad_enabled() and not in_backward()
        for bucket, aliases in zip(self.buckets, self.aliases):
            if bucket.pinned is not None:  # module.unshard() holds it unsharded
                bucket.check_pinned()
                continue
            outs = bucket.unshard()
            install_params(aliases, outs)
            if handled and bucket.reshard_after_forward:
                self._pushed = self._pushed or self.saved.push()
                self.saved.register(bucket, outs)
            self.prefetcher.unsharded(bucket)
        return args, kwargs

    def post_forward(self, module, args, kwargs, output):
        self._post_ran = True
        keep = torch.is_grad_enabled() and not in_backward()
        for bucket, aliases in zip(self.buckets, self.aliases):
            if bucket.pinned is not None or (keep and bucket.used_in_nested_runner
                                             and not bucket.reshard_after_forward):
                continue  # kept unsharded until backward ends (see reshard_kept)
            install_params(aliases, bucket.params)
            bucket.mark_resharded()
            self.saved.forget(bucket)
        self._pop()
        return _cast_floating(output, self.mp.output_dtype)

    def _pop(self) -> None:
        if self._pushed:
            self._pushed = False
            self.saved.pop()

    def after_error(self, module, args, kwargs, output):
        """Runs after every forward (always_call). When the forward or a pre-hook
        raised, post_forward did not run: reshard and pop the saved-tensor hooks
        here so the module stays usable. After post_forward it does nothing."""
        if self._post_ran:
            return
        self._post_ran = True
        self._reshard()
        self._pop()

    def reshard_kept(self) -> None:
        """When backward ends: reshard the buckets that kept their unsharded
        params since forward. A bucket that does not reshard after forward but
        whose params are also used inside another bucket's module (a shared
        module, a tied param) stays on the modules until then, so that module's
        recompute in backward reads the unsharded tensor it computed with."""
        self._reshard()

    def _reshard(self) -> None:
        """Sharded params back on the modules for every unsharded, unpinned bucket."""
        for bucket, aliases in zip(self.buckets, self.aliases):
            if bucket.pinned is None and bucket.state is BucketState.UNSHARDED:
                install_params(aliases, bucket.params)
                bucket.mark_resharded()
            self.saved.forget(bucket)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class RootHooks:
    """Mark where the wrapped module's forward starts (new grad routes, prefetch)
    and ends."""

    def __init__(self, module: nn.Module, prefetcher: Prefetcher, queue, buckets) -> None:
        self.module, self.prefetcher, self.queue = module, prefetcher, queue
        self.buckets = [b for b in buckets if b.needs_hooks]
        self.handles = [
            module.register_forward_pre_hook(run_eagerly(self.pre_forward), prepend=True),
            module.register_forward_hook(run_eagerly(self.post_forward), always_call=True),
        ]

    def pre_forward(self, module, args):
        if not in_backward():
            self.queue.abandon_backward()
            for bucket in self.buckets:  # first in forward, so last in backward
                bucket.new_anchor()
        self.prefetcher.begin_forward()

    def post_forward(self, module, args, output):
        self.prefetcher.end_forward()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class UnshardHandle:
    """What module.unshard(async_op=True) returns: wait() finishes the gathers
    and installs the unsharded params, which stay until module.reshard()."""

    def __init__(self, entries: Sequence[tuple]) -> None:
        self._entries = list(entries)  # (bucket, aliases), gathers launched
        for bucket, _ in self._entries:
            bucket.pin_handle = self

    def wait(self) -> None:
        """Block until every bucket is unsharded and installed (idempotent)."""
        entries, self._entries = self._entries, []
        for bucket, aliases in entries:
            bucket.pin_handle = None
            with torch.enable_grad():  # so forwards run under grad reach the reduction
                outs = bucket.unshard()
            bucket.pin(outs)
            install_params(aliases, outs)


def unshard_explicitly(entries: Sequence[tuple], async_op: bool):
    """Launch the gathers of every (bucket, aliases) entry; see UnshardHandle."""
    entries = [(b, a) for b, a in entries if b.pinned is None and b.pin_handle is None]
    for bucket, _ in entries:
        if bucket.state is not BucketState.SHARDED:
            raise RuntimeError(f"module.unshard() called while bucket {bucket.name!r} is "
                               f"{bucket.state.value} (inside its forward?); call it between steps")
    for bucket, _ in entries:
        bucket.start_gather()
    handle = UnshardHandle(entries)
    if async_op:
        return handle
    handle.wait()
    return None


def reshard_explicitly(entries: Sequence[tuple]) -> None:
    """Undo unshard_explicitly: sharded params back on the modules."""
    for bucket, aliases in entries:
        if bucket.pin_handle is not None:
            bucket.pin_handle.wait()
    for bucket, aliases in entries:
        if bucket.pinned is None:
            continue
        install_params(aliases, bucket.params)
        bucket.unpin()
