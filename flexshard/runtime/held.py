"""What `module.unshard()` holds, and the check at `module.reshard()` that
nothing wrote to it in place.

The held unsharded params are gathered copies: the sharded params are the
parameters, so a write to a held one (`w.add_(d)`, PEFT's `merge_adapter()`:
`w.data += delta` or `w.data = merged`) would be dropped at reshard. It is
found, never silently: by the held tensor's version counter (bumped by every
in-place op on it or its views, not by one through `.data`), its data pointer
(`.data = t`), the module attribute still holding it, and, for params gathered
by a plain cast, by comparing this rank's piece of it with its shard bitwise
(`.data += delta`). The versions are read after the gather's own writes
(`hold`), so the engine's fill is never taken for a user's."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..compat import tensor_version
from ..placements.wire import Cast

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class HeldParams:
    """A bucket's unsharded params held by module.unshard(): the tensors (this
    reference keeps the gather output alive), what was installed on the modules,
    and their versions and pointers once the gather was done."""

    __slots__ = ("tensors", "installed", "versions", "ptrs", "storage_version")

    def __init__(self, tensors: Sequence[torch.Tensor], installed: Sequence,
                 storage_version: int) -> None:
        self.tensors = list(tensors)
        self.installed = list(installed)  # per slot, per alias: the object on the module
        self.versions = [tensor_version(t) for t in self.tensors]
        self.ptrs = [_ptr(t) for t in self.tensors]
        self.storage_version = storage_version  # an optimizer step on the shards bumps it

    def written(self, aliases: Sequence[tuple], formats: Sequence, piece: Callable,
                storage: torch.Tensor) -> list:
        """Indices of the slots written in place (or replaced on a module) since
        held. `piece(i, full)` is (this rank's piece of slot i's full tensor, its
        shard), compared bitwise when slot i is gathered by a Cast and the shards
        did not change since (then held and shard agree bit for bit)."""
        replaced, bumped, compared, flags = [], [], [], []
        same_shards = tensor_version(storage) == self.storage_version
        for i, t in enumerate(self.tensors):
            if self.ptrs[i] is not None and _aliases(t, storage):
                continue  # views the storage itself (world size 1): its writes land
            if _ptr(t) != self.ptrs[i] or any(
                    m._parameters.get(a) is not o for (m, a), o in zip(aliases[i], self.installed[i])):
                replaced.append(i)
                continue
            if tensor_version(t) != self.versions[i]:
                bumped.append(i)
            if same_shards and isinstance(formats[i], Cast) and self.ptrs[i] is not None:
                flag = _differs(*piece(i, t))
                if flag is not None:
                    compared.append(i)
                    flags.append(flag)
        differ = []
        if flags:  # one device-to-host read for the bucket
            differ = [i for i, bad in zip(compared, torch.stack(flags).tolist()) if bad]
        # Views of one gather output share a version counter: a write to one bumps
        # them all. Name those whose piece differs; where none does (the write fell
        # in other ranks' pieces), every bumped one.
        if bumped and not set(bumped) & set(differ):
            differ += bumped
        return sorted(set(replaced + differ))


def _ptr(t: torch.Tensor):
    """A plain tensor's data pointer; None for a tensor subclass (a float8 one),
    which may have no storage of its own: only its version is watched."""
    return t.data_ptr() if type(t) in (torch.Tensor, torch.nn.Parameter) else None


def _aliases(t: torch.Tensor, storage: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()


def _differs(held: torch.Tensor, shard: torch.Tensor):
    """A 0-dim bool tensor: whether this rank's piece of a held param differs
    from its shard cast to the held dtype, bit for bit (NaN equals NaN)."""
    if held.shape != shard.shape or held.numel() == 0:
        return None
    shard = shard.to(device=held.device, dtype=held.dtype)
    ints = _INT_OF_SIZE.get(held.element_size())
    if ints is None or held.is_complex():
        return torch.ne(held, shard).any()
    return torch.ne(held.view(ints), shard.view(ints)).any()
