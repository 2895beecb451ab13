"""Fused quantize and dequantize of quantized gathers on CUDA (Triton).

The eager ops of `BlockQuantized.encode_batch` / `decode_batch` read and write a
bucket's weights about ten times (join, abs, amax, spread, divide, round, clamp,
cast, scatter; join, multiply): on an H200 at 8 Llama-3-8B layers and a fake world
of 8 that was +24% step time against bf16 gathers. Here each weight is one launch
that reads it once and writes its wire parts (or its decoded tensor) once:

- `quantize_rows`: per block of rows, amax over the block, scale = max(amax, eps)
  times 1/qmax, then every element divided by the scale (IEEE division, `div_rn`),
  rounded half to even (int8) and clamped, written straight into the gather input.
- `dequantize_rows`: every element times its block's scale in float32, rounded
  once to the output dtype.
- `scale_and_cast`: torchao's float8 weight cast (placements/float8.py), a weight
  times its scale, saturated and cast, written straight into the gather input. Its
  eager path spreads each weight's scale over its elements with repeat_interleave,
  whose CUDA kernel writes each repeat from one thread: 65 ms per step on an H200.

The same float32 operations, element by element, as the eager path: the same bits
(tests/test_cuda.py compares them on the GPU). Used only on CUDA devices where
Triton imports; everywhere else (CPU, or `FLEXSHARD_FUSED_QUANT=0`) the eager
path runs. quantized.py imports this module only for a CUDA tensor.
"""

from __future__ import annotations

import os

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


def quantize_rows(src: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                  qmax: float, inv_qmax: float, eps: float) -> None:
    """Quantize `src` ([blocks, width], contiguous) into `data` (int8 or e4m3,
    same shape) and `scales` ([blocks] float32)."""
    blocks, width = src.shape
    if blocks:
        _quantize[(blocks,)](src, data, scales, width, qmax, inv_qmax, eps,
                             INT8=data.dtype == torch.int8, BLOCK=_BLOCK, num_warps=8)


def dequantize_rows(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """`out` ([blocks, width]) = `data` ([blocks, width]) times `scales[:, None]`,
    in float32, rounded once to out's dtype."""
    blocks, width = data.shape
    if blocks:
        _dequantize[(blocks, -(-width // _BLOCK))](data, scales, out, width, BLOCK=_BLOCK,
                                                   num_warps=4)


def scale_and_cast(src: torch.Tensor, scales: torch.Tensor, index: int, out: torch.Tensor,
                   top: float) -> None:
    """`out` = `src` times `scales[index]` in float32, saturated to +-`top` and cast to
    out's dtype (torchao's float8 weight cast: placements/float8.py), all contiguous."""
    n = src.numel()
    if n:
        _scale_and_cast[(-(-n // _BLOCK),)](src, scales, index, out, n, top, BLOCK=_BLOCK,
                                             num_warps=4)


if triton is not None:
    @triton.jit
    def _quantize(src, data, scales, width, qmax, inv_qmax, eps,
                  INT8: tl.constexpr, BLOCK: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * width
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(src + base + cols, mask=cols < width, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), eps) * inv_qmax
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            x = tl.load(src + base + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.math.div_rn(x, scale)
            if INT8:  # + and - 1.5 * 2**23: rounds |y| < 2**22 half to even, as torch.round
                y = (y + 12582912.0) - 12582912.0
            y = tl.minimum(tl.maximum(y, -qmax), qmax)
            tl.store(data + base + cols, y.to(data.dtype.element_ty), mask=mask)
        tl.store(scales + tl.program_id(0), scale)

    @triton.jit
    def _dequantize(data, scales, out, width, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        at = row.to(tl.int64) * width + cols
        scale = tl.load(scales + row)
        x = tl.load(data + at, mask=mask).to(tl.float32)
        tl.store(out + at, (x * scale).to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _scale_and_cast(src, scales, index, out, n, top, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        scale = tl.load(scales + index)
        y = tl.load(src + at, mask=mask, other=0.0).to(tl.float32) * scale
        y = tl.minimum(tl.maximum(y, -top), top)
        tl.store(out + at, y.to(out.dtype.element_ty), mask=mask)
