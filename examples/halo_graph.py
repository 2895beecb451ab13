"""Message passing over a graph partitioned unevenly across ranks, with a halo exchange.

A random graph of 40 nodes is split over the ranks in uneven contiguous blocks
(`fs.shard_sizes(40, units=...)`). Each rank holds its nodes' features, builds a
`HaloPlan` once from the edges, and in every layer receives the features of the
remote neighbours it needs (`fs.collectives.halo_exchange`), then sums messages
into its own nodes. The loss is the sum over every node, so one process on the
whole graph (`python examples/halo_graph.py`) gives the same loss and gradients:

    torchrun --standalone --nproc-per-node 3 examples/halo_graph.py
    python examples/halo_graph.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs
from flexshard.collectives import HaloPlan, halo_exchange

NODES, EDGES, DIM = 40, 160, 16


def graph() -> torch.Tensor:
    """(2, E) edges (sources, targets): the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, NODES, (2, EDGES), generator=g)


def partition(world: int) -> tuple:
    """Uneven blocks: rank r weighs r + 1 (the last ranks hold more nodes)."""
    return tuple(fs.shard_sizes(NODES, units=[r + 1 for r in range(world)]))


class MessagePassing(nn.Module):
    """Two rounds of h_i <- relu(W_self h_i + sum over edges j->i of W_msg h_j)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.self_w = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.msg_w = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor, edges: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
        h = self.inp(x)
        start = sum(plan.sizes[:plan.rank])
        mine = (edges[1] >= start) & (edges[1] < start + plan.sizes[plan.rank])
        src = plan.local_index(edges[0][mine])  # rows of cat([h, halo])
        dst = edges[1][mine] - start
        for self_w, msg_w in zip(self.self_w, self.msg_w):
            rows = halo_exchange(h, plan, include_local=True)  # torch.cat([h, halo]), in place
            messages = torch.zeros_like(h).index_add(0, dst, msg_w(rows)[src])
            h = torch.relu(self_w(h) + messages)
        return h


def run() -> tuple:
    """(loss summed over every node, gradients of the model's params) on this rank's nodes."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sizes, edges = partition(world), graph()
    plan = HaloPlan.from_edges(edges, sizes)  # once: who sends which rows to whom
    torch.manual_seed(0)
    model = MessagePassing().double()
    features = torch.randn(NODES, DIM, generator=torch.Generator().manual_seed(1)).double()
    start = sum(sizes[:rank])
    local = model(features[start:start + sizes[rank]], edges, plan).square().sum()
    local.backward()
    loss = local.detach().clone()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    if world > 1:  # the sums over every node: each rank holds its nodes' part
        dist.all_reduce(loss)
        for g in grads.values():
            dist.all_reduce(g)
    return loss.item(), grads, plan


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    loss, grads, plan = run()
    print(f"rank {plan.rank}: {plan.sizes[plan.rank]} nodes, sends {plan.send_counts} rows, "
          f"receives {plan.recv_counts}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        norm = torch.stack([g.norm() for g in grads.values()]).norm().item()
        print(f"loss {loss:.10f}, gradient norm {norm:.10f}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
