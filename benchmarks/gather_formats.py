"""Ops and copied bytes per step of flexshard's low-precision gathers (torchao
float8, `fs.QuantizedGather` int8 / fp8) against its own bf16 gathers and
against FSDP2 (bf16, and + torchao float8), one rank of a fake world (issue 34,
goal 5).

    OMP_NUM_THREADS=1 python -m benchmarks.gather_formats [--world 8] [--preset cpu]

One process: each row makes its own fake world (benchmarks/harness/fake_world.py:
torch's "fake" backend, collectives move nothing) over the same HF Llama (bf16 params,
fp32 reduce, reshard after forward) and counts one forward+backward after a
warm-up step with fake_world's OpCounter, and the peak of live bytes over a
third step (meters.MemoryMeter: params, grads, temporaries; CPU allocator
blocks). "per param" rows build the same model with batching turned off (each
format's `batch_key` returning None while flex_shard plans): the encode and
decode one param at a time, as before batched gathers; "batched" rows are what
flexshard runs. Ops on a GPU are kernel
launches; this counts them on a CPU (no timings: see benchmarks/gpu.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from typing import NamedTuple, Optional
from unittest import mock

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch

import flexshard as fs
from flexshard.placements.quantized import BlockQuantized
from flexshard.placements.subclass import SubclassGather

from .harness.fake_world import PRESETS, fake_world, hf_llama, to_float8, wrap
from .harness.meters import MemoryMeter
from .harness.op_counter import Counts, OpCounter


class Row(NamedTuple):
    """One configuration: who shards, in which gather format, batched or not."""

    label: str
    side: str  # "flexshard" or "fsdp2"
    float8: bool = False
    quantized: Optional[torch.dtype] = None  # fs.QuantizedGather's wire dtype
    batched: bool = True


ROWS = (
    Row("FSDP2, bf16 gathers", "fsdp2"),
    Row("flexshard, bf16 gathers", "flexshard"),
    Row("FSDP2 + torchao float8 (precompute)", "fsdp2", float8=True),
    Row("flexshard, torchao float8, per param", "flexshard", float8=True, batched=False),
    Row("flexshard, torchao float8, batched", "flexshard", float8=True),
    Row("flexshard, QuantizedGather int8, per param", "flexshard", quantized=torch.int8,
        batched=False),
    Row("flexshard, QuantizedGather int8, batched", "flexshard", quantized=torch.int8),
    Row("flexshard, QuantizedGather fp8, per param", "flexshard",
        quantized=torch.float8_e4m3fn, batched=False),
    Row("flexshard, QuantizedGather fp8, batched", "flexshard", quantized=torch.float8_e4m3fn),
)


@contextlib.contextmanager
def unbatched(on: bool):
    """While flex_shard plans: every wire format encodes and decodes alone."""
    if not on:
        yield
        return
    with mock.patch.object(SubclassGather, "batch_key", lambda self: None), \
            mock.patch.object(BlockQuantized, "batch_key", lambda self: None):
        yield


def build(row: Row, shape, mesh) -> torch.nn.Module:
    model = hf_llama(shape, torch.device("cpu"))
    if row.float8:
        model = to_float8(model)
    if row.quantized is None:
        return wrap(row.side, model, mesh)
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                 gather_format=fs.QuantizedGather(row.quantized))
    return fs.flex_shard(model, mesh, mp_policy=mp)


def count(row: Row, world: int, shape) -> tuple:
    """(Counts of one forward+backward, peak bytes of one step) of `row`, after a
    warm-up step (SGD)."""
    with fake_world(world) as mesh:
        with unbatched(not row.batched):
            model = build(row, shape, mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq),
                               generator=torch.Generator().manual_seed(0))

        def step(counter=None, meter=None) -> None:
            with counter or contextlib.nullcontext():
                model(input_ids=tokens, labels=tokens).loss.backward()
            with meter or contextlib.nullcontext():
                opt.step()
            opt.zero_grad(set_to_none=True)
            if row.side == "fsdp2" and row.float8:
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                precompute_float8_dynamic_scale_for_fsdp(model)

        step()
        counter = OpCounter()
        step(counter)
        meter = MemoryMeter()  # last: a dispatch mode over the whole step
        meter.register(model.parameters(), "param")
        with meter:
            step()
        del model, opt
        gc.collect()
    return Counts.of(counter), meter.peak


def table(counts: dict) -> str:
    """Markdown: each row's counts, its peak and its ratios to the bf16 rows."""
    flex, fsdp = counts[ROWS[1]][0], counts[ROWS[0]][0]
    lines = ["| configuration | aten ops | non-view ops | collectives | copy-family ops "
             "| copy MiB | peak MiB | non-view / flexshard bf16 | non-view / FSDP2 bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row, (c, peak) in counts.items():
        lines.append(f"| {row.label} | {c.ops} | {c.non_view_ops} | {c.collectives} | "
                     f"{c.copy_ops} | {c.copy_bytes / 2**20:.1f} | {peak / 2**20:.1f} | "
                     f"{c.non_view_ops / flex.non_view_ops:.2f}x | "
                     f"{c.non_view_ops / fsdp.non_view_ops:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=8,
                        help="ranks of the fake world (default 8)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="model size from benchmarks/harness/fake_world.py's PRESETS "
                             "(default cpu)")
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    print(f"one rank of a fake world of {args.world}, HF Llama {shape}")
    counts = {row: count(row, args.world, shape) for row in ROWS}
    print(table(counts))


if __name__ == "__main__":
    main()
