"""A user-defined wire format's encode and decode as two custom ops of a traced graph.

Under fs.compile (runtime/traced.py), reshard after forward is a selective
checkpoint that recomputes the gather in backward. A format's encode and decode
made of aten ops would be left to the partitioner, and the policy saves
matmuls: a decode that multiplies (a rotation, a low-rank product) would keep
its decoded params for backward, an encode that does would keep a copy of the
shard (a whole param on an Owned param's owner). The memory that resharding
frees would be kept. BlockQuantized's decode is one op of the `flexshard`
namespace, which the checkpoint policy recomputes whole; these two ops give any
other format's encode and decode the same treatment.

The ops cannot take the format (a Python object), so they take a key into this
process's table of what fs.compile met (`register`): the format and a param's
parts, entered when a bucket is prepared for tracing, before any graph runs,
and read when an op runs (its real kernel, and its fake one, which runs the
format's own code on fake tensors to learn the outputs' shapes and dtypes). The
table is the ops', a process-wide registration as the ops themselves are.

Encode's meta reaches decode as tensors the encode op returns after the parts:
None, one tensor or a tuple of tensors (how to put it back together is kept in
the table by encode). Anything else, and a decode that returns no plain tensor, is
refused when fs.compile is called, by an encode and a decode of meta-device
tensors (`probe`), and, where those cannot run, while tracing (inside the
compiler's own error); both before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..placements.contract import WireFormat
from ..placements.quantized import DECODE_NAMESPACE

# how a meta's tensors are put back together: None; one tensor; n >= 0: a tuple of n
_NONE, _ONE = -1, -2


@dataclass
class _Entry:
    format: WireFormat
    parts: tuple  # (dtype, shape) of each part of this rank's piece
    fulls: tuple  # each part's full shape
    structure: Optional[int] = None  # the meta's, set by encode


_TABLE: List[_Entry] = []  # the ops' table: key -> entry (equal entries share a key)


def register(fmt: WireFormat, parts: Sequence[tuple], fulls: Sequence[tuple]) -> int:
    """The ops' key for `fmt` sending a piece as `parts` ((dtype, shape) each) of
    full shapes `fulls`."""
    parts = tuple((dtype, tuple(shape)) for dtype, shape in parts)
    fulls = tuple(tuple(shape) for shape in fulls)
    for key, entry in enumerate(_TABLE):
        if type(entry.format) is type(fmt) and entry.format == fmt and \
                (entry.parts, entry.fulls) == (parts, fulls):
            return key
    _TABLE.append(_Entry(fmt, parts, fulls))
    return len(_TABLE) - 1


def probe(key: int, piece: torch.Tensor) -> None:
    """Refuse the format of `key` if its encode of a meta-device `piece` returns a
    meta the ops cannot pass, or its decode returns no plain tensor; nothing where
    they cannot run on the meta device (a data-dependent one: tracing checks it)."""
    entry = _TABLE[key]
    outs = [torch.empty(shape, dtype=dtype, device="meta") for dtype, shape in entry.parts]
    fulls = [torch.empty(shape, dtype=dtype, device="meta")
             for (dtype, _), shape in zip(entry.parts, entry.fulls)]
    try:
        meta = entry.format.encode(torch.empty_like(piece, device="meta"), outs, None)
    except Exception:  # noqa: BLE001 (a probe: tracing runs encode on fake tensors)
        return
    _structure(entry.format, meta)
    try:
        out = entry.format.decode(fulls, meta)
    except Exception:  # noqa: BLE001 (as above)
        return
    _check_plain(entry.format, out)


def _structure(fmt: WireFormat, meta) -> tuple:
    """(meta's tensors, how to put them back together), or NotImplementedError."""
    if meta is None:
        return [], _NONE
    if isinstance(meta, torch.Tensor):
        return [meta], _ONE
    if isinstance(meta, tuple) and all(isinstance(t, torch.Tensor) for t in meta):
        return list(meta), len(meta)
    raise NotImplementedError(
        f"fs.compile: wire format {type(fmt).__name__}'s encode returned a "
        f"{type(meta).__name__} as its meta; in a compiled step a user-defined format's "
        "meta must be None, a tensor or a tuple of tensors (make the rest a field of the "
        "format), or compile each block with block.compile() instead")


def _own(t: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """`t`, copied if it is (a view of) an input: an op's outputs are its own."""
    return t.clone() if t._is_view() or any(t is i for i in inputs) else t


def _encode(piece: torch.Tensor, key: int) -> List[torch.Tensor]:
    entry = _TABLE[key]
    outs = [piece.new_empty(shape, dtype=dtype) for dtype, shape in entry.parts]
    tensors, entry.structure = _structure(entry.format, entry.format.encode(piece, outs, None))
    return outs + [_own(t, [piece, *outs]) for t in tensors]


@torch.library.custom_op(f"{DECODE_NAMESPACE}::encode", mutates_args=())
def encode(piece: torch.Tensor, key: int) -> List[torch.Tensor]:
    """The format of `key`'s encode of this rank's `piece`: its parts, then its meta's tensors."""
    return _encode(piece, key)


@encode.register_fake
def _(piece, key):
    return _encode(piece, key)


def _decode(fulls: List[torch.Tensor], tensors: List[torch.Tensor], key: int,
            fake: bool = False) -> torch.Tensor:
    entry = _TABLE[key]
    if entry.structure is None:
        raise AssertionError(f"flexshard::decode of {entry.format!r} ran before its encode")
    meta = (None if entry.structure == _NONE else tensors[0] if entry.structure == _ONE
            else tuple(tensors))
    out = entry.format.decode(fulls, meta)
    # (the fake kernel's tensors are a subclass of their own: the real kernel checks)
    _check_plain(entry.format, out, subclass_ok=fake)
    return _own(out, [*fulls, *tensors])


def _check_plain(fmt: WireFormat, out, subclass_ok: bool = False) -> None:
    if not isinstance(out, torch.Tensor) or not subclass_ok and type(out) is not torch.Tensor:
        raise NotImplementedError(
            f"fs.compile: wire format {type(fmt).__name__}'s decode returned a "
            f"{type(out).__name__}, not a plain tensor; compile each block with "
            "block.compile() instead")


@torch.library.custom_op(f"{DECODE_NAMESPACE}::decode", mutates_args=())
def decode(fulls: List[torch.Tensor], tensors: List[torch.Tensor], key: int) -> torch.Tensor:
    """The format of `key`'s decode of the parts' full tensors and encode's meta tensors."""
    return _decode(fulls, tensors, key)


@decode.register_fake
def _(fulls, tensors, key):
    return _decode(fulls, tensors, key, fake=True)
