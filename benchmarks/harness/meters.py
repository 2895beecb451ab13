"""TrafficMeter and MemoryMeter: what one training step moves, copies and holds.

What one training step moves, copies and holds, measured the same way for
every runner: TorchDispatchModes that see each op with its tensors.

TrafficMeter: collectives by kind with their bytes, and local copies by kind.
MemoryMeter: bytes of live tensor storages over the step and their peak, by
what the storage holds (parameters, gradients, optimizer state, unsharded
parameters, anything else: activations, temporaries, communication buffers).
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict
from typing import Iterable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

COPY_KINDS = ("copy_in", "copy_out", "cast", "clone")

# Ops that copy bytes from one buffer into another, by what they do in a
# sharding runtime. FSDP2's own ops (fsdp::*) are custom ops whose inner
# copies a mode does not see, so they are listed by name.
_COPY_IN = {"aten::copy_", "aten::_foreach_copy_", "fsdp::all_gather_copy_in",
            "fsdp::chunk_cat", "aten::_chunk_cat"}
_COPY_OUT = {"fsdp::split_with_sizes_copy", "aten::split_with_sizes_copy", "aten::cat"}
_CLONE = {"aten::clone", "aten::_to_copy"}


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a DTensor's local bytes (or `t` itself); through
    a wrapper subclass holding one inner tensor (torchao's float8 weight) too."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        if len(names) == 1:
            return local(getattr(t, names[0]))
    return t


def nbytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def _tensors(tree) -> list:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _op_name(func) -> str:
    return func._schema.name


_COLLECTIVE_WORDS = ("gather", "reduce", "scatter", "broadcast", "all_to_all", "alltoall",
                     "barrier", "send", "recv")


def is_collective(name: str) -> bool:
    """A c10d or functional-collective op that moves data between ranks
    (not wait_tensor or the autograd wrappers around them)."""
    namespace, _, op = name.partition("::")
    return (namespace.startswith(("c10d", "_c10d_functional"))
            and any(w in op for w in _COLLECTIVE_WORDS))


def _collective_bytes(args, kwargs, out) -> int:
    """The largest buffer of a collective: the gathered output of an
    all-gather, the input of a reduce-scatter, the tensor of an all-reduce."""
    groups = [a for a in (*args, *kwargs.values(), out)]
    sizes = [sum(nbytes(t) for t in _tensors(g)) for g in groups]
    return max(sizes, default=0)


class TrafficMeter(TorchDispatchMode):
    """Counts collectives (kind -> count, bytes) and local copies (kind -> bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: Counter = Counter()
        self.collective_bytes: Counter = Counter()
        self.copies: Counter = Counter()
        self.events: list = []  # (kind, bytes) per collective, in order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _op_name(func)
        if is_collective(name):
            kind = name.split("::")[1].strip("_")
            size = _collective_bytes(args, kwargs, out)
            self.collectives[kind] += 1
            self.collective_bytes[kind] += size
            self.events.append((kind, size))
        else:
            self._count_copy(name, args, kwargs, out)
        return out

    def _count_copy(self, name: str, args, kwargs, out) -> None:
        if name in ("aten::copy_", "aten::_foreach_copy_"):
            dsts, srcs = _tensors(args[0]), _tensors(args[1])
            for d, s in zip(dsts, srcs):
                self.copies["cast" if local(d).dtype != local(s).dtype else "copy_in"] += nbytes(d)
        elif name in _COPY_IN:
            moved = _tensors(args[0])  # the pieces packed into the buffer
            self.copies["copy_in"] += sum(nbytes(t) for t in moved)
        elif name in _COPY_OUT:
            self.copies["copy_out"] += sum(nbytes(t) for t in _tensors((out, kwargs.get("out"))))
        elif name in _CLONE:
            src, dst = args[0], out
            cast = name == "aten::_to_copy" and local(src).dtype != local(dst).dtype
            self.copies["cast" if cast else "clone"] += nbytes(dst)


# Every storage an allocator hands out starts on a block boundary, so a storage
# occupies at least its bytes rounded up to it: c10's CPU allocator aligns every
# block to 64 bytes (c10::gAlignment), the CUDA caching allocator rounds every
# block up to 512 bytes (its minimum block size). Counting raw bytes instead
# would make many small tensors look cheaper than one flat buffer holding them.
_BLOCK = {"cpu": 64, "cuda": 512}


def footprint(st: torch.UntypedStorage, size: Optional[int] = None) -> int:
    """Bytes `st` (resized to `size`, if given) occupies in its allocator: its
    size rounded up to a block."""
    size, block = st.nbytes() if size is None else size, _BLOCK.get(st.device.type, 1)
    return -(-size // block) * block


def distinct_storages(tensors) -> list:
    """The storages under `tensors` (DTensors: their local tensors), each once;
    storages resized to 0 (FSDP2's freed unsharded params) left out."""
    seen, out = set(), []
    for t in tensors:
        st = local(t).untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(st)
    return out


class _Entry:
    """One tracked storage: its current size (allocator footprint) and what it holds."""

    __slots__ = ("nbytes", "kind", "ref")

    def __init__(self, size: int, kind: str) -> None:
        self.nbytes, self.kind, self.ref = size, kind, None


def _storages(t: torch.Tensor) -> list:
    """The storages holding `t`'s bytes: a wrapper subclass's are its inner tensors'
    (its own is a placeholder whose size follows its shape, dtype and storage offset:
    torchao's float8 weight over an inner tensor at offset k would count k bytes more)."""
    t = local(t)
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [st for name in names for st in _storages(getattr(t, name))]
    if t.device.type == "meta" or t.is_sparse:
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


class MemoryMeter(TorchDispatchMode):
    """Live storage bytes through a step and their peak, by kind; each storage at
    its allocator footprint (`footprint`: its bytes rounded up to the allocator's block).

    A storage counts from the first op that touches it (or from `register`)
    until it is freed; storage resizes (FSDP2 frees unsharded parameters by
    resizing their storage to 0) are followed. Kinds: "param", "grad",
    "opt_state", "unsharded" (parameters installed on a module while it
    runs), "other" (activations, temporaries, communication buffers).
    """

    def __init__(self) -> None:
        super().__init__()
        self._entries = WeakIdKeyDictionary()  # storage -> _Entry
        self.live = 0
        self.peak = 0
        self._peak_snapshot: list = []  # (entry, nbytes, kind) at the peak
        self._saved_resize = None

    def register(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """Count these tensors' storages as `kind` (already live, or about to be)."""
        for st in (st for t in tensors for st in _storages(t)):
            self._track(st, kind, retag=True)

    def tag_unsharded(self, tensors: Iterable[torch.Tensor]) -> None:
        for st in (st for t in tensors for st in _storages(t)):
            entry = self._track(st, "unsharded")
            if entry.kind == "other":
                entry.kind = "unsharded"

    def _track(self, st: torch.UntypedStorage, kind: str, retag: bool = False) -> _Entry:
        entry = self._entries.get(st)
        if entry is None:
            entry = _Entry(footprint(st), kind)
            entry.ref = weakref.ref(st, self._died_callback(entry))
            self._entries[st] = entry
            self.live += entry.nbytes
            self._check_peak()
        elif retag:
            entry.kind = kind
        return entry

    def _died_callback(self, entry: _Entry):
        def died(_):  # holds `entry`: the dict may drop it before this runs
            self.live -= entry.nbytes
            entry.nbytes = 0
        return died

    def _resized(self, st: torch.UntypedStorage, size: int) -> None:
        entry = self._track(st, "other")
        size = footprint(st, size)
        self.live += size - entry.nbytes
        entry.nbytes = size
        self._check_peak()

    def _check_peak(self) -> None:
        if self.live > self.peak:
            self.peak = self.live
            self._peak_snapshot = [(e, e.nbytes, e.kind) for e in self._entries.values()]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for st in (st for t in _tensors((args, kwargs, out)) for st in _storages(t)):
            self._track(st, "other")
        return out

    def __enter__(self):
        saved = self._saved_resize = torch.UntypedStorage.resize_
        meter = self

        def resize_(st, size):
            saved(st, size)
            meter._resized(st, size)

        torch.UntypedStorage.resize_ = resize_
        self.peak = self.live
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._saved_resize
        return super().__exit__(*exc)

    def peak_by_kind(self, grads: Iterable[torch.Tensor]) -> dict:
        """Bytes by kind at the peak; storages that hold `grads` now count as "grad"."""
        grad_entries = set()
        for st in (st for g in grads for st in _storages(g)):
            if st in self._entries:
                grad_entries.add(id(self._entries[st]))
        kinds: dict = defaultdict(int)
        for entry, size, kind in self._peak_snapshot:
            if kind == "other" and id(entry) in grad_entries:
                kind = "grad"
            kinds[kind] += size
        return dict(kinds)
