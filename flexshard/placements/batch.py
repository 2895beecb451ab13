"""Helpers for wire formats that encode a bucket's params at once
(`WireFormat.batch_key`): join pieces into one flat buffer, and cut a batch
into chunks whose float32 temporaries stay small.

Why chunks: a batch's eager encode works in float32 (a scaled copy of the
pieces before the cast to the wire dtype). Over the whole bucket at once that
copy, plus the scales spread over every element (and repeat_interleave's int64
index behind the spread), came to 4 + 4 + 8 bytes per element of the bucket's
shard: on CPU the quantized gathers' peak rose above FSDP2's bf16 gathers.
Cut into chunks of consecutive pieces of one block width, each scale is
broadcast over its block (a view, no spread) and the float32 copy is one
chunk's: at most CHUNK_ELEMENTS elements, or one piece where a piece is larger
(what a param-by-param loop needs anyway). The ops grow with the chunks, not
the params; CUDA runs the fused kernels (quantized_kernels.py) instead."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ..compat import chunk_cat
from ..tensor_views import back_to_back

CHUNK_ELEMENTS = 1 << 20  # 4 MiB of float32 temporaries at most, past one piece


def joined(pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The pieces (one dtype, none empty) flattened and joined into a new 1-D
    `dtype` tensor: one op, the cast inside."""
    out = torch.empty(1, sum(p.numel() for p in pieces), dtype=dtype, device=pieces[0].device)
    chunk_cat(list(pieces), 0, 1, out=out)
    return out.view(-1)


class Chunk(NamedTuple):
    """Pieces [lo, hi) of a batch, all of one block `width`: elements [start,
    stop) and blocks [first, last) of the batch joined in order."""

    lo: int
    hi: int
    start: int
    stop: int
    first: int
    last: int
    width: int


def chunks(numels: Sequence[int], widths: Sequence[int]) -> list:
    """Consecutive pieces of one block width (`widths`, each dividing its
    piece's numel), grouped while their elements stay within CHUNK_ELEMENTS;
    a piece larger than that is a chunk of its own."""
    limit, out = CHUNK_ELEMENTS, []
    start = first = 0
    for i, (numel, width) in enumerate(zip(numels, widths)):
        last = out[-1] if out else None
        if last is not None and last.width == width and last.stop - last.start + numel <= limit:
            out[-1] = last._replace(hi=i + 1, stop=start + numel, last=first + numel // width)
        else:
            out.append(Chunk(i, i + 1, start, start + numel, first, first + numel // width, width))
        start, first = start + numel, first + numel // width
    return out


def chunk_rows(pieces: Sequence[torch.Tensor], chunk: Chunk,
               join_as: torch.dtype, keep: tuple) -> tuple:
    """(the chunk's pieces as one [blocks, width] tensor, whether it is a new
    tensor the caller may write): a view where they lie back to back in a
    dtype of `keep`, else joined as `join_as` (one op, the cast inside)."""
    part = pieces[chunk.lo:chunk.hi]
    rows = back_to_back(part)
    fresh = rows is None or rows.dtype not in keep
    if fresh:
        rows = joined(part, join_as)
    return rows.view(chunk.last - chunk.first, chunk.width), fresh


def fused_kernels(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the fused CUDA kernels (quantized_kernels.py) take `tensors`: all
    contiguous, on a CUDA device with Triton. Imports Triton only for a CUDA tensor."""
    device = tensors[0].device
    if device.type != "cuda" or not all(t.is_contiguous() for t in tensors):
        return False
    from .quantized_kernels import fused_available

    return fused_available(device)
