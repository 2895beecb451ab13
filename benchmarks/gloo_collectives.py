"""gloo's one-collective gather and reduce against the rooted ones flexshard's
Comm uses there (one broadcast / one reduce per rank), the same bytes.

    torchrun --nproc-per-node 2 -m benchmarks.gloo_collectives [--sizes-kib 64 256 1024 4096 16384]
    torchrun --nproc-per-node 2 -m benchmarks.gloo_collectives --groups 8

For each per-rank segment size, rank 0 prints the median wall and CPU time
of 30 calls (after 3 warm-up calls; a barrier before each) of: all_gather_into_tensor, the broadcasts
(`fs.Comm`'s rooted all_gather), reduce_scatter_tensor and the reduces
(`fs.Comm`'s rooted reduce_scatter), and their ratios; then an uneven reduce (rank r's
piece 1 + (r - (W-1)/2) / (2W) of the segment: an Owned bucket's, a ragged group's) as
gloo's list reduce_scatter and as GlooComm's reduces. fp32, CPU tensors.

With `--groups N` each segment is cut into N gather groups back to back, as a bucket
whose large params have collectives of their own (planning/layout.py): gloo's coalesced
all-gather and reduce-scatter (`fs.Comm`'s all_gather_groups / reduce_scatter_groups)
against GlooComm's (a broadcast per rank and group; one reduce per rank of the groups'
rows joined rank-major).
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


def _groups_row(kib: int, groups: int, world: int) -> dict:
    numel = kib * 256 // groups  # fp32, per group
    plain, rooted = fs.Comm(), fs.GlooComm(rooted_min_bytes=0)
    send, gathered = torch.randn(groups * numel), torch.empty(world * groups * numel)
    whole, reduced = torch.randn(world * groups * numel), torch.empty(groups * numel)
    ins, outs = list(send.split(numel)), list(gathered.split(world * numel))
    rows, parts = list(whole.split(world * numel)), list(reduced.split(numel))
    return {
        "coalesced gather": _timed(lambda: plain.all_gather_groups(outs, ins, None)),
        "rooted gather": _timed(lambda: rooted.all_gather_groups(outs, ins, None)),
        "coalesced reduce": _timed(lambda: plain.reduce_scatter_groups(parts, rows, None)),
        "rooted reduce": _timed(lambda: rooted.reduce_scatter_groups(parts, rows, None)),
    }


def _print_groups(kib: int, groups: int, world: int, rank: int) -> None:
    t = _groups_row(kib, groups, world)
    if rank == 0:
        cell = lambda k: f"{t[k][0]:.2f} / {t[k][1]:.2f}"  # noqa: E731
        print(f"| {kib} | {cell('coalesced gather')} | {cell('rooted gather')} | "
              f"{cell('coalesced reduce')} | {cell('rooted reduce')} |", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-kib", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384],
                   help="per-rank segment sizes in KiB (default 64 256 1024 4096 16384)")
    p.add_argument("--groups", type=int, default=0,
                   help="cut each segment into this many gather groups (default 0: one)")
    args = p.parse_args(argv)
    if args.groups < 0:
        p.error(f"--groups must be >= 0, got {args.groups}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.groups:
        if rank == 0:
            print(f"gloo, {world} ranks, fp32, {args.groups} groups; ms per call, wall / CPU")
            print("| KiB per rank | coalesced all-gather | GlooComm | coalesced reduce-scatter | "
                  "GlooComm |\n|---|---|---|---|---|")
        for kib in args.sizes_kib:
            _print_groups(kib, args.groups, world, rank)
        dist.destroy_process_group()
        return
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
