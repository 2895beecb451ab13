"""Domain parallelism on a grid of points, Anemoi style, with flexshard params.

A small model maps fields on a grid of points to fields on the same points:
an embedding, two blocks of attention across all points plus a per-point MLP,
and a head. On 4 ranks the DeviceMesh is (dp=2, model=2):

- activations: each model group of 2 ranks splits the grid's points
  unevenly (`fs.shard_sizes(points, units=(3, 2))`: 6 and 4 of 10). Every
  per-point layer runs on the rank's own points. Attention is head-parallel:
  one all-to-all turns the points-sharded q/k/v into heads-sharded ones (every
  point, this rank's heads: 2 and 1 of 3), attention runs over all points,
  and the reverse all-to-all brings the output back to points-sharded.
- parameters: `fs.flex_shard` over the 1-D world mesh (all 4 ranks). Every
  rank gathers whole parameters for its compute, as usual.
- gradients: a model rank's loss is its points' share of its replica's loss,
  so its parameter gradients are summands over the model group; the
  all-to-all's backward moves the activation gradients back exactly. flex_shard
  reduce-scatters (sums) over all 4 ranks and divides by its divide factor:
  set to the dp size (2), that is the sum over the model group and the mean
  over data-parallel replicas, the gradient of the mean loss.
- reshard after forward (the default) regathers only the params in backward,
  never a block's forward: 8 all-to-alls per step, resharding or not.

    torchrun --standalone --nproc-per-node 4 examples/domain_parallel.py
    python examples/domain_parallel.py          # one process, the same model

tests/test_domain_parallel.py checks 4 ranks against one process.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flexshard from a checkout

import flexshard as fs  # noqa: E402
from flexshard.collectives import all_to_all  # noqa: E402

POINTS, IN, OUT = 10, 3, 2  # grid points, input and output fields per point
CHANNELS, HEADS, BLOCKS = 12, 3, 2
POINT_UNITS = (3, 2)  # the model ranks' shares of the points (6 and 4 of 10)
SAMPLES = 4  # samples per step, split over the data-parallel replicas
OPTIMIZERS = {  # AdamW hides a gradient's scale; SGD shows it (the test runs both)
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


class Domain(NamedTuple):
    """How one model group splits the activations: per-rank points and heads."""

    group: Optional[dist.ProcessGroup]  # None: one process holds everything
    rank: int  # this rank's index in the group
    points: list  # points[r]: the points rank r holds
    heads: list  # heads[r]: the attention heads rank r computes
    comm: Optional[fs.Comm] = None  # the all-to-alls' Comm (tests count them)

    @staticmethod
    def make(group=None, comm: Optional[fs.Comm] = None) -> "Domain":
        size = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        units = POINT_UNITS if size == len(POINT_UNITS) else (1,) * size
        return Domain(group, rank, fs.shard_sizes(POINTS, units),
                      fs.shard_sizes(HEADS, world_size=size), comm)

    def my_points(self) -> slice:
        start = sum(self.points[: self.rank])
        return slice(start, start + self.points[self.rank])


class Attention(nn.Module):
    """Multi-head attention across all points, head-parallel over the model group."""

    def __init__(self, domain: Domain):
        super().__init__()
        self.domain = domain
        # No bias: a key bias has a zero gradient (softmax ignores a shift shared by all
        # keys), and AdamW would blow the rounding noise of that zero up to full steps.
        self.qkv = nn.Linear(CHANNELS, 3 * CHANNELS, bias=False)
        self.out = nn.Linear(CHANNELS, CHANNELS)

    def forward(self, x):  # x: (batch, my points, channels)
        d, (b, n, c) = self.domain, x.shape
        qkv = self.qkv(x).view(b, n, 3, HEADS, c // HEADS)
        # points-sharded -> heads-sharded: (batch, all points, 3, my heads, head dim)
        qkv = all_to_all(qkv, d.heads, 3, d.points, 1, d.group, comm=d.comm)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, my heads, points, head dim)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        # heads-sharded -> points-sharded: (batch, my points, all heads, head dim)
        o = all_to_all(o, d.points, 1, d.heads, 2, d.group, comm=d.comm)
        return self.out(o.reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, domain: Domain):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(CHANNELS), nn.LayerNorm(CHANNELS)
        self.attn = Attention(domain)
        self.mlp = nn.Sequential(nn.Linear(CHANNELS, 2 * CHANNELS), nn.GELU(),
                                 nn.Linear(2 * CHANNELS, CHANNELS))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GridModel(nn.Module):
    """Fields on this rank's points -> predicted fields on the same points."""

    def __init__(self, domain: Domain):
        super().__init__()
        self.domain = domain
        self.embed = nn.Linear(IN, CHANNELS)
        self.pos = nn.Parameter(torch.randn(POINTS, CHANNELS) * 0.1)  # one row per point
        self.blocks = nn.ModuleList(Block(domain) for _ in range(BLOCKS))
        self.head = nn.Linear(CHANNELS, OUT)

    def forward(self, x):  # x: (batch, my points, IN)
        # The whole `pos` is gathered; its rows for other ranks' points get a zero
        # gradient here, their owners' ranks supply the rest (a summand).
        h = self.embed(x) + self.pos[self.domain.my_points()]
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_model(domain: Domain) -> GridModel:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return GridModel(domain)


def batch(step: int) -> tuple:
    """Every sample of one step on the whole grid: (inputs, targets)."""
    x = torch.randn(SAMPLES, POINTS, IN, generator=torch.Generator().manual_seed(1000 + step))
    mix = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(0))  # the same every step
    y = torch.tanh(x @ mix + x.mean(dim=1, keepdim=True)[..., :OUT] - x.roll(1, dims=1)[..., :OUT])
    return x, y


def loss_share(model: GridModel, x, y) -> torch.Tensor:
    """This rank's points' share of the mean squared error over its samples' whole grid:
    the shares of one model group sum to that replica's loss."""
    mine = model.domain.my_points()
    err = model(x[:, mine]) - y[:, mine]
    return err.square().sum() / (x.shape[0] * POINTS * OUT)


class Mesh(NamedTuple):
    dp: int  # data-parallel replicas
    dp_rank: int
    domain: Domain
    world: object  # the 1-D DeviceMesh of every rank, for flex_shard


def make_mesh(model_size: int = 2, comm: Optional[fs.Comm] = None) -> Mesh:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % model_size:
        raise ValueError(f"the world size {world} is not a multiple of model_size={model_size}")
    mesh = init_device_mesh("cpu", (world // model_size, model_size),
                            mesh_dim_names=("dp", "model"))
    return Mesh(world // model_size, mesh.get_local_rank("dp"),
                Domain.make(mesh["model"].get_group(), comm), init_device_mesh("cpu", (world,)))


def train(steps: int, model_size: int = 2, reshard_after_forward: bool = True,
          optimizer: str = "adamw", comm: Optional[fs.Comm] = None) -> tuple:
    """Train on every rank of the world; returns (replica-mean loss per step, the
    full parameters at the end, a line saying what this rank holds)."""
    mesh = make_mesh(model_size, comm)
    model = fs.flex_shard(make_model(mesh.domain), mesh.world,
                          reshard_after_forward=reshard_after_forward)
    # reduce-scatter sums over all ranks: divide by dp only (mean over replicas,
    # sum of the model group's summands).
    model.set_gradient_divide_factor(mesh.dp)
    opt = OPTIMIZERS[optimizer](model.parameters())
    per_replica = SAMPLES // mesh.dp
    losses = []
    for step in range(steps):
        x, y = batch(step)
        rows = slice(mesh.dp_rank * per_replica, (mesh.dp_rank + 1) * per_replica)
        loss = loss_share(model, x[rows], y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # sum over every rank: the model groups' sums, then / dp
        losses.append(total.item() / mesh.dp)
    return losses, fs.full_state_dict(model), _holdings(model, mesh)


def _holdings(model, mesh: Mesh) -> str:
    d = mesh.domain
    mine, heads = d.my_points(), sum(d.heads[: d.rank])
    local = sum(p.numel() for p in model.parameters())
    full = sum(p.numel() for p in make_model(d).parameters())
    return (f"rank {dist.get_rank()}: dp {mesh.dp_rank}, model {d.rank}: points "
            f"{mine.start}..{mine.stop - 1} ({d.points[d.rank]} of {POINTS}), heads "
            f"{heads}..{heads + d.heads[d.rank] - 1} ({d.heads[d.rank]} of {HEADS}), "
            f"{local} of {full} parameter elements")


def reference(steps: int, optimizer: str = "adamw") -> tuple:
    """One process, every sample and point: (loss per step, final parameters)."""
    model = make_model(Domain.make())
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    for step in range(steps):
        loss = loss_share(model, *batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def main(steps: int = 20) -> None:
    if "RANK" not in os.environ:  # one process: the reference
        losses, _ = reference(steps)
        print(f"one process: loss {losses[0]:.4f} at step 1, {losses[-1]:.4f} at step {steps}")
        return
    dist.init_process_group("gloo")
    try:
        losses, _, holds = train(steps)
        lines = [None] * dist.get_world_size()
        dist.all_gather_object(lines, holds)
        if dist.get_rank() == 0:
            print("\n".join(lines))
            for step in (0, steps // 2, steps - 1):
                print(f"step {step + 1}: loss {losses[step]:.4f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,  # --help, and no silent run on a typo
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
