"""Helpers for wire formats that encode a bucket's params at once
(`WireFormat.batch_key`): join pieces into one flat buffer and spread
per-piece values over their elements, each in one op whatever the number of
pieces."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..compat import chunk_cat


def joined(pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The pieces (one dtype, none empty) flattened and joined into a new 1-D
    `dtype` tensor: one op, the cast inside."""
    out = torch.empty(1, sum(p.numel() for p in pieces), dtype=dtype, device=pieces[0].device)
    chunk_cat(list(pieces), 0, 1, out=out)
    return out.view(-1)


def back_to_back(pieces: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The pieces as one 1-D view when they lie back to back in one storage
    (one dtype, each contiguous, in order): no copy needed to join them. Else None."""
    first, total = pieces[0], 0
    at, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for p in pieces:  # back to back in memory is not enough: one storage must hold them
        if (p.dtype != first.dtype or not p.is_contiguous() or p.data_ptr() != at
                or p.untyped_storage().data_ptr() != storage):
            return None
        at += p.numel() * p.element_size()
        total += p.numel()
    return first.as_strided((total,), (1,))


def counts(cache: dict, name: str, device: torch.device, values: Callable) -> tuple:
    """(`values()` as an int64 tensor on `device`, their sum): made on first use
    and kept in `cache` (a batch's pieces keep their shapes, so they stay right)."""
    key = (name, device)
    if key not in cache:
        ints = values()
        cache[key] = (torch.tensor(ints, dtype=torch.int64, device=device), sum(ints))
    return cache[key]


def spread(values: torch.Tensor, cache: dict, name: str, repeats: Callable) -> torch.Tensor:
    """`values[i]` repeated `repeats()[i]` times, joined: one op. Their sum is
    known on the host, so nothing waits for the device."""
    times, total = counts(cache, name, values.device, repeats)
    return torch.repeat_interleave(values, times, output_size=total)


def fused_kernels(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the fused CUDA kernels (quantized_kernels.py) take `tensors`: all
    contiguous, on a CUDA device with Triton. Imports Triton only for a CUDA tensor."""
    device = tensors[0].device
    if device.type != "cuda" or not all(t.is_contiguous() for t in tensors):
        return False
    from .quantized_kernels import fused_available

    return fused_available(device)
