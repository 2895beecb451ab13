"""Quantized gathers (ZeRO++'s qwZ, over flexshard's placements): weights travel as
int8 or fp8 (e4m3) with one fp32 scale per block of rows, and are dequantized to
the gather dtype after the all-gather. Master weights, grads and optimizer state
stay in full precision; only the all-gather's bytes shrink.

Blocks are whole rows (`block_rows` rows by every column; 1 by default: a scale
per row). A row-wise cut (Shard(0), RaggedShard over dim 0, Owned) then always
falls on a block boundary when it falls on a multiple of `block_rows` rows, so
each block's scale is computed on the one rank holding the block and the gathered
weight is bit-identical to quantizing the whole weight at once. Why rows and not
128x128 tiles: a tile crosses the cut of a column split and of a ragged row cut
that is not a multiple of 128; a row never crosses a row cut, costs 4 bytes per
row (1% of an int8 row of 384 columns) and follows outliers more closely.

`QuantizedGather` (a WirePolicy) quantizes a param only where that holds and
pays: floating params of 2+ dims with at least `min_numel` elements, split by
rows on a multiple of `block_rows`; the rest (norms, biases, small or
column-split tensors) travel in the gather dtype, and `fs.describe` counts them.

A bucket's quantized params are quantized together and dequantized together
(`encode_batch` / `decode_batch`), a chunk of params of one block width at a
time (placements/batch.py): per chunk one amax per block (aminmax), one divide
by the scales broadcast over their blocks, one round, clamp and cast; after the
gather one multiply. The same float32 operations element by element as one
param at a time, so the same bits, with float32 temporaries of at most one
chunk. On CUDA one fused kernel launch per bucket does each side instead
(quantized_kernels.py: each op of an eager loop is a kernel launch there,
+22-27% step time against bf16 gathers on an H100 param by param).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .batch import Chunk, back_to_back, chunk_rows, chunks, fused_kernels, joined
from .contract import Placement, WireFormat, WirePart
from .ragged import RaggedShard
from .wire import WirePolicy

# Largest magnitude each wire dtype holds: int8 symmetric (-127..127), e4m3's max.
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# A scale is amax times 1/qmax (a float32 multiply, what CUDA's eager divide by a
# Python number computes): the same bits on CPU, on CUDA and in the fused kernels.
_INV_QMAX = {dtype: 1.0 / qmax for dtype, qmax in _QMAX.items()}
_UP_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)  # exact in float32
# The dtype a batch's gathered data is joined in before its multiply promotes it to
# float32: int8 itself; float8 types do not promote, so e4m3 is joined as bf16
# (exact: every e4m3 value is a bf16), half the bytes of a float32 copy.
_JOIN_AS = {torch.int8: torch.int8, torch.float8_e4m3fn: torch.bfloat16}
_EPS = 1e-12  # an all-zero block keeps a finite scale (and decodes to zeros)
# The whole-step graph's decode (BlockQuantized.traced_decode) is one custom op of
# this namespace, so reshard after forward recomputes it whole (runtime/traced.py);
# so are a user-defined format's encode and decode (runtime/opaque_format.py).
DECODE_NAMESPACE = "flexshard"


def _dequantize(data: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`data` (a weight, rows first) times its blocks' `scales`, as `out_dtype`."""
    blocks = data.float().reshape(scales.numel(), data.numel() // max(scales.numel(), 1))
    blocks = blocks * scales[:, None]
    return blocks.view(data.shape).to(out_dtype)


@torch.library.custom_op(f"{DECODE_NAMESPACE}::dequantize_blocks", mutates_args=())
def dequantize_blocks(data: torch.Tensor, scales: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    return _dequantize(data, scales, out_dtype)


@dequantize_blocks.register_fake
def _(data, scales, out_dtype):
    return data.new_empty(data.shape, dtype=out_dtype)


@dataclass(frozen=True)
class BlockQuantized(WireFormat):
    """A weight as `dtype` data plus one fp32 scale per `block_rows` rows,
    decoded to `out_dtype`."""

    dtype: torch.dtype
    out_dtype: torch.dtype
    block_rows: int = 1

    decodes_into = True

    def parts(self, shape: torch.Size, placement: Placement, world_size: int) -> tuple:
        if not _row_cuts(shape, placement, world_size, self.block_rows):
            raise ValueError(
                f"{self} scales blocks of {self.block_rows} whole row(s), but {placement} over "
                f"{world_size} rank(s) does not cut the {tuple(shape)} tensor into pieces of "
                "whole rows, in rank order, each a multiple of block_rows: return None (a cast) "
                "for it from your gather_format, or use fs.QuantizedGather, which quantizes "
                "only the params that fit")
        rows = [placement.local_shape(shape, r, world_size)[0] for r in range(world_size)]
        units = tuple(n // self.block_rows for n in rows)
        scales = torch.Size([shape[0] // self.block_rows])
        return (WirePart(torch.Size(shape), self.dtype, placement),
                WirePart(scales, torch.float32, RaggedShard(units=units)))

    def encode(self, piece: torch.Tensor, outs: Sequence[torch.Tensor], mesh=None) -> None:
        data, scales = outs
        blocks = piece.float().reshape(scales.numel(), self._width(piece.shape))
        scale = blocks.abs().amax(dim=1).clamp(min=_EPS) * _INV_QMAX[self.dtype]
        self._quantize_into(blocks / scale[:, None], data)
        scales.copy_(scale)

    def decode(self, fulls: Sequence[torch.Tensor], meta=None) -> torch.Tensor:
        return _dequantize(*fulls, self.out_dtype)

    def traced_decode(self, fulls: Sequence[torch.Tensor]) -> torch.Tensor:
        """decode as one op a traced graph recomputes whole."""
        return dequantize_blocks(*fulls, self.out_dtype)

    def batch_key(self):
        return ("block quantized", self.dtype, self.out_dtype)

    def encode_batch(self, formats, pieces, mesh, cache) -> tuple:
        """encode of every piece, a chunk of pieces of one block width at a time
        (batch.py): (quantized data joined, scales joined)."""
        plan = cache.get("encode")
        if plan is None:
            widths = [f._width(p.shape) for f, p in zip(formats, pieces)]
            plan = cache["encode"] = chunks([p.numel() for p in pieces], widths)
        device = pieces[0].device
        data = torch.empty(plan[-1].stop, dtype=self.dtype, device=device)
        scales = torch.empty(plan[-1].last, dtype=torch.float32, device=device)
        for c in plan:
            self._encode_chunk(pieces, c, data[c.start:c.stop], scales[c.first:c.last])
        return (data, scales), [None] * len(pieces)

    def _encode_chunk(self, pieces, c: Chunk, data: torch.Tensor, scales: torch.Tensor) -> None:
        """A chunk's pieces quantized into `data` and `scales` (its temporaries
        freed on return, before the next chunk's are made)."""
        rows, fresh = chunk_rows(pieces, c, torch.float32, _UP_TO_FP32)
        low, high = torch.aminmax(rows, dim=1)  # max|x| = max(high, -low): no |x| copy
        amax = torch.maximum(high, low.neg_()).float()
        scale = torch.mul(amax.clamp_(min=_EPS), _INV_QMAX[self.dtype], out=scales)[:, None]
        # a view of the params: float32 out of place (promotion upcasts exactly)
        self._quantize_into(rows.div_(scale) if fresh else torch.div(rows, scale), data)

    def encode_batch_into(self, formats, pieces, outs, mesh, cache) -> Optional[list]:
        """On CUDA: the pieces quantized by one fused kernel launch straight into
        their parts in the gather input (`outs`); None elsewhere (encode_batch runs)."""
        if not fused_kernels(pieces):
            return None
        from .quantized_kernels import quantize_rows

        quantize_rows(pieces, [data for data, _ in outs], [scales for _, scales in outs],
                      [fmt._width(piece.shape) for fmt, piece in zip(formats, pieces)],
                      _QMAX[self.dtype], _INV_QMAX[self.dtype], _EPS, cache)
        return [None] * len(pieces)

    def batch_out(self, formats, shapes, device) -> tuple:
        """decode_batch's buffer: the params back to back in order of their
        blocks' width (_DecodePlan), and each param's view of it, in order."""
        plan = _DecodePlan(formats, shapes)
        out = torch.empty(sum(plan.numels), dtype=self.out_dtype, device=device)
        params = [None] * len(shapes)
        for i, piece in zip(plan.order, out.split_with_sizes(plan.numels)):
            params[i] = piece.view(shapes[i])
        return out, params

    def decode_batch(self, formats, fulls, metas, cache, out=None) -> list:
        """decode of every param at once, each a view of one buffer (`out`, else
        new): the params joined in order of their blocks' width, so that one
        multiply by the scales (broadcast over a block) covers all params of one
        width. On CUDA one fused kernel launch reads the gathered parts instead."""
        plan = cache.get("decode")
        if plan is None:
            plan = cache["decode"] = _DecodePlan(formats, [parts[0].shape for parts in fulls])
        if out is None:
            out = torch.empty(sum(plan.numels), dtype=self.out_dtype, device=fulls[0][0].device)
        if fused_kernels([f for parts in fulls for f in parts]):
            return self._decode_fused(formats, fulls, plan, out, cache)
        data = [fulls[i][0] for i in plan.order]
        scales = [fulls[i][1] for i in plan.order]
        for c in plan.chunks:
            self._decode_chunk(data, scales, c, out[c.start:c.stop])
        params = [None] * len(fulls)
        for i, piece in zip(plan.order, out.split_with_sizes(plan.numels)):
            params[i] = piece.view(fulls[i][0].shape)
        return params

    def _decode_chunk(self, data, scales, c: Chunk, out: torch.Tensor) -> None:
        """A chunk's params dequantized into `out`: computed in float32 (type
        promotion), rounded once into `out`, as decode's float(), multiply and
        cast, without a float32 copy (the joined wire data freed on return)."""
        rows, _ = chunk_rows(data, c, _JOIN_AS[self.dtype], (torch.int8,))
        scale = back_to_back(scales[c.lo:c.hi])
        scale = joined(scales[c.lo:c.hi], torch.float32) if scale is None else scale
        torch.mul(rows, scale[:, None], out=out.view(rows.shape))

    def _decode_fused(self, formats, fulls, plan: "_DecodePlan", out: torch.Tensor,
                      cache: dict) -> list:
        """decode_batch's params in `out`, laid out as the eager path lays them out,
        written by one kernel launch from their gathered parts (no join, no float32 copy)."""
        from .quantized_kernels import dequantize_rows

        params = [None] * len(fulls)
        for i, piece in zip(plan.order, out.split_with_sizes(plan.numels)):
            params[i] = piece.view(fulls[i][0].shape)
        dequantize_rows([data for data, _ in fulls], [scales for _, scales in fulls], params,
                        [fmt._width(data.shape) for fmt, (data, _) in zip(formats, fulls)],
                        cache)
        return params

    def _width(self, shape: torch.Size) -> int:
        """Elements of one block: `block_rows` rows of every column."""
        return self.block_rows * math.prod(shape[1:])

    def _quantize_into(self, scaled: torch.Tensor, out: torch.Tensor) -> None:
        """`scaled` (a float32 tensor of its own, overwritten) rounded (int8),
        saturated to the wire dtype and cast into `out`."""
        if self.dtype == torch.int8:
            scaled.round_().clamp_(-127, 127)
        else:
            scaled.clamp_(-448.0, 448.0)
        out.copy_(scaled.view(out.shape))


class _DecodePlan:
    """A batch's params in order of block width (`order`), their element
    counts in that order, and the chunks (batch.py) of that order: each one
    multiply by its blocks' scales."""

    def __init__(self, formats: Sequence[BlockQuantized], shapes: Sequence[torch.Size]) -> None:
        widths = [f._width(shape) for f, shape in zip(formats, shapes)]
        self.order = sorted(range(len(shapes)), key=lambda i: widths[i])
        self.numels = [math.prod(shapes[i]) for i in self.order]
        self.chunks = chunks(self.numels, [widths[i] for i in self.order])


@dataclass(frozen=True)
class QuantizedGather(WirePolicy):
    """Gather a bucket's weights quantized: `MixedPrecisionPolicy(gather_format=
    fs.QuantizedGather(torch.int8))`. `dtype`: torch.int8 or torch.float8_e4m3fn;
    `block_rows`: rows per scale; `min_numel`: smaller params are not quantized."""

    dtype: torch.dtype = torch.int8
    block_rows: int = 1
    min_numel: int = 4096

    def __post_init__(self) -> None:
        if self.dtype not in _QMAX:
            raise ValueError(f"QuantizedGather: dtype must be torch.int8 or "
                             f"torch.float8_e4m3fn, got {self.dtype!r}")
        for name in ("block_rows", "min_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "block_rows"):
                raise ValueError(f"QuantizedGather: {name} must be an int >= "
                                 f"{int(name == 'block_rows')}, got {value!r}")

    def format(self, fqn: str, shape: torch.Size, dtype: torch.dtype,
               gather_dtype: torch.dtype, placement: Placement,
               world_size: int) -> Optional[WireFormat]:
        if not (gather_dtype.is_floating_point and len(shape) >= 2
                and math.prod(shape) >= self.min_numel
                and _row_cuts(shape, placement, world_size, self.block_rows)):
            return None
        return BlockQuantized(self.dtype, gather_dtype, self.block_rows)


def _row_cuts(shape: torch.Size, placement: Placement, world_size: int,
              block_rows: int) -> bool:
    """Whether `placement` cuts `shape` into whole rows in rank order, each
    rank's rows a multiple of `block_rows`."""
    if not placement.rank_major(shape):
        return False
    local = [placement.local_shape(shape, r, world_size) for r in range(world_size)]
    return all(s[1:] == shape[1:] and s[0] % block_rows == 0 for s in local)
