"""Ranks that load a full source into a sharded model read the same values.

Each rank copies only its own pieces out of a full source (a state dict, or
safetensors files). When the ranks' sources differ (a "pretrained" state dict
built from an unseeded random model on every rank, files that differ between
nodes), every rank still loads without error and the model trains silently
wrong: its pieces come from different tensors.

So before anything is written, every rank reduces what it read to one
checksum per parameter, and one all-gather of those (one int64 each, plus a
failure flag) compares them: every rank raises the same ValueError naming the
tensors that differ. Persistent buffers are compared for presence only: they
are not sharded, so each rank loads its own source's, and per-rank values
(BatchNorm's running stats, as under DDP without SyncBatchNorm) are
legitimate. A rank whose own checks failed
(a key missing from its source) joins the same all-gather, so no rank waits
in a collective the others never enter.

A checksum covers a sample of the full tensor, the same on every rank and for
every kind of source: the whole tensor up to _SAMPLE_ELEMENTS, else evenly
spaced rows (`sample_slices`). It is exact (integer sums of the bytes), so
equal sources always agree, on any device and thread count.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from ..runtime.state import FlexShardState, files_group

ABSENT = -1  # the checksum of a tensor this rank's source does not have (checksums are >= 0)
UNCOMPARED = -2  # on every rank, for a tensor each group loads its own values of (experts)
PRESENT = -3  # a buffer the source has: each rank loads its own (buffers are per rank), so
# only whether the sources hold it is compared
_SAMPLE_ELEMENTS = 1 << 18  # elements read per tensor: 1 MiB of float32
_MODULUS = (1 << 61) - 1  # checksums fit an int64
_SHOWN = 3  # tensors named in the error; the rest are counted


def sample_slices(shape: tuple) -> Optional[tuple]:
    """The part of a tensor of `shape` every rank checksums: None for the whole
    tensor, else slices (evenly spaced rows; within a row too big for the
    sample, its first row's sample)."""
    if math.prod(shape) <= _SAMPLE_ELEMENTS:
        return None
    return _rows(tuple(shape))


def _rows(shape: tuple) -> tuple:
    rest = math.prod(shape[1:])
    if rest <= _SAMPLE_ELEMENTS:
        step = math.ceil(shape[0] / max(1, _SAMPLE_ELEMENTS // rest))
        return (slice(0, shape[0], step),) + tuple(slice(0, n) for n in shape[1:])
    return (slice(0, 1),) + _rows(shape[1:])


def checksum(read: Callable, shape: tuple) -> int:
    """An exact checksum of the sample of a tensor (`read(slices or None)`
    gives the sample, from a state dict or a file), equal on every rank that
    reads equal values."""
    sample = read(sample_slices(tuple(shape))).detach().reshape(-1)
    if (sample.storage_offset() * sample.element_size()) % 4:
        sample = sample.clone()  # an int32 view needs an aligned start
    raw = sample.view(torch.uint8)
    whole = raw.numel() // 4 * 4
    words, tail = raw[:whole].view(torch.int32), raw[whole:]
    # at most 2^19 words of < 2^31 each: the int64 sums cannot overflow
    sums = [int(words.sum(dtype=torch.int64)), int(words[::2].sum(dtype=torch.int64)),
            int(tail.sum(dtype=torch.int64)), raw.numel()]
    value = 0
    for term in sums:
        value = (value * 1_000_003 + term) % _MODULUS
    return value


def check_sources_agree(state: FlexShardState, names: Sequence[str], checksums: Sequence[int],
                        error: Optional[BaseException], what: str) -> None:
    """Raise on every rank unless every rank read the same values.

    `names` (the same list on every rank: the model's parameters and
    persistent buffers) and `checksums` (this rank's, ABSENT for a tensor its
    source lacks) line up; `error` is this rank's own failure, if any, which is
    raised here after the collective (other ranks raise a ValueError naming
    this rank). One all-gather; none at world size 1."""
    group, rank, size = files_group(state)
    if group is None or size == 1:
        if error is not None:
            raise error
        return
    mine = torch.tensor([0 if error is None else 1, *(checksums if error is None else
                                                      [ABSENT] * len(names))], dtype=torch.int64)
    if mine.numel() != len(names) + 1:
        raise AssertionError(f"{len(names)} names but {mine.numel() - 1} checksums")
    device = state.buckets[0].compute_device if state.buckets else torch.device("cpu")
    table = torch.empty((size, mine.numel()), dtype=torch.int64, device=device)
    state.comm.all_gather(table.view(-1).view(torch.uint8),
                          mine.to(device).view(torch.uint8), group)
    table = table.cpu()
    if error is not None:
        raise error
    failed = [r for r in range(size) if table[r, 0]]
    if failed:
        raise ValueError(f"{what}: rank(s) {failed} could not load the source (their own "
                         "error says why), so no rank loaded it; every rank must load the "
                         "same source")
    _raise_on_difference(table[:, 1:], names, what)


def _raise_on_difference(table: torch.Tensor, names: Sequence[str], what: str) -> None:
    """ValueError naming the tensors whose checksums differ across ranks."""
    differs = (table != table[:1]).any(dim=0).nonzero().flatten().tolist()
    if not differs:
        return
    first = table[:, differs[0]]
    groups: dict = {}
    for r, value in enumerate(first.tolist()):
        groups.setdefault(value, []).append(r)
    read = " vs ".join(f"rank(s) {ranks}" + (" (not in their source)" if value == ABSENT else "")
                       for value, ranks in groups.items())
    shown = [names[i] for i in differs[:_SHOWN]]
    more = f" and {len(differs) - _SHOWN} more" if len(differs) > _SHOWN else ""
    raise ValueError(
        f"{what}: the ranks' sources hold different values for {shown}{more} (for "
        f"{shown[0]!r}: {read}), so their pieces would come from different tensors and "
        "training would be silently wrong; nothing was loaded. Every rank must load the same "
        "source: the same files, or a state dict built alike on every rank (seed the model that "
        "makes it, e.g. torch.manual_seed(0) before building it, or load it from one file)")
