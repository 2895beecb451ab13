"""The fused quantize/dequantize kernels (flexshard/placements/quantized_kernels.py)
against the eager path of `BlockQuantized`, bit for bit: the gather input's bytes
(data and scales) and the decoded params.

Also torchao's float8 weight cast (`check_float8`). Run on CUDA by
tests/test_cuda.py (every wire dtype, input and output dtype), and
on CPU by tests/test_quantized_kernels.py through Triton's interpreter:

    TRITON_INTERPRET=1 python tests/fused_quant_check.py

The interpreter rounds bfloat16 and float8 stores unlike a GPU (it truncates), so
on CPU only int8 into float32 is compared; the GPU compares every pair.
"""

from __future__ import annotations

import sys

import torch

from flexshard.placements import quantized
from flexshard.placements.quantized import BlockQuantized

# widths below, at and above one step of a kernel's loop (2048 elements), and a
# param with an all-zero block
SHAPES = [(64, 80), (48, 16), (8, 2048), (6, 5000)]


def check(device: str, qdtype: torch.dtype, dtype: torch.dtype, out_dtype: torch.dtype,
          block_rows: int = 1, shared: bool = False, cache=None) -> None:
    """Raise AssertionError unless the fused path writes what the eager one does.
    `cache`: the kernels' tables kept from a call with the tensors elsewhere."""
    cache = {} if cache is None else cache
    gen = torch.Generator().manual_seed(0)
    pieces = [(torch.randn(s, generator=gen) * 3).to(device=device, dtype=dtype) for s in SHAPES]
    pieces[1][:block_rows].zero_()
    formats = [BlockQuantized(qdtype, out_dtype, block_rows) for _ in SHAPES]
    fmt = formats[0]
    (data, scales), _ = fmt.encode_batch(formats, pieces, None, {})
    outs = [(torch.full(p.shape, 3, dtype=torch.int8, device=device).view(qdtype),
             torch.full((p.shape[0] // block_rows,), -1.0, device=device)) for p in pieces]
    if shared:  # as a bucket holds them: the pieces in one storage, the parts in one buffer
        pieces = _carved(pieces, torch.empty(_room(pieces), dtype=dtype, device=device))
        datas, scales_ = zip(*outs)
        split = -(-_room(datas) // 16) * 16
        send = torch.full((split + 4 * _room(scales_),), 3, dtype=torch.uint8, device=device)
        outs = list(zip(_carved(datas, send[:split].view(qdtype)),
                        _carved(scales_, send[split:].view(torch.float32))))
    assert fmt.encode_batch_into(formats, pieces, outs, None, cache) is not None, \
        "the fused encode did not run"
    fused_data = torch.cat([d.reshape(-1).view(torch.uint8) for d, _ in outs])
    assert torch.equal(fused_data, data.view(torch.uint8)), \
        f"{qdtype} data differs at {(fused_data != data.view(torch.uint8)).sum()} elements"
    assert torch.equal(torch.cat([s for _, s in outs]), scales), f"{qdtype} scales differ"
    fulls = [list(parts) for parts in outs]
    fused = fmt._decode_fused(formats, fulls, quantized._DecodePlan(formats, SHAPES),
                              fmt.batch_out(formats, SHAPES, torch.device(device))[0], cache)
    eager = _eager_decode(fmt, formats, fulls)
    for got, want in zip(fused, eager):
        assert got.dtype == want.dtype == out_dtype and got.shape == want.shape
        assert torch.equal(got, want), f"{qdtype} -> {out_dtype}: decoded params differ"


def check_float8(device: str, dtype: torch.dtype, wire: torch.dtype,
                 shared: bool = False) -> None:
    """torchao's float8 weight cast (placements/float8.py): the fused cast_into
    writes the bits the eager cast joins, scales far apart and one weight zero.
    `wire` float32 (the interpreter's run: its float8 rounding is not a GPU's) checks
    each weight's place and scale: the products, exactly."""
    from flexshard.placements import float8

    gen = torch.Generator().manual_seed(1)
    pieces = [(torch.randn(s, generator=gen) * 10.0 ** (i - 2)).to(device=device, dtype=dtype)
              for i, s in enumerate(SHAPES)]
    pieces[0].zero_()
    scale_dtype = torch.float8_e4m3fn if wire == torch.float32 else wire
    scale = float8.scales(float8.amax(pieces, None), scale_dtype)
    if wire == torch.float32:
        eager = torch.cat([(p.float() * s).reshape(-1) for p, s in zip(pieces, scale)])
    else:
        eager = float8.cast(pieces, scale, wire, {})
    outs = [_unwritten(p.shape, wire, device) for p in pieces]
    if shared:  # the pieces in one storage, the outputs in one gather input
        pieces = _carved(pieces, torch.empty(_room(pieces), dtype=dtype, device=device))
        outs = _carved(outs, _unwritten((_room(outs),), wire, device))
    float8.cast_into(pieces, scale, outs, {})
    fused = torch.cat([o.reshape(-1) for o in outs])
    assert torch.equal(fused.view(torch.uint8), eager.view(torch.uint8)), \
        f"{dtype} -> {wire}: {(fused.view(torch.uint8) != eager.view(torch.uint8)).sum()} " \
        "bytes differ"


def _unwritten(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of `dtype` holding 3 in every byte (or 3.0: float32), before a kernel writes."""
    if dtype.itemsize > 1:
        return torch.full(shape, 3.0, dtype=dtype, device=device)
    return torch.full(shape, 3, dtype=torch.uint8, device=device).view(dtype)


def _room(tensors) -> int:
    """Elements for `tensors` and a gap of 16 after each."""
    return sum(t.numel() + 16 for t in tensors)


def _carved(tensors, flat: torch.Tensor) -> list:
    """Copies of `tensors` carved out of `flat` (their dtype), in reverse order with
    gaps: one launch reaches them by their offsets in one storage."""
    out, at = [None] * len(tensors), 0
    for i in reversed(range(len(tensors))):
        out[i] = flat[at:at + tensors[i].numel()].view(tensors[i].shape).copy_(tensors[i])
        at += tensors[i].numel() + 16
    return out


def _eager_decode(fmt, formats, fulls) -> list:
    """decode_batch with the fused kernels switched off."""
    fused = quantized.fused_kernels
    quantized.fused_kernels = lambda tensors: False
    try:
        return fmt.decode_batch(formats, fulls, [None] * len(fulls), {})
    finally:
        quantized.fused_kernels = fused


if __name__ == "__main__":  # the interpreter run on CPU: the kernels take CPU tensors
    quantized.fused_kernels = lambda tensors: True
    for block_rows in (1, 2):
        cache: dict = {}  # one bucket's: its tensors elsewhere at each call
        check("cpu", torch.int8, torch.float32, torch.float32, block_rows, False, cache)
        layouts = {name: kept[1] for name, kept in cache.items()}
        for shared in (True, False):
            check("cpu", torch.int8, torch.float32, torch.float32, block_rows, shared, cache)
        assert sorted(map(str, layouts)) == ["('dequantize',)", "('quantize', torch.float32)"]
        assert all(cache[name][1] is table for name, table in layouts.items()), \
            "a fused kernel's table was made again for tensors that moved"
    print("fused int8 encode/decode: bit-equal to eager (Triton interpreter, CPU), "
          "tables made once per layout")
    for shared in (False, True):
        check_float8("cpu", torch.float32, torch.float32, shared)
    print("fused float8 cast: each weight at its place and scale (Triton interpreter, CPU)")
    sys.exit(0)
