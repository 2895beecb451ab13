"""gloo's one-collective gather and reduce against the rooted ones flexshard's
Comm uses there (one broadcast / one reduce per rank), the same bytes.

    torchrun --nproc-per-node 2 -m benchmarks.gloo_collectives [--sizes-kib 64 256 1024 4096 16384]

For each per-rank segment size, rank 0 prints the median wall and CPU time
of 30 calls (after 3 warm-up calls; a barrier before each) of: all_gather_into_tensor, the broadcasts
(`fs.Comm`'s rooted all_gather), reduce_scatter_tensor and the reduces
(`fs.Comm`'s rooted reduce_scatter), and their ratios; then an uneven reduce (rank r's
piece 1 + (r - (W-1)/2) / (2W) of the segment: an Owned bucket's, a ragged group's) as
gloo's list reduce_scatter and as GlooComm's reduces. fp32, CPU tensors.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import flexshard as fs


def _timed(fn, calls: int = 30) -> tuple:
    """Median wall and CPU ms of `calls` calls (each started together on every rank)."""
    for _ in range(3):
        fn()
    walls, cpus = [], []
    for _ in range(calls):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append((time.perf_counter() - wall) * 1e3)
        cpus.append((time.process_time() - cpu) * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def _row(kib: int, rank: int, world: int) -> dict:
    numel = kib * 256  # fp32
    plain, rooted = fs.Comm(), fs.GlooComm(rooted_min_bytes=0)
    mine, gathered = torch.randn(numel), torch.empty(world * numel)
    whole, reduced = torch.randn(world * numel), torch.empty(numel)
    sizes = tuple(int(numel * (1 + (r - (world - 1) / 2) / (2 * world))) for r in range(world))
    ragged, out = torch.randn(sum(sizes)), torch.empty(max(sizes))
    return {
        "gather": _timed(lambda: plain.all_gather(gathered, mine, None)),
        "broadcasts": _timed(lambda: rooted.all_gather(gathered, mine, None)),
        "reduce-scatter": _timed(lambda: plain.reduce_scatter(reduced, whole, None)),
        "reduces": _timed(lambda: rooted.reduce_scatter(reduced, whole, None)),
        "uneven list": _timed(lambda: plain.reduce_scatter_uneven(out, ragged, sizes, None)),
        "uneven reduces": _timed(lambda: rooted.reduce_scatter_uneven(out, ragged, sizes, None)),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384],
                   help="per-rank segment sizes in KiB (default 64 256 1024 4096 16384)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"gloo, {world} ranks, fp32; ms per call, wall / CPU (rank 0)")
        print("| KiB per rank | all_gather_into_tensor | broadcasts | ratio | "
              "reduce_scatter_tensor | reduces | ratio | uneven: list reduce_scatter | "
              "reduces | ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for kib in args.sizes_kib:
        t = _row(kib, rank, world)
        if rank == 0:
            cell = lambda k: f"{t[k][0]:.2f} / {t[k][1]:.2f}"  # noqa: E731
            print(f"| {kib} | {cell('gather')} | {cell('broadcasts')} | "
                  f"{t['gather'][0] / t['broadcasts'][0]:.2f} | {cell('reduce-scatter')} | "
                  f"{cell('reduces')} | {t['reduce-scatter'][0] / t['reduces'][0]:.2f} | "
                  f"{cell('uneven list')} | {cell('uneven reduces')} | "
                  f"{t['uneven list'][0] / t['uneven reduces'][0]:.2f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
