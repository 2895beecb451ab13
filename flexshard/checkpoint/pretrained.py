"""Load pretrained weights (a plain full state dict or safetensors files) into
a wrapped model, one parameter at a time.

Each rank reads only the boxes of the full tensors its pieces cover (for
safetensors, straight from the file through `get_slice`), so no rank ever
holds the whole model, nor with safetensors even one whole parameter it does
not own. Every rank reads the source itself; one small all-gather checks that
the ranks read the same values (agreement.py) before anything is written.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import math
import os
from typing import Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn

from ..runtime.state import get_state
from .agreement import ABSENT, PRESENT, UNCOMPARED, check_sources_agree, checksum
from .pieces import box_views
from .state_dict import (SlotRef, buffer_names, check_tied_values, group_values, named_slots,
                         slot_boxes)


class PretrainedKeys(NamedTuple):
    """What load_pretrained matched: model names without a source tensor, and
    source keys the model did not use."""

    missing: list
    unexpected: list


def load_pretrained(model: nn.Module, source, *, key_map: Optional[Callable] = None,
                    strict: bool = True) -> PretrainedKeys:
    """Copy full pretrained tensors into `model`'s sharded parameters and
    persistent buffers, in place.

    `source`: a mapping FQN -> full tensor (a state dict), or a path to a
    .safetensors file, a directory of them, or a list of such files.
    `key_map(name) -> source key` renames (return None to skip a name). A tied
    parameter loads from any of its names the source has; where it has several
    (a Hugging Face checkpoint of a model with tied embeddings) their tensors
    must be equal (ValueError naming both otherwise), and all count as used. With
    `strict`, every parameter and persistent buffer must be found (ValueError
    naming them otherwise); unused source keys are returned, never an error.

    Collective (one small all-gather): before anything is written, the ranks
    compare checksums of what they read, and every rank raises a ValueError
    naming the tensors whose sources differ (checkpoint/agreement.py).
    """
    if key_map is not None and not callable(key_map):
        raise TypeError(f"load_pretrained: key_map must be a callable name -> source key, "
                        f"got {key_map!r}")
    state = get_state(model)
    names = [e.name for e in _entries(model, state, set(), lambda name: None)]
    with contextlib.ExitStack() as stack:
        plan, error = None, None
        try:  # a failure here is raised after the collective, so no rank waits in it
            reader = stack.enter_context(_open(source))
            plan = _plan(model, state, reader, key_map or (lambda name: name), strict)
        except Exception as e:  # noqa: BLE001 (re-raised as it is by check_sources_agree)
            error = e
        check_sources_agree(state, names, [] if plan is None else plan.checksums, error,
                            "load_pretrained")
        with torch.no_grad():
            for keys, ref in plan.params:
                _load_piece(reader, keys[0], ref, state)
            for key, buf in plan.buffers:
                buf.copy_(reader.read(key, None))
        used = {key for keys, _ in plan.params for key in keys} | {k for k, _ in plan.buffers}
        return PretrainedKeys(plan.missing, sorted(set(reader.keys()) - used))


class _Entry(NamedTuple):
    """One parameter (its first name) or persistent buffer and the source keys holding it."""

    name: str
    keys: list  # empty: the source has no tensor for it
    target: object  # SlotRef for a sharded parameter, the tensor for a buffer


class _Plan(NamedTuple):
    params: list  # [(source keys, SlotRef)]
    buffers: list  # [(source key, buffer)]
    missing: list  # names without a source tensor
    checksums: list  # one per _Entry, agreement.ABSENT where missing


def _plan(model, state, reader, key_map, strict: bool) -> _Plan:
    """Match the source to the model and check it: everything that can fail
    before a tensor is written."""
    entries = _entries(model, state, set(reader.keys()), key_map)
    missing = [e.name for e in entries if not e.keys]
    if strict and missing:
        raise ValueError(f"load_pretrained: the source has no tensor for {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} ({len(missing)} missing); "
                         "pass key_map to rename, or strict=False")
    params = [(e.keys, e.target) for e in entries if e.keys and isinstance(e.target, SlotRef)]
    buffers = [(e.keys[0], e.target) for e in entries
               if e.keys and not isinstance(e.target, SlotRef)]
    _check_shapes(reader, params, buffers, state)
    for keys, ref in params:
        _check_tied(reader, keys, ref.shape)
    sums = [ABSENT if not e.keys else _checksum(reader, e) for e in entries]
    return _Plan(params, buffers, missing, sums)


def _checksum(reader, entry: "_Entry") -> int:
    """What the ranks compare of a tensor their sources hold: a parameter's
    checksum; a buffer's presence alone (buffers are per rank: agreement.py)."""
    if not isinstance(entry.target, SlotRef):
        return PRESENT
    if group_values(entry.target):
        return UNCOMPARED
    return checksum(functools.partial(reader.read, entry.keys[0]), reader.shape(entry.keys[0]))


def _entries(model, state, keys: set, key_map) -> list:
    """[_Entry]: every sharded parameter (tied names together), then every
    persistent buffer, in the model's order, each named as the unwrapped
    model's state dict names it; a tied parameter's source keys are all its
    names the source holds (named_parameters()' spellings too: wrap/names.py)."""
    names_of: dict = {}
    for name, ref in named_slots(model, state).items():
        names_of.setdefault((id(ref.bucket), ref.index), (ref, []))[1].append(name)
    entries = []
    for ref, names in names_of.values():
        found = [k for k in (key_map(n) for n in names) if k is not None and k in keys]
        entries.append(_Entry(names[0], list(dict.fromkeys(found)), ref))  # key_map may merge
    for name, (buf, aliases) in buffer_names(model).items():
        found = [k for k in map(key_map, aliases) if k is not None and k in keys]
        entries.append(_Entry(name, found[:1], buf))
    return entries


def _check_shapes(reader, params, buffers, state) -> None:
    for keys, ref in params:
        for key in keys:
            if reader.shape(key) != ref.shape:  # the global shape of a DTensor param
                raise ValueError(f"load_pretrained: source tensor {key!r} has shape "
                                 f"{reader.shape(key)} but parameter {ref.slot.fqn!r} is "
                                 f"{ref.shape}; check key_map")
    for key, buf in buffers:
        if reader.shape(key) != tuple(buf.shape):
            raise ValueError(f"load_pretrained: source tensor {key!r} has shape "
                             f"{reader.shape(key)} but the buffer is {tuple(buf.shape)}")


_TIED_CHECK_ELEMENTS = 1 << 22  # rows compared at once: bounded memory for big embeddings


def _check_tied(reader, keys: list, shape: tuple) -> None:
    """The source's tensors for one tied parameter are equal. Every rank compares
    them whole (so all ranks raise alike), a block of rows at a time."""
    if len(keys) < 2:
        return
    if not shape:
        check_tied_values(keys, lambda key: reader.read(key, None), "load_pretrained")
        return
    step = max(1, _TIED_CHECK_ELEMENTS // max(1, math.prod(shape[1:])))
    for start in range(0, shape[0], step):
        rows = (slice(start, min(start + step, shape[0])),)
        check_tied_values(keys, lambda key: reader.read(key, rows), "load_pretrained")


def _load_piece(reader, key: str, ref, state) -> None:
    local = ref.bucket.params[ref.index].detach()
    boxes = slot_boxes(ref)  # in the global tensor under tensor parallelism
    for box, view in zip(boxes, box_views(local, boxes)):
        view.copy_(reader.read(key, tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))))


# Sources: .keys(), .shape(key), .read(key, slices or None for the whole tensor).


class _MappingReader:
    def __init__(self, mapping: Mapping) -> None:
        self._mapping = mapping

    def keys(self):
        return list(self._mapping.keys())

    def shape(self, key: str) -> tuple:
        return tuple(self._mapping[key].shape)

    def read(self, key: str, slices) -> torch.Tensor:
        full = self._mapping[key]
        return full if slices is None else full[slices]


class _SafetensorsReader:
    def __init__(self, files: list, stack: contextlib.ExitStack) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise ModuleNotFoundError("load_pretrained needs the safetensors package for "
                                      ".safetensors files: pip install 'flexshard[safetensors]'"
                                      ) from None
        self._where: dict = {}
        for path in files:
            handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for key in handle.keys():
                self._where[key] = handle

    def keys(self):
        return list(self._where)

    def shape(self, key: str) -> tuple:
        return tuple(self._where[key].get_slice(key).get_shape())

    def read(self, key: str, slices) -> torch.Tensor:
        handle = self._where[key]
        if slices is None or not slices:
            return handle.get_tensor(key)
        return handle.get_slice(key)[slices]


@contextlib.contextmanager
def _open(source):
    if isinstance(source, Mapping):
        yield _MappingReader(source)
        return
    files = _safetensors_files(source)
    with contextlib.ExitStack() as stack:
        yield _SafetensorsReader(files, stack)


def _safetensors_files(source) -> list:
    paths = [source] if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, (str, os.PathLike))
                                                        for p in paths):
        raise TypeError(f"load_pretrained: source must be a mapping of tensors or a path (or "
                        f"list of paths) to .safetensors files, got {type(source).__name__}")
    files = []
    for path in map(os.fspath, paths):
        if os.path.isdir(path):
            files += sorted(glob.glob(os.path.join(path, "*.safetensors")))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"load_pretrained: {path!r} does not exist")
    if not files:
        raise FileNotFoundError(f"load_pretrained: no .safetensors file in {paths!r}")
    return files
