"""PhysicsNeMo ShardTensor activations with flexshard parameters, on (data 2, domain 2).

A small convolutional model maps 3 fields on a 32 x 32 image to 2 fields on the
same pixels. On 4 ranks the DeviceMesh is (data=2, domain=2):

- activations: PhysicsNeMo's ShardTensor. `scatter_tensor` splits each replica's
  images by rows over the domain mesh (16 of 32 rows each), PhysicsNeMo's
  convolution handler exchanges the halo rows each 3 x 3 conv needs, and the loss,
  a mean over a ShardTensor, is the mean over the replica's whole images.
- parameters: `fs.flex_shard` over all 4 ranks (data x domain). PhysicsNeMo's own
  recipe shards them with FSDP2 over the data dim only and replicates them over
  the domain dim; here a rank holds a quarter of the params, grads and optimizer
  state instead of a half.
- gradients: ShardTensor's convolution all-reduces each weight's gradient over the
  domain mesh in backward (it is a sum over rows the domain ranks hold), so both
  domain ranks of a replica hold the replica's whole gradient. flex_shard's
  reduce-scatter sums over the 4 ranks and divides by its default divide factor,
  the world size: 2 copies of the sum over 2 replicas, over 4, is the mean over
  replicas. Keep the default (examples/domain_parallel.py, whose gradients are
  summands over the model group, sets the divide factor to the data size instead).

PhysicsNeMo on a CPU with torch 2.13: `DistributedManager.initialize()` fails (it
passes device_id=cpu to init_process_group, which torch refuses: "device_id
parameter must be an accelerator with an index"), and ShardTensor registers its
op handlers only when CUDA is available. `physicsnemo_on_cpu()` runs in a process
group initialised by torch, fills the manager's state as its `setup()` does, and
imports the handlers this model uses (convolution, sum and mean).
`register_custom_ops()` would import all of them, and some need timm and
torchvision, which do not install beside torch's CPU build.

    torchrun --standalone --nproc-per-node 4 examples/shard_tensor.py
    python examples/shard_tensor.py          # one process, the same model

tests/test_shard_tensor.py checks 4 ranks against one process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flexshard from a checkout

import flexshard as fs  # noqa: E402

SIZE, IN, OUT, CHANNELS = 32, 3, 2, 16  # image rows = columns, fields in and out
SAMPLES = 4  # images per step, split over the data-parallel replicas
LR = 0.5  # SGD: its step is -lr x the gradient, so a wrong gradient scale shows


@contextlib.contextmanager
def physicsnemo_on_cpu():
    """Run PhysicsNeMo's domain parallelism on this gloo process group (the module
    docstring says why not `DistributedManager.initialize()`); on leaving, the
    manager is marked uninitialised, or its exit hook would destroy the group again."""
    from physicsnemo.distributed import DistributedManager

    state = DistributedManager._shared_state
    state.update(_is_initialized=True, _distributed=True, _rank=dist.get_rank(),
                 _world_size=dist.get_world_size(), _local_rank=dist.get_rank(),
                 _device=torch.device("cpu"), _initialization_method="env")
    # Importing a handler's module registers it with ShardTensor.
    from physicsnemo.domain_parallel.custom_ops import mean_wrapper, sum_wrapper  # noqa: F401
    from physicsnemo.domain_parallel.shard_utils import conv_patches  # noqa: F401
    try:
        yield
    finally:
        state["_is_initialized"] = False


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return nn.Sequential(
        nn.Conv2d(IN, CHANNELS, 3, padding=1), nn.GELU(),
        nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.GELU(),
        nn.Conv2d(CHANNELS, OUT, 3, padding=1))


def batch(step: int) -> tuple:
    """Every image of one step, whole: (inputs, targets), a smooth map of the inputs."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(SAMPLES, IN, SIZE, SIZE, generator=g)
    blur = torch.nn.functional.avg_pool2d(x, 3, stride=1, padding=1)
    return x, torch.tanh(blur[:, :OUT] - x[:, 1:OUT + 1].roll(1, dims=2))


class Mesh(NamedTuple):
    data: int  # data-parallel replicas
    data_rank: int
    domain: object  # the DeviceMesh over which ShardTensor splits image rows
    world: object  # the 1-D DeviceMesh of every rank, for flex_shard
    data_mesh: object  # the DeviceMesh over replicas (FSDP2's, in PhysicsNeMo's recipe)


def make_mesh(domain_size: int = 2) -> Mesh:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % domain_size:
        raise ValueError(f"the world size {world} is not a multiple of domain_size={domain_size}")
    mesh = init_device_mesh("cpu", (world // domain_size, domain_size),
                            mesh_dim_names=("data", "domain"))
    return Mesh(world // domain_size, mesh.get_local_rank("data"), mesh["domain"],
                init_device_mesh("cpu", (world,)), mesh["data"])


def scatter_rows(images: torch.Tensor, mesh: Mesh):
    """This replica's images as a ShardTensor split by rows (dim 2) over the domain
    mesh, sent from the replica's first domain rank."""
    from physicsnemo.domain_parallel import scatter_tensor
    from torch.distributed.tensor.placement_types import Shard

    per_replica = SAMPLES // mesh.data
    source = int(mesh.domain.mesh[0])
    mine = images[mesh.data_rank * per_replica:(mesh.data_rank + 1) * per_replica]
    return scatter_tensor(mine if dist.get_rank() == source else None, source,
                          mesh.domain, (Shard(2),))


def train(steps: int, domain_size: int = 2, reshard_after_forward: bool = True) -> tuple:
    """Train on every rank of the world; returns (replica-mean loss per step, full
    parameters after the first step and at the end, a line saying what this rank holds)."""
    with physicsnemo_on_cpu():
        return _train(steps, domain_size, reshard_after_forward)


def _train(steps: int, domain_size: int, reshard_after_forward: bool) -> tuple:
    mesh = make_mesh(domain_size)
    model = fs.flex_shard(make_model(), mesh.world, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first = [], None
    for step in range(steps):
        x, y = batch(step)
        loss = (model(scatter_rows(x, mesh)) - scatter_rows(y, mesh)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.full_tensor().detach().clone()  # this replica's loss
        dist.all_reduce(total)  # summed over every rank: each replica's, domain_size times
        losses.append(total.item() / dist.get_world_size())
        if step == 0:
            first = fs.full_state_dict(model)
    return losses, first, fs.full_state_dict(model), _holdings(model, mesh)


def _holdings(model, mesh: Mesh) -> str:
    rows = SIZE // mesh.domain.size()
    start = mesh.domain.get_local_rank() * rows
    local = sum(p.numel() for p in model.parameters())
    full = sum(p.numel() for p in make_model().parameters())
    return (f"rank {dist.get_rank()}: data {mesh.data_rank}, domain "
            f"{mesh.domain.get_local_rank()}: image rows {start}..{start + rows - 1} "
            f"({rows} of {SIZE}), {local} of {full} parameter elements "
            f"(FSDP2 over data only: {full // mesh.data})")


def reference(steps: int) -> tuple:
    """One process, whole images: (loss per step, params after step 1, final params)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first = [], None
    for step in range(steps):
        x, y = batch(step)
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 0:
            first = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, first, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(steps: int = 20) -> None:
    if "RANK" not in os.environ:  # one process: the reference
        losses, _, _ = reference(steps)
        print(f"one process: loss {losses[0]:.4f} at step 1, {losses[-1]:.4f} at step {steps}")
        return
    dist.init_process_group("gloo")
    try:
        losses, _, _, holds = train(steps)
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
