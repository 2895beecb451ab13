"""Fused quantize and dequantize of quantized gathers on CUDA (Triton).

The eager ops of `BlockQuantized.encode_batch` / `decode_batch` read and write a
bucket's weights about ten times (amax, divide, round, clamp, cast, scatter; join,
multiply), a chunk at a time: on an H200 at 8 Llama-3-8B layers and a fake world of 8
that was +24% step time against bf16 gathers. Here a bucket's weights are one
launch (a program per block of rows of any of them, which reads it once and writes
its wire parts, or its decoded rows, once). One launch per weight was 224 a step at
that shape, and the host, not the GPU, set the step's pace. A table made once per
bucket layout says where each block lies within its tensor, and a few numbers per
call where each tensor lies (`_table`): the gather buffers move between calls.

- `quantize_rows`: per block of rows, amax over the block, scale = max(amax, eps)
  times 1/qmax, then every element divided by the scale (IEEE division, `div_rn`),
  rounded half to even (int8) and clamped, written straight into the gather input.
- `dequantize_rows`: every element times its block's scale in float32, rounded
  once to the output dtype.
- `scale_and_cast`: torchao's float8 weight cast (placements/float8.py), a weight
  times its scale, saturated and cast, written straight into the gather input. Its
  eager path once spread each weight's scale over its elements with repeat_interleave,
  whose CUDA kernel writes each repeat from one thread: 65 ms per step on an H200.

The same float32 operations, element by element, as the eager path: the same bits
(tests/test_cuda.py compares them on the GPU; tests/test_quantized_kernels.py runs
them under Triton's interpreter and compiles them for sm_90 on a CPU machine). Used
only on CUDA devices where Triton imports; everywhere else (CPU, or
`FLEXSHARD_FUSED_QUANT=0`) the eager path runs. quantized.py imports this module
only for a CUDA tensor.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch

try:  # Triton ships with CUDA builds of torch; without it the eager path runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = None

_BLOCK = 2048  # elements per step of a program's loop over its block of rows


def fused_available(device: torch.device) -> bool:
    """Whether tensors on `device` take the fused kernels: CUDA with Triton, unless
    switched off (FLEXSHARD_FUSED_QUANT=0, to measure the eager path beside them)."""
    return (device.type == "cuda" and triton is not None
            and os.environ.get("FLEXSHARD_FUSED_QUANT", "1") != "0")


def quantize_rows(srcs: Sequence[torch.Tensor], datas: Sequence[torch.Tensor],
                  scales: Sequence[torch.Tensor], widths: Sequence[int], qmax: float,
                  inv_qmax: float, eps: float, cache: dict) -> None:
    """Quantize each `srcs[i]` (contiguous, of blocks of `widths[i]` elements) into
    `datas[i]` (int8 or e4m3, its shape) and `scales[i]` (float32, one per block):
    one launch for them all (one per source dtype), a program per block."""
    int8 = datas[0].dtype == torch.int8
    for dtype, members in _by_dtype(srcs).items():
        roles = ([datas[i] for i in members], [scales[i] for i in members],
                 [srcs[i] for i in members])
        table, starts, bases, align = _table(cache, ("quantize", dtype), roles,
                                             [widths[i] for i in members])
        if table.shape[0]:
            _quantize[(table.shape[0],)](*bases, table, starts, qmax, inv_qmax, eps, INT8=int8,
                                         ALIGN=align, BLOCK=_BLOCK, num_warps=8)


def dequantize_rows(datas: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                    outs: Sequence[torch.Tensor], widths: Sequence[int], cache: dict) -> None:
    """Each `outs[i]` = `datas[i]` times its blocks' `scales[i]` (blocks of `widths[i]`
    elements), in float32, rounded once to out's dtype: one launch, a program per block."""
    table, starts, bases, align = _table(cache, ("dequantize",), (datas, scales, outs), widths)
    if table.shape[0]:
        _dequantize[(table.shape[0],)](*bases, table, starts, ALIGN=align, BLOCK=_BLOCK,
                                       num_warps=4)


def scale_and_cast(srcs: Sequence[torch.Tensor], scales: torch.Tensor,
                   outs: Sequence[torch.Tensor], top: float, cache: dict) -> None:
    """Each `outs[i]` = `srcs[i]` times `scales[i]` in float32, saturated to +-`top`
    and cast to out's dtype (torchao's float8 weight cast: placements/float8.py), all
    contiguous: one launch (one per source dtype), a program per `_BLOCK` elements."""
    for dtype, members in _by_dtype(srcs).items():
        roles = ([outs[i] for i in members], [scales[i:i + 1] for i in members],
                 [srcs[i] for i in members])
        table, starts, bases, align = _table(cache, ("cast", dtype), roles,
                                             [_BLOCK] * len(members), scale_step=0)
        if table.shape[0]:
            _scale_and_cast[(table.shape[0],)](*bases, table, starts, top, ALIGN=align,
                                               BLOCK=_BLOCK, num_warps=4)


def _by_dtype(srcs: Sequence[torch.Tensor]) -> dict:
    """dtype -> the indices of `srcs` of it (a kernel's source pointer has one type)."""
    out: dict = {}
    for i, src in enumerate(srcs):
        out.setdefault(src.dtype, []).append(i)
    return out


def _table(cache: dict, name: tuple, roles: tuple, widths: Sequence[int],
           scale_step: int = 1) -> tuple:
    """(table, starts, bases, align) of one launch over every block of the tensors of
    `roles`: (first, scales, second), the first and the second of one numel each, in
    blocks of `width` elements (the last one short if need be), each block's scale
    `scale_step` after the block before's (0: one scale a tensor).

    `table`, a row per block: its tensor, where its first, its scale and its second
    start within that tensor's, and its length. It depends on the shapes alone: made
    once per `name` and layout. `starts`, a row per tensor: where its first, scales and
    second start, in elements from each role's base (the start of the role's storage
    lowest in memory, so that one launch reaches tensors wherever they lie). Gather
    buffers move from call to call: the few recent `starts` are kept, on the device.
    `align`: the largest power of two (at most 16) dividing every offset and length of
    the first and second, for the kernels' vector accesses."""
    bases = [_storage_start(min(tensors, key=lambda t: t.untyped_storage().data_ptr()))
             for tensors in roles]
    offsets = tuple(tuple(_elements(t, base) for t in tensors)
                    for tensors, base in zip(roles, bases))
    numels = tuple(t.numel() for t in roles[0])
    device = bases[0].device
    key = (tuple(widths), numels, scale_step, device)
    kept = cache.get(name)
    if kept is None or kept[0] != key:
        kept = cache[name] = (key, _layout(widths, numels, scale_step).to(device), {})
    placed = kept[2]
    starts = placed.get(offsets)
    if starts is None:
        if len(placed) >= _PLACES_KEPT:
            placed.pop(next(iter(placed)))  # the oldest
        starts = placed[offsets] = _to_device(torch.tensor(list(zip(*offsets)),
                                                           dtype=torch.int64), device)
    align = math.gcd(16, *offsets[0], *offsets[2], *widths, *numels)  # a power of two
    if device.type == "cuda":  # read on this stream: not reused before it has
        stream = torch.cuda.current_stream(device)
        kept[1].record_stream(stream)
        starts.record_stream(stream)
    return kept[1], starts, bases, align


_PLACES_KEPT = 8  # a bucket's gathers in forward and in backward, with room to spare


def _to_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`rows` on `device` without the host waiting for the GPU, as a synchronous copy
    from pageable memory would. (Until the layout and the places were apart, each
    gather rebuilt its whole table and copied it so: on an H200 int8 gathers stepped
    1.41x bf16's, the host 68 ms a step busier.)"""
    if device.type != "cuda":
        return rows
    return rows.pin_memory().to(device, non_blocking=True)


def _layout(widths: Sequence[int], numels: Sequence[int], scale_step: int) -> torch.Tensor:
    """_table's `table`: per block (tensor, first, scale, second, length), in elements
    from the start of its tensor's first, scales and second."""
    rows = []
    for i, (width, numel) in enumerate(zip(widths, numels)):
        starts = torch.arange(0, numel, width, dtype=torch.int64)
        rows.append(torch.stack([torch.full_like(starts, i), starts,
                                 starts // width * scale_step, starts,
                                 (numel - starts).clamp(max=width)], dim=1))
    return torch.cat(rows) if rows else torch.empty(0, 5, dtype=torch.int64)


def _storage_start(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor of `tensor`'s dtype at the start of its storage."""
    return tensor.new_empty(0).set_(tensor.untyped_storage(), 0, (0,))


def _elements(tensor: torch.Tensor, base: torch.Tensor) -> int:
    """Elements from `base` to `tensor` (one dtype), by address."""
    gap = tensor.data_ptr() - base.data_ptr()
    if gap % tensor.element_size():
        raise AssertionError(f"a fused kernel's tensors lie {gap} bytes apart, not a "
                             f"multiple of {tensor.dtype}'s size")
    return gap // tensor.element_size()


if triton is not None:
    @triton.jit
    def _block(table, starts, ALIGN: tl.constexpr):
        """This program's row of `table` (_table): where its block of the first, its
        scale and its block of the second start (its tensor's place plus its own),
        and its length."""
        row = table + tl.program_id(0).to(tl.int64) * 5
        tensor = starts + tl.load(row) * 3
        first = tl.multiple_of(tl.load(tensor) + tl.load(row + 1), ALIGN)
        scale = tl.load(tensor + 1) + tl.load(row + 2)
        second = tl.multiple_of(tl.load(tensor + 2) + tl.load(row + 3), ALIGN)
        return first, scale, second, tl.multiple_of(tl.load(row + 4), ALIGN)

    @triton.jit
    def _quantize(data, scales, src, table, starts, qmax, inv_qmax, eps,
                  INT8: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
        # this program's block: where its data, its scale and its source start, its width
        at, scale_at, src_at, width = _block(table, starts, ALIGN)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + src_at + cols, mask=cols < width, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), eps) * inv_qmax
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            x = tl.load(src + src_at + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.math.div_rn(x, scale)
            if INT8:  # + and - 1.5 * 2**23: rounds |y| < 2**22 half to even, as torch.round
                y = (y + 12582912.0) - 12582912.0
            y = tl.minimum(tl.maximum(y, -qmax), qmax)
            tl.store(data + at + cols, y.to(data.dtype.element_ty), mask=mask)
        tl.store(scales + scale_at, scale)

    @triton.jit
    def _dequantize(data, scales, out, table, starts, ALIGN: tl.constexpr,
                    BLOCK: tl.constexpr):
        at, scale_at, out_at, width = _block(table, starts, ALIGN)
        scale = tl.load(scales + scale_at)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            x = tl.load(data + at + cols, mask=mask).to(tl.float32)
            tl.store(out + out_at + cols, (x * scale).to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _scale_and_cast(out, scales, src, table, starts, top, ALIGN: tl.constexpr,
                        BLOCK: tl.constexpr):
        at, scale_at, src_at, n = _block(table, starts, ALIGN)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        scale = tl.load(scales + scale_at)
        y = tl.load(src + src_at + cols, mask=mask, other=0.0).to(tl.float32) * scale
        y = tl.minimum(tl.maximum(y, -top), top)
        tl.store(out + at + cols, y.to(out.dtype.element_ty), mask=mask)
