"""Halo exchange against gathering every node (and against Anemoi's halo exchange), for
message passing over a partitioned graph: bytes on the wire, peak memory and step time per
rank, as ratios from one run.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.halo
    torchrun --standalone --nproc-per-node 4 -m benchmarks.halo --no-time

A G x G grid graph (each node's messages come from its 8 neighbours, as a regular mesh's
stencil) is split by rows of nodes over the ranks in uneven blocks (rank r weighs r + 2).
Two rounds of message passing at hidden 384 (h <- relu(W_self h + sum of W_msg h_j over
the neighbours j)), forward and backward, get the neighbours' rows in up to three ways:

- halo: `fs.collectives.halo_exchange(h, plan, include_local=True)` with a `HaloPlan`
  built once from the edges: one all-to-all of the boundary rows each rank needs;
- gather: `fs.collectives.gather_tensor(h, sizes, full_grad=PARTIAL)`: every rank receives
  every node (what a model without a halo plan does), the backward reduce-scatters;
- anemoi, where anemoi-models is installed (`pip install --no-deps anemoi-models==0.19.0
  einops torch-geometric psutil`): Anemoi's own `halo_exchange` over the same rows.

All give the same loss (checked). FSDP2 has no activation collectives, so there is no
FSDP2 column. Times alternate the ways step by step; "exchange alone" times the rows'
exchange, forward and backward, without the model. On this CPU with gloo
the times are gloo's; 4 ranks on 2 cores are oversubscribed: bytes and memory only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs
from benchmarks.harness.meters import MemoryMeter, TrafficMeter
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
    dst, halo_src = edges[1][mine] - start, plan.local_index(edges[0][mine])
    ways = {
        "halo": (lambda h: halo_exchange(h, plan, include_local=True), halo_src, dst),
        "gather": (lambda h: gather_tensor(h, sizes, 0, full_grad=FullGrad.PARTIAL,
                                           check_sizes=False),
                   edges[0][mine], dst),
    }
    anemoi = anemoi_halo(plan, sizes[rank])
    if anemoi is not None:
        ways["anemoi"] = (anemoi, halo_src, dst)
    return {"sizes": sizes, "plan": plan, "ways": ways}


def anemoi_halo(plan: HaloPlan, own: int):
    """Anemoi's own halo exchange over the same rows (its `HaloInfo` made from the plan),
    or None where anemoi-models is not installed. It returns the local rows then the halo,
    as `halo_exchange(h, plan, include_local=True)` does."""
    try:
        from anemoi.models.distributed.graph import halo_exchange as exchange
        from anemoi.models.distributed.halo import HaloInfo
    except ImportError:
        return None
    info = HaloInfo(num_local_nodes=own, num_halo_nodes=sum(plan.recv_counts),
                    send_indices=plan.send_index, recv_counts=tuple(plan.recv_counts),
                    recv_global_ids=None, edge_index_local=torch.empty(2, 0, dtype=torch.long))
    return lambda h: exchange(h, info, dist.group.WORLD)


def step(model, way: tuple, x: torch.Tensor) -> float:
    loss = model(x, *way).square().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def measure(model, way: tuple, x: torch.Tensor) -> dict:
    with MemoryMeter() as mem, TrafficMeter() as traffic:
        mem.register(model.parameters(), "param")
        mem.register([x], "input")
        loss = step(model, way, x)
    return {"peak": mem.peak, "wire": sum(traffic.collective_bytes.values()),
            "count": dict(traffic.collectives), "loss": loss}


def timed(model, ways: dict, x: torch.Tensor, steps: int) -> dict:
    """Median step time per way, the ways alternating step by step."""
    times = {name: [] for name in ways}
    for _ in range(steps):
        for name, way in ways.items():
            dist.barrier()
            start = time.perf_counter()
            step(model, way, x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def exchange_times(ways: dict, x: torch.Tensor, steps: int) -> dict:
    """Median time of the neighbours' rows alone, forward and backward, per way
    (alternating): the exchange without the model around it."""
    x = x.detach().requires_grad_(True)
    times = {name: [] for name in ways}
    for _ in range(steps + 1):  # the first round warms up
        for name, (neighbours, _, _) in ways.items():
            dist.barrier()
            start = time.perf_counter()
            neighbours(x).sum().backward()
            times[name].append(time.perf_counter() - start)
            x.grad = None
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", type=int, default=128, help="grid side: side^2 nodes (default 128)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per way (default 15)")
    p.add_argument("--no-time", action="store_true", help="bytes and memory only")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    s = setup(args.side)
    x = torch.randn(s["sizes"][rank], HIDDEN, generator=torch.Generator().manual_seed(rank))
    model = MessagePassing()
    stats = {}
    for name, way in s["ways"].items():
        step(model, way, x)  # warm-up
        stats[name] = measure(model, way, x)
    times = {} if args.no_time else timed(model, s["ways"], x, args.steps)
    alone = {} if args.no_time else exchange_times(s["ways"], x, args.steps)
    for name in stats:
        stats[name]["time"], stats[name]["exchange"] = times.get(name), alone.get(name)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (s["sizes"][rank], s["plan"].recv_counts, stats))
    if rank == 0:
        report(args, rows)
    dist.destroy_process_group()


def _ratio(stats: dict, key: str, unit: float, fmt: str, skip: tuple = ()) -> str:
    """'halo X / other Y = ratio' for each other way but `skip`."""
    h = stats["halo"][key]
    return "; ".join(f"halo {h / unit:{fmt}} / {name} {o[key] / unit:{fmt}} = {h / o[key]:.3f}"
                     for name, o in stats.items() if name not in ("halo", *skip))


def report(args, rows: list) -> None:
    print(f"message passing, 2 rounds at hidden {HIDDEN}: {args.side} x {args.side} grid "
          f"({args.side ** 2} nodes, 8 neighbours), {len(rows)} ranks")
    for r, (own, recv, stats) in enumerate(rows):
        losses = [w["loss"] for w in stats.values()]
        assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), stats
        print(f"rank {r}: {own} nodes, halo {sum(recv)} rows")
        # Anemoi moves the same rows; on gloo by isend/irecv, which the meter counts per call
        print(f"  wire MiB: {_ratio(stats, 'wire', 2**20, '.2f', skip=('anemoi',))}")
        print(f"  peak MiB: {_ratio(stats, 'peak', 2**20, '.1f')}")
        if stats["halo"]["time"] is not None:
            print(f"  step ms:  {_ratio(stats, 'time', 1e-3, '.1f')}")
            print(f"  exchange alone ms: {_ratio(stats, 'exchange', 1e-3, '.2f')}")
    counts = {name: w["count"] for name, w in rows[0][2].items()}
    print(f"collectives per step (rank 0): {counts}; losses equal (1e-5)")


if __name__ == "__main__":
    main()
