"""Halo exchange against gathering every node, for message passing over a partitioned graph:
bytes on the wire, peak memory and step time per rank, as ratios halo / gather from one run.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.halo
    torchrun --standalone --nproc-per-node 4 -m benchmarks.halo --no-time

A G x G grid graph (each node's messages come from its 8 neighbours, as a regular mesh's
stencil) is split by rows of nodes over the ranks in uneven blocks (rank r weighs r + 2).
Two rounds of message passing at hidden 384 (h <- relu(W_self h + sum of W_msg h_j over
the neighbours j)), forward and backward, get the neighbours' rows two ways:

- halo: `fs.collectives.halo_exchange` with a `HaloPlan` built once from the edges: one
  all-to-all of the boundary rows each rank needs;
- gather: `fs.collectives.gather_tensor(h, sizes, full_grad=PARTIAL)`: every rank receives
  every node (what a model without a halo plan does), the backward reduce-scatters.

Both give the same loss (checked). FSDP2 has no activation collectives, so there is no
FSDP2 column; this measures flexshard's two ways against each other. On this CPU with gloo
the times are gloo's; 4 ranks on 2 cores are oversubscribed: bytes and memory only.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs
from benchmarks.meters import MemoryMeter, TrafficMeter
from flexshard.collectives import FullGrad, HaloPlan, gather_tensor, halo_exchange

HIDDEN = 384


def grid_edges(side: int) -> torch.Tensor:
    """(2, E) edges (sources, targets) of a side x side grid, 8 neighbours per node."""
    ids = torch.arange(side * side).reshape(side, side)
    src, dst = [], []
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            if dy or dx:
                rows = slice(max(dy, 0), side + min(dy, 0))
                cols = slice(max(dx, 0), side + min(dx, 0))
                back_rows = slice(max(-dy, 0), side + min(-dy, 0))
                back_cols = slice(max(-dx, 0), side + min(-dx, 0))
                src.append(ids[rows, cols].flatten())
                dst.append(ids[back_rows, back_cols].flatten())
    return torch.stack([torch.cat(src), torch.cat(dst)])


class MessagePassing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.self_w = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.msg_w = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(2))

    def forward(self, h: torch.Tensor, neighbours, src: torch.Tensor, dst: torch.Tensor):
        for self_w, msg_w in zip(self.self_w, self.msg_w):
            rows = neighbours(h)  # this rank's rows with the halo, or every node
            h = torch.relu(self_w(h) + torch.zeros_like(h).index_add(0, dst, msg_w(rows)[src]))
        return h


def setup(side: int) -> dict:
    """Per way: (neighbours function, source rows into its output, target local rows)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    edges = grid_edges(side)
    sizes = fs.shard_sizes(side * side, units=[r + 2 for r in range(world)])
    plan = HaloPlan.from_edges(edges, sizes)
    start = sum(sizes[:rank])
    mine = (edges[1] >= start) & (edges[1] < start + sizes[rank])
    dst = edges[1][mine] - start
    return {
        "sizes": sizes, "plan": plan,
        "halo": (lambda h: torch.cat([h, halo_exchange(h, plan)]),
                 plan.local_index(edges[0][mine]), dst),
        "gather": (lambda h: gather_tensor(h, sizes, 0, full_grad=FullGrad.PARTIAL,
                                           check_sizes=False),
                   edges[0][mine], dst),
    }


def step(model, way: tuple, x: torch.Tensor) -> float:
    loss = model(x, *way).square().mean()
    loss.backward()
    return loss.item()


def measure(model, way: tuple, x: torch.Tensor) -> dict:
    with MemoryMeter() as mem, TrafficMeter() as traffic:
        mem.register(model.parameters(), "param")
        mem.register([x], "input")
        loss = step(model, way, x)
        model.zero_grad(set_to_none=True)
    return {"peak": mem.peak, "wire": sum(traffic.collective_bytes.values()),
            "count": dict(traffic.collectives), "loss": loss}


def timed(model, way: tuple, x: torch.Tensor, steps: int) -> float:
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step(model, way, x)
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", type=int, default=128, help="grid side: side^2 nodes (default 128)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per way (default 6)")
    p.add_argument("--no-time", action="store_true", help="bytes and memory only")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    s = setup(args.side)
    x = torch.randn(s["sizes"][rank], HIDDEN, generator=torch.Generator().manual_seed(rank))
    model = MessagePassing()
    stats = {}
    for way in ("halo", "gather"):
        step(model, s[way], x)  # warm-up
        model.zero_grad(set_to_none=True)
        stats[way] = measure(model, s[way], x)
        stats[way]["time"] = None if args.no_time else timed(model, s[way], x, args.steps)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (s["sizes"][rank], s["plan"].recv_counts, stats))
    if rank == 0:
        report(args, rows)
    dist.destroy_process_group()


def report(args, rows: list) -> None:
    nodes = args.side ** 2
    print(f"message passing, 2 rounds at hidden {HIDDEN}: {args.side} x {args.side} grid "
          f"({nodes} nodes, 8 neighbours), {len(rows)} ranks")
    for r, (own, recv, stats) in enumerate(rows):
        h, g = stats["halo"], stats["gather"]
        assert abs(h["loss"] - g["loss"]) <= 1e-5 * abs(g["loss"]), (h["loss"], g["loss"])
        line = (f"rank {r}: {own} nodes, halo {sum(recv)} rows; wire halo {h['wire'] / 2**20:.2f}"
                f" MiB / gather {g['wire'] / 2**20:.2f} MiB = {h['wire'] / g['wire']:.3f}; peak "
                f"halo {h['peak'] / 2**20:.1f} MiB / gather {g['peak'] / 2**20:.1f} MiB = "
                f"{h['peak'] / g['peak']:.3f}")
        if h["time"] is not None:
            line += (f"; step halo {h['time'] * 1e3:.1f} ms / gather {g['time'] * 1e3:.1f} ms = "
                     f"{h['time'] / g['time']:.3f}")
        print(line)
    print(f"collectives per step: halo {rows[0][2]['halo']['count']}, "
          f"gather {rows[0][2]['gather']['count']}; losses equal (1e-5)")


if __name__ == "__main__":
    main()
