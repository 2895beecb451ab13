"""Reshard-after-forward through saved-tensor hooks.

While a resharding bucket's module runs its forward, autograd's saved tensors
pass through `SavedParams.pack`: a tensor whose storage is one of the storages
of a currently unsharded, resharding bucket (its gather output, or a copied-out
param) becomes a `ParamHandle` (which bucket, which slot's storage, the view's
geometry); every other tensor is kept as autograd keeps it. After forward the
bucket reshards and nothing holds its unsharded storage any more.

In backward the first unpack of a handle regathers its bucket once (consuming
the gather the backward-order prefetcher launched, if any, then prefetching the
next bucket) and rebuilds the saved view over the regathered storage. The
bucket holds the regathered params (`Bucket.regathered`) until its
`_Unshard.backward` has launched its reduce-scatter, or until backward ends;
an unpack after that regathers again (correct, and rare: frozen params).

saved_tensors_hooks do not nest: the innermost pushed pair sees every save. So
one pair serves the whole model, pushed by the outermost resharding module
whose forward runs with no other hooks active, and the registry holds every
unsharded resharding bucket's storages, nested buckets' included. Under other
hooks (the user's activation checkpoint, CPU offload) none is pushed: those
hooks handle the saves, and a checkpoint's recompute re-runs our pre-forward
hook, which regathers.
"""

from __future__ import annotations

import sys
from typing import NamedTuple, Optional, Sequence

import torch
from torch.autograd.graph import saved_tensors_hooks

from ..compat import saved_output, tensor_version, top_saved_tensors_default_hooks
from .dtensor_param import TPSpec
from .grad_reduce import ReduceQueue


def top_saved_tensors_hooks() -> Optional[tuple]:
    """The innermost (pack, unpack) pair on this thread's saved-tensor hook
    stack, or None."""
    return top_saved_tensors_default_hooks(False)


def saves_kept_elsewhere() -> bool:
    """Whether the innermost saved-tensor hooks keep no tensor as it is: torch's
    activation checkpoint (its recompute gathers again) or save_on_cpu (copies)."""
    top = top_saved_tensors_hooks()
    if top is None:
        return False
    name = getattr(top[0], "__qualname__", "")
    return name.startswith(("_checkpoint_hook.", "save_on_cpu."))


def saved_tensors_hooked() -> bool:
    """True inside a region whose saved tensors some hooks already handle (an
    activation checkpoint, CPU offload, or ours)."""
    return top_saved_tensors_hooks() is not None


class ParamHandle(NamedTuple):
    """What autograd keeps instead of a saved view of an unsharded param."""

    bucket: object  # the Bucket whose storage the view was of
    slot: int  # a slot whose unsharded tensor lives in that storage
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int  # storage offset, in elements of `dtype`
    version: int  # the bucket's storage version at forward: a later write is refused
    inner: str = ""  # of a tensor subclass's unsharded param: the inner tensor it views


class _Activation(NamedTuple):
    """A saved tensor that is not a param: a detached alias and its version."""

    tensor: torch.Tensor
    version: int

    def check(self) -> torch.Tensor:
        t = self.tensor
        if tensor_version(t) != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [{t.type()} {list(t.shape)}] is at version "
                f"{tensor_version(t)}; expected version {self.version} instead (saved in a "
                "flexshard bucket's forward)")
        return t


def _inner_tensors(t: torch.Tensor) -> list:
    """(name, tensor) of a plain tensor ('' , itself) or of a subclass's inner tensors."""
    if type(t) is torch.Tensor:
        return [("", t)]
    if not hasattr(t, "__tensor_flatten__"):
        return []
    return [(name, getattr(t, name)) for name in t.__tensor_flatten__()[0]]


def _is_dtensor(t) -> bool:
    """Called for every saved tensor: no import statement here (1% of a step's
    Python); while torch.distributed.tensor is not imported no DTensor exists."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


class _DTensorHandle(NamedTuple):
    """A saved DTensor whose local tensor views an unsharded param (TP)."""

    local: ParamHandle
    spec: TPSpec  # mesh, placements, global shape and stride of the saved DTensor


class _SubclassHandle(NamedTuple):
    """A saved tensor subclass (torchao's fp8 weight, or a transpose of it) whose
    inner tensors view a subclass gather's unsharded param: each inner packed."""

    cls: type
    ctx: object  # its __tensor_flatten__ context
    inners: tuple  # (name, packed) per inner tensor
    size: tuple
    stride: tuple


class SavedParams:
    """One model's registry of unsharded storages and its saved-tensor hooks."""

    def __init__(self, prefetcher, queue: ReduceQueue, buckets: Sequence) -> None:
        self.prefetcher, self.queue, self.buckets = prefetcher, queue, list(buckets)
        # storage data_ptr -> (bucket, slot index, inner tensor name or '' for a plain param)
        self._by_storage: dict = {}
        self._keys: dict = {}  # id(bucket) -> its data_ptrs in _by_storage
        self._subclasses = False  # a subclass gather's param was registered (pack looks inside)
        self._hooks = saved_tensors_hooks(self.pack, self.unpack)
        queue.listeners.append(self.end_backward)

    # Forward: which storages are a resharding bucket's unsharded params.

    def active(self) -> bool:
        """Whether our hooks are the innermost ones, i.e. see every save."""
        top = top_saved_tensors_hooks()
        return top is not None and top[0] == self.pack

    def register(self, bucket, outs: Sequence[torch.Tensor]) -> None:
        """`outs` are `bucket`'s unsharded params until `forget(bucket)`; a
        no-op unless our hooks see the saves (see push)."""
        if not self.active():
            return
        bucket.note_registered()
        keys = self._keys.setdefault(id(bucket), [])
        for i, t in enumerate(outs):
            for name, tensor in _inner_tensors(t):
                ptr = tensor.untyped_storage().data_ptr()
                if ptr and ptr not in self._by_storage:  # 0: empty or meta, never a match
                    self._by_storage[ptr] = (bucket, i, name)
                    keys.append(ptr)
            self._subclasses |= type(t) is not torch.Tensor

    def forget(self, bucket) -> None:
        """`bucket` resharded: its storages (still alive here) leave the registry."""
        for ptr in self._keys.pop(id(bucket), ()):
            del self._by_storage[ptr]

    def push(self) -> bool:
        """Push the hooks unless some saved-tensor hooks (ours included) are
        active; returns whether they were pushed."""
        if saved_tensors_hooked():
            return False
        self._hooks.__enter__()
        return True

    def pop(self) -> None:
        if not self.active():
            top = top_saved_tensors_hooks()
            raise AssertionError(f"flexshard's saved-tensor hooks are not innermost: {top}")
        self._hooks.__exit__(None, None, None)

    # The hooks.

    def pack(self, t: torch.Tensor):
        if self._by_storage and _is_dtensor(t):
            handle = self._pack_dtensor(t)
            if handle is not None:
                return handle
        found = None
        if type(t) is torch.Tensor and t.layout is torch.strided:  # never a subclass or sparse
            found = self._by_storage.get(t.untyped_storage().data_ptr())
        elif self._subclasses and self._by_storage and hasattr(t, "__tensor_flatten__"):
            handle = self._pack_subclass(t)
            if handle is not None:
                return handle
        if found is None:
            # Kept as autograd keeps it. An output of the node being recorded is
            # detached: held as is it would hold that node through its grad_fn (a
            # cycle no GC sees, leaking the graph of a forward never backpropagated).
            # An input is held as is (no op): its grad_fn is an earlier node, which the
            # new one reaches anyway. The version is checked on unpack, as autograd does.
            kept = t.detach() if saved_output(t) else t
            return _Activation(kept, tensor_version(t))
        bucket, slot, inner = found
        bucket.note_saved()
        return ParamHandle(bucket, slot, t.dtype, tuple(t.shape), t.stride(),
                           t.storage_offset(), bucket.saved_version, inner)

    def _pack_subclass(self, t) -> Optional[_SubclassHandle]:
        """A tensor subclass with an inner tensor over a registered storage."""
        names, ctx = t.__tensor_flatten__()
        inners = tuple((name, self.pack(getattr(t, name))) for name in names)
        if not any(isinstance(p, ParamHandle) for _, p in inners):
            return None
        return _SubclassHandle(type(t), ctx, inners, tuple(t.shape), t.stride())

    def _pack_dtensor(self, t) -> Optional[_DTensorHandle]:
        """A DTensor over a registered storage (a TP param or a view of one)."""
        with torch.no_grad():
            local = t.to_local()  # a view of the DTensor's local tensor, same storage
        packed = self.pack(local)
        if not isinstance(packed, ParamHandle):
            return None
        spec = TPSpec(t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride()),
                      (), tuple(local.shape))
        return _DTensorHandle(packed, spec)

    def unpack(self, packed):
        if isinstance(packed, _Activation):
            return packed.check()
        if isinstance(packed, _DTensorHandle):
            local = self.unpack(packed.local)
            with torch.no_grad():
                return packed.spec.to_param(local)
        if isinstance(packed, _SubclassHandle):
            inners = {name: self.unpack(p) for name, p in packed.inners}
            return packed.cls.__tensor_unflatten__(inners, packed.ctx, packed.size,
                                                   packed.stride)
        base = self.regathered(packed)[packed.slot]
        if packed.inner:  # the regathered subclass param's inner tensor
            base = getattr(base, packed.inner)
        with torch.no_grad():
            if base.dtype == packed.dtype:
                return base.as_strided(packed.size, packed.stride, packed.offset)
            out = torch.empty(0, dtype=packed.dtype, device=base.device)
            return out.set_(base.untyped_storage(), packed.offset, packed.size, packed.stride)

    # Backward: regather once per bucket, hold until its reduce is launched.

    def regathered(self, handle: ParamHandle) -> list:
        bucket = handle.bucket
        bucket.check_unchanged_since(handle.version)
        if bucket.regathered is None:  # once per backward, not per unpack
            self.queue.watch_backward()  # the pass ends by dropping what it regathers
        params, new = bucket.regather()
        if new:
            self.prefetcher.unsharded(bucket)
        return params

    def end_backward(self) -> None:
        """Backward ended (a ReduceQueue listener): drop every regathered param."""
        for bucket in self.buckets:
            bucket.backward_done()  # an int reshard's slice too, if backward never used it
