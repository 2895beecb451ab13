"""Load pretrained weights (a plain full state dict or safetensors files) into
a wrapped model, one parameter at a time.

Each rank reads only the boxes of the full tensors its pieces cover (for
safetensors, straight from the file through `get_slice`), so no rank ever
holds the whole model, nor with safetensors even one whole parameter it does
not own. No collective runs: every rank reads the source itself.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
from typing import Callable, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn

from ..runtime.state import get_state
from .pieces import box_views
from .state_dict import check_tied_values, named_slots, persistent_buffers, slot_boxes


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
    """
    if key_map is not None and not callable(key_map):
        raise TypeError(f"load_pretrained: key_map must be a callable name -> source key, "
                        f"got {key_map!r}")
    state = get_state(model)
    with _open(source) as reader:
        params, buffers, missing = _match(model, state, reader, key_map or (lambda name: name))
        if strict and missing:
            raise ValueError(f"load_pretrained: the source has no tensor for {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''} ({len(missing)} missing); "
                             "pass key_map to rename, or strict=False")
        _check_shapes(reader, params, buffers, state)
        for keys, ref in params:
            _check_tied(reader, keys, ref.shape)
        with torch.no_grad():
            for keys, ref in params:
                _load_piece(reader, keys[0], ref, state)
            for key, buf in buffers:
                buf.copy_(reader.read(key, None))
        used = {key for keys, _ in params for key in keys} | {key for key, _ in buffers}
        return PretrainedKeys(missing, sorted(set(reader.keys()) - used))


def _match(model, state, reader, key_map) -> tuple:
    """([(source keys, SlotRef)], [(source key, buffer)], missing names); a
    tied parameter's source keys are all its names the source holds."""
    keys = set(reader.keys())
    names_of: dict = {}
    for name, ref in named_slots(model, state).items():
        names_of.setdefault((id(ref.bucket), ref.index), (ref, []))[1].append(name)
    params, missing = [], []
    for ref, names in names_of.values():
        found = [k for k in (key_map(n) for n in names) if k is not None and k in keys]
        if found:
            params.append((list(dict.fromkeys(found)), ref))  # key_map may merge names
        else:
            missing.append(names[0])
    buffers = []
    for name, buf in persistent_buffers(model).items():
        key = key_map(name)
        if key is not None and key in keys:
            buffers.append((key, buf))
        else:
            missing.append(name)
    return params, buffers, missing


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
