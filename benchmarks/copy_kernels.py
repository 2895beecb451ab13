"""The engine's two bulk copies, each way torch offers, at one Llama-3-8B layer.

    python -m benchmarks.copy_kernels                      # on a GPU (the battery runs it)
    python -m benchmarks.copy_kernels --device cpu --scale 64 --iters 2   # a dry run

- pack: the layer's full bf16 grads cast into the fp32 reduce-scatter input, each a
  contiguous span of it (flexshard's solo groups: `_foreach_copy_` today), against a
  `copy_` per grad, a `torch._chunk_cat` per grad, and FSDP2's one `_chunk_cat` of all
  of them (its rank-major layout).
- copy-in: the layer's fp32 shards (1/world of each param) cast into the bf16
  all-gather input: `_foreach_copy_` (flexshard and FSDP2 today) against a `copy_` each.

On the H200 the eager step's `reduce_scatter_copy_in` took 5.1 ms where FSDP2's
`_chunk_cat` took 3.1 for the same bytes, and the copy-in ran at about a third of the
memory's bandwidth: this says whether the kernel or the bytes set those times. Each way
is checked against the first for the same bits; times are CUDA events, the median of
`--iters` calls after warm-up (wall clock on a CPU)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# (rows, cols) of one Llama-3-8B layer's params: q, k, v, o, gate, up, down, two norms
LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096),
         (14336, 4096), (4096, 14336), (4096,), (4096,)]


def shapes(scale: int) -> list:
    """LAYER with every dimension over `scale` (a multiple of 8 kept for the world)."""
    return [tuple(max(8, d // scale) for d in s) for s in LAYER]


def spans(buffer: torch.Tensor, numels: list) -> list:
    return list(buffer.split(numels))


def pack_ways(grads: list, world: int) -> dict:
    """name -> a function writing `grads` (bf16) into a fresh fp32 reduce input."""
    numels = [g.numel() for g in grads]
    flat = [g.reshape(-1) for g in grads]
    out = torch.empty(sum(numels), dtype=torch.float32, device=grads[0].device)

    def foreach():
        torch._foreach_copy_(spans(out, numels), flat)

    def each_copy():
        for dst, src in zip(spans(out, numels), flat):
            dst.copy_(src)

    def each_chunk_cat():
        for dst, g in zip(spans(out, numels), grads):
            torch._chunk_cat([g], 0, world, out=dst.view(world, -1))

    def one_chunk_cat():  # FSDP2's layout: rank-major over all grads
        torch._chunk_cat(grads, 0, world, out=out.view(world, -1))

    return out, {"_foreach_copy_": foreach, "copy_ each": each_copy,
                 "_chunk_cat each": each_chunk_cat, "_chunk_cat all (FSDP2)": one_chunk_cat}


def copy_in_ways(shards: list) -> dict:
    numels = [s.numel() for s in shards]
    out = torch.empty(sum(numels), dtype=torch.bfloat16, device=shards[0].device)
    flat = [s.reshape(-1) for s in shards]

    def foreach():
        torch._foreach_copy_(spans(out, numels), flat)

    def each_copy():
        for dst, src in zip(spans(out, numels), flat):
            dst.copy_(src)

    return out, {"_foreach_copy_": foreach, "copy_ each": each_copy}


def timed(fn, device: torch.device, iters: int) -> float:
    """Median milliseconds of one call of `fn`."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(name: str, out: torch.Tensor, ways: dict, moved: int, device, iters: int) -> list:
    """One table's rows: each way's time and bandwidth; each writes the first way's bits."""
    rows, first = [], None
    for way, fn in ways.items():
        out.fill_(3.0)
        ms = timed(fn, device, iters)
        if first is None:
            first = out.clone()
        elif way.endswith("(FSDP2)"):
            pass  # another layout: the same bytes, elsewhere
        elif not torch.equal(out.view(torch.uint8), first.view(torch.uint8)):
            raise AssertionError(f"{name}: {way} wrote other bits than {next(iter(ways))}")
        rows.append((name, way, ms, moved / ms / 1e6))
    return rows


def run(device: torch.device, scale: int, world: int, iters: int) -> list:
    gen = torch.Generator().manual_seed(0)
    dims = shapes(scale)
    grads = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in dims]
    moved = sum(g.numel() for g in grads) * (2 + 4)  # read bf16, write fp32
    out, ways = pack_ways(grads, world)
    rows = measure("pack (bf16 grads -> fp32 reduce input)", out, ways, moved, device, iters)
    shards = [torch.randn((s[0] // world, *s[1:]), generator=gen).to(device) for s in dims]
    moved = sum(s.numel() for s in shards) * (4 + 2)
    out, ways = copy_in_ways(shards)
    rows += measure("copy-in (fp32 shards -> bf16 gather input)", out, ways, moved, device, iters)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the tensors live (default cuda where there is one)")
    p.add_argument("--scale", type=int, default=1, help="divide every dimension (a dry run)")
    p.add_argument("--world", type=int, default=8, help="ranks the shards are cut for")
    p.add_argument("--iters", type=int, default=20, help="timed calls of each way")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"one Llama-3-8B layer / {args.scale}, world {args.world}, {name}, torch {torch.__version__}")
    print("| copy | way | ms, median | GB/s (read + written) |\n|---|---|---|---|")
    for copy, way, ms, gbs in run(device, args.scale, args.world, args.iters):
        print(f"| {copy} | {way} | {ms:.3f} | {gbs:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
