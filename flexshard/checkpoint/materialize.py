"""Meta-device models: move bucket storage with the module, initialise shards.

Build the model on the meta device, flex_shard it (storage stays on meta, so
nothing is allocated), then `module.to_empty(device=...)` allocates only this
rank's storage and `module.init_parameters()` fills it one module at a time:
each module's own parameters are materialised at full size, initialised by
its `reset_parameters()` (in `modules()` order) or a user function (in
`nn.Module.apply`'s order, children first, with the descendants' params it
touches made full too), cut into this rank's pieces and freed. With every rank
seeded alike, the result equals initialising the unsharded model by the same
calls, random inits included.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from ..compat import make_subclass, plain_torch_function
from ..runtime.bucket import BucketState


def apply_to_buckets(state, fn, apply_rest: Callable) -> None:
    """nn.Module._apply for a wrapped module: `apply_rest` (the plain _apply)
    moves everything but the sharded params, each bucket moves its storage."""
    for bucket in state.buckets:
        if bucket.state is not BucketState.SHARDED or bucket.held is not None:
            raise RuntimeError(
                f"cannot move or convert the module while bucket {bucket.name!r} is "
                f"{bucket.state.value}; call module.reshard() and finish backward first")
        bucket.check_apply(fn)
    state.prefetcher.drop_all()
    for bucket in state.buckets:  # unregistered, so apply_rest skips them: storage moves below
        bucket.install([None] * len(bucket.slots))
    try:
        apply_rest()
        for bucket in state.buckets:
            bucket.apply_to_storage(fn)
    finally:
        for bucket in state.buckets:
            bucket.install_sharded()


def init_parameters(module: nn.Module, state, init_fn: Optional[Callable] = None) -> None:
    """Initialise the sharded params module by module (see the module docstring)."""
    owners = _owners(module, state)
    if init_fn is None:
        _check_resettable(module, owners)
        for name, sub in module.named_modules():
            _init_one(sub, name, owners.get(id(sub), []), _reset)
        return
    first_wins, seen = _ties_after_init(init_fn), set()
    for name, sub in _children_first(module):
        entries = owners.get(id(sub), [])
        scratch = {(id(b), i) for _, b, i in entries if (id(b), i) in seen} if first_wins else ()
        seen.update((id(b), i) for _, b, i in entries)
        _init_one(sub, name, entries, init_fn, _Descendants(sub, owners, entries), scratch)


def _init_one(sub: nn.Module, name: str, entries: list, init_fn: Callable,
              below: Optional["_Descendants"] = None, scratch=()) -> None:
    """`init_fn(sub)` on `sub`'s own params at full size (`below`: its descendants'
    as stand-ins); this rank's pieces of what it wrote kept, but those of `scratch`."""
    _materialize(sub, entries)
    if below is not None:
        below.install()
    try:
        with torch.no_grad():
            init_fn(sub)
            for attr, bucket, index in entries:
                if (id(bucket), index) not in scratch:
                    _store_piece(sub, attr, bucket, index, name)
            if below is not None:
                below.store(name)
    finally:
        for attr, bucket, index in entries:
            sub._parameters[attr] = bucket.params[index]
        if below is not None:
            below.restore()


def _children_first(module: nn.Module, prefix: str = ""):
    """(name, module) as nn.Module.apply calls its function: children first."""
    for name, child in module.named_children():
        yield from _children_first(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _ties_after_init(init_fn: Callable) -> bool:
    """A Hugging Face model's own init (`model._init_weights`): it initialises the
    model before it ties the weights, so a tied param keeps what its first module's
    init made (the input embeddings'); the LM head's init still runs, drawing the
    same random numbers, on a scratch copy."""
    owner = getattr(init_fn, "__self__", None)
    return callable(getattr(owner, "tie_weights", None)) and \
        callable(getattr(owner, "_initialize_weights", None))


class _Descendants:
    """The sharded params registered below a module, as stand-ins while the module's
    init runs: an init that reaches into its children (Hugging Face's GPT-2 scales its
    blocks' output projections from the attention module's init, T5 its q, k and v)
    materialises each param it touches at full size, with its values so far (one
    gather), and this rank keeps its piece of what it wrote."""

    def __init__(self, sub: nn.Module, owners: dict, own: list) -> None:
        mine = {(id(b), i) for _, b, i in own}
        self.sites: dict = {}  # (id(bucket), index) -> [(module, attr, path)], ties included
        self.slots: dict = {}  # (id(bucket), index) -> (bucket, index)
        for path, m in list(sub.named_modules())[1:]:
            for attr, bucket, index in owners.get(id(m), []):
                key = (id(bucket), index)
                if key not in mine:
                    self.sites.setdefault(key, []).append((m, attr, path))
                    self.slots[key] = (bucket, index)
        self.full: dict = {}
        self.lazy: dict = {}

    def install(self) -> None:
        for key, sites in self.sites.items():
            bucket, index = self.slots[key]
            self.lazy[key] = _Lazy.of(_full_shape(bucket, index), bucket.slots[index].dtype,
                                      bucket.params[index].requires_grad,
                                      lambda k=key: self._full(k))
            for m, attr, _ in sites:
                m._parameters[attr] = self.lazy[key]

    def _full(self, key) -> nn.Parameter:
        if key not in self.full:
            bucket, index = self.slots[key]
            pieces = [None] * len(bucket.slots)
            pieces[index] = bucket.storage.views[index]
            value = bucket.gather.gather_pieces(pieces)[index]
            tp = bucket.wiring[index].tp
            value = value if tp is None else tp.full_of(value)
            self.full[key] = nn.Parameter(value.clone(), bucket.params[index].requires_grad)
            for m, attr, _ in self.sites[key]:
                m._parameters[attr] = self.full[key]
        return self.full[key]

    def store(self, name: str) -> None:
        """Keep this rank's pieces of what the init touched (or assigned anew)."""
        for key, sites in self.sites.items():
            (m, attr, path), (bucket, index) = sites[0], self.slots[key]
            if m._parameters[attr] is not self.lazy[key]:
                _store_piece(m, attr, bucket, index, f"{name}.{path}" if name else path)

    def restore(self) -> None:
        for key, sites in self.sites.items():
            bucket, index = self.slots[key]
            for m, attr, _ in sites:
                m._parameters[attr] = bucket.params[index]
        self.full, self.lazy = {}, {}


_SHAPE_QUERIES = frozenset([
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
    torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.__len__,
    torch.Tensor.__hash__,
    torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__, torch.Tensor.dtype.__get__,
    torch.Tensor.requires_grad.__get__])


class _Lazy(torch.Tensor):
    """A full-shape stand-in on the meta device: shape queries answer from it; any
    other op runs on the param's full values, made on first use."""

    @staticmethod
    def of(shape, dtype, requires_grad: bool, make: Callable) -> "_Lazy":
        lazy = make_subclass(_Lazy, torch.empty(shape, dtype=dtype, device="meta"), requires_grad)
        lazy._make = make
        return lazy

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with plain_torch_function():
            if func in _SHAPE_QUERIES:
                return func(*args, **kwargs)
            return func(*map(_real, args), **{k: _real(v) for k, v in kwargs.items()})


def _real(x):
    """`x` with its stand-ins made real (in a list or tuple too: foreach ops)."""
    if isinstance(x, _Lazy):
        return x._make()
    if isinstance(x, (list, tuple)) and any(isinstance(t, _Lazy) for t in x):
        return type(x)(_real(t) for t in x)
    return x


def _owners(module: nn.Module, state) -> dict:
    """id(submodule) -> [(attr, bucket, slot index)] of the sharded params it registers."""
    where = {id(p): (b, i) for b in state.buckets for i, p in enumerate(b.params)}
    owners: dict = {}
    for _, sub in module.named_modules():
        for attr, p in sub._parameters.items():
            if p is not None and id(p) in where:
                owners.setdefault(id(sub), []).append((attr, *where[id(p)]))
    for bucket in state.buckets:
        if bucket.storage.buffer.is_meta:
            raise ValueError(f"bucket {bucket.name!r} is still on the meta device; call "
                             "module.to_empty(device=...) before init_parameters()")
    return owners


def _check_resettable(module: nn.Module, owners: dict) -> None:
    for name, sub in module.named_modules():
        if id(sub) in owners and not callable(getattr(sub, "reset_parameters", None)):
            attr, bucket, index = owners[id(sub)][0]
            raise ValueError(
                f"parameter {bucket.slots[index].fqn!r} is registered on "
                f"{type(sub).__name__} {name or '<root>'!r}, which has no "
                "reset_parameters(); pass init_parameters(init_fn) with a function of the "
                "module that initialises it (a Hugging Face model's own: "
                "init_parameters(model._init_weights))")


def _reset(sub: nn.Module) -> None:
    if callable(getattr(sub, "reset_parameters", None)):
        sub.reset_parameters()


def _materialize(sub: nn.Module, entries) -> None:
    """Full-size, uninitialised params for `sub`'s own sharded params, installed on it."""
    for attr, bucket, index in entries:
        slot, param = bucket.slots[index], bucket.params[index]
        sub._parameters[attr] = nn.Parameter(
            # On the compute device (not an offloaded bucket's host memory), so init
            # functions run, and draw random numbers, where the unsharded model's would.
            torch.empty(_full_shape(bucket, index), dtype=slot.dtype, device=bucket.compute_device),
            requires_grad=param.requires_grad)


def _full_shape(bucket, index) -> tuple:
    """The shape init functions see: the global one for a DTensor param (TP), so
    that every TP rank keeps its block of the unsharded model's values."""
    spec = bucket.wiring[index].tp
    return tuple(bucket.slots[index].shape) if spec is None else tuple(spec.shape)


def _store_piece(sub, attr, bucket, index, name) -> None:
    """Copy this rank's piece of what `sub` now registers under `attr` into storage."""
    value = sub._parameters[attr]
    slot, shape = bucket.slots[index], _full_shape(bucket, index)
    if value is None or tuple(value.shape) != shape:
        raise ValueError(
            f"the init function left {name + '.' if name else ''}{attr} as "
            f"{None if value is None else tuple(value.shape)}, expected a tensor of shape "
            f"{shape}; initialise the parameter in place")
    value = value.detach()
    if bucket.wiring[index].tp is not None:
        value = bucket.wiring[index].tp.local_of(value)  # this TP rank's block
    piece = slot.placement.shard(value.to(slot.dtype), bucket.rank, bucket.world_size)
    bucket.storage.views[index].copy_(piece)
