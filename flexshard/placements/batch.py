"""Helpers for wire formats that encode a bucket's params at once
(`WireFormat.batch_key`): join pieces into one flat buffer and spread
per-piece values over their elements, each in one op whatever the number of
pieces."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..compat import chunk_cat


def joined(pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The pieces (one dtype, none empty) flattened and joined into a new 1-D
    `dtype` tensor: one op, the cast inside."""
    out = torch.empty(1, sum(p.numel() for p in pieces), dtype=dtype, device=pieces[0].device)
    chunk_cat(list(pieces), 0, 1, out=out)
    return out.view(-1)


def spread(values: torch.Tensor, cache: dict, name: str, counts: Callable) -> torch.Tensor:
    """`values[i]` repeated `counts()[i]` times, joined (one op). The counts
    (a list of ints, the same every step: the batch's pieces keep their shapes)
    go to the device on first use and stay in `cache`; their sum is known on
    the host, so nothing waits for the device."""
    key = (name, values.device)
    if key not in cache:
        ints = counts()
        cache[key] = (torch.tensor(ints, dtype=torch.int64, device=values.device), sum(ints))
    repeats, total = cache[key]
    return torch.repeat_interleave(values, repeats, output_size=total)
