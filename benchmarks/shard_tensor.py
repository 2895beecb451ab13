"""PhysicsNeMo ShardTensor activations, params sharded two ways: FSDP2 over the data dim
only (PhysicsNeMo's recipe: replicated over the domain dim) against flexshard over data x
domain, on the same model, data and (data 2, domain 2) mesh: peak memory per rank and
bytes on the wire per step, as ratios flexshard / FSDP2 from one run.

    torchrun --standalone --nproc-per-node 4 -m benchmarks.shard_tensor

The model: 4 convolutions 3 x 3 of 384 channels (plus a 3-channel input and a 2-channel
output conv) on 32 x 32 images, one image per replica per step, split by rows over the
domain ranks by `scatter_tensor`; AdamW, fp32. ShardTensor's convolutions exchange the
halo rows and all-reduce each weight's gradient over the domain ranks in both runs. 4
ranks on 2 cores are oversubscribed: memory and bytes only, no time.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import warnings
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.harness.meters import MemoryMeter, TrafficMeter

CHANNELS, LAYERS, SIZE, IN, OUT = 384, 4, 32, 3, 2
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "shard_tensor.py"


def example():
    """examples/shard_tensor.py: its PhysicsNeMo set-up on CPU and its mesh."""
    spec = importlib.util.spec_from_file_location("shard_tensor_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Conv2d(IN, CHANNELS, 3, padding=1), nn.GELU()]
    for _ in range(LAYERS):
        layers += [nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.GELU()]
    return nn.Sequential(*layers, nn.Conv2d(CHANNELS, OUT, 3, padding=1))


def build(library: str, mesh):
    model = make_model()
    if library == "fsdp2":  # PhysicsNeMo's recipe: shard over data, replicate over domain
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Conv2d):
                fully_shard(layer, mesh=mesh.data_mesh)
        fully_shard(model, mesh=mesh.data_mesh)
    else:
        import flexshard as fs

        model = fs.flex_shard(model, mesh.world,
                              buckets=[fs.BucketSpec(f"{i}.*") for i, layer in enumerate(model)
                                       if isinstance(layer, nn.Conv2d)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def images(step: int, mesh):
    """One image per replica: the replica's own, split by rows over the domain ranks."""
    g = torch.Generator().manual_seed(1000 * step + mesh.data_rank)
    x = torch.randn(1, IN, SIZE, SIZE, generator=g)
    y = torch.randn(1, OUT, SIZE, SIZE, generator=g)
    from physicsnemo.domain_parallel import scatter_tensor
    from torch.distributed.tensor.placement_types import Shard

    source = int(mesh.domain.mesh[0])
    return [scatter_tensor(t if dist.get_rank() == source else None, source, mesh.domain,
                           (Shard(2),)) for t in (x, y)]


def train_step(model, opt, step: int, mesh) -> float:
    x, y = images(step, mesh)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.full_tensor().item()


def measured(model, opt, step: int, mesh) -> dict:
    """One step under the meters: peak live bytes (max over ranks), wire bytes per kind."""
    with MemoryMeter() as mem, TrafficMeter() as traffic:
        mem.register(model.parameters(), "param")
        loss = train_step(model, opt, step, mesh)
    peak = torch.tensor([float(mem.peak)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"peak": peak.item(), "wire": dict(traffic.collective_bytes),
            "count": dict(traffic.collectives), "loss": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--domain", type=int, default=2, help="domain ranks per replica (default 2)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    ex = example()
    with ex.physicsnemo_on_cpu():
        mesh = ex.make_mesh(args.domain)
        runs = {lib: build(lib, mesh) for lib in ("fsdp2", "flexshard")}
        warm = {lib: train_step(*runs[lib], 0, mesh) for lib in runs}  # lazy init
        stats = {lib: measured(*runs[lib], 1, mesh) for lib in runs}
        if dist.get_rank() == 0:
            report(args, warm, stats)
    dist.destroy_process_group()


def report(args, warm: dict, stats: dict) -> None:
    world = dist.get_world_size()
    f, x = stats["fsdp2"], stats["flexshard"]
    params = sum(p.numel() for p in make_model().parameters())
    print(f"ShardTensor convs ({LAYERS} x {CHANNELS} channels, {params / 1e6:.2f} M params, "
          f"{SIZE} x {SIZE} images), {world} ranks: data {world // args.domain} x domain "
          f"{args.domain}; losses FSDP2 {warm['fsdp2']:.6f} / {f['loss']:.6f}, flexshard "
          f"{warm['flexshard']:.6f} / {x['loss']:.6f}")
    print(f"peak memory per rank: FSDP2 over data {f['peak'] / 2**20:.2f} MiB, flexshard over "
          f"data x domain {x['peak'] / 2**20:.2f} MiB, ratio {x['peak'] / f['peak']:.3f}")
    for kind in sorted(set(f["wire"]) | set(x["wire"])):
        print(f"  {kind}: FSDP2 {f['count'].get(kind, 0)} x, {f['wire'].get(kind, 0) / 2**20:.2f} "
              f"MiB; flexshard {x['count'].get(kind, 0)} x, {x['wire'].get(kind, 0) / 2**20:.2f} MiB")
    tf, tx = sum(f["wire"].values()), sum(x["wire"].values())
    print(f"bytes on the wire per step: FSDP2 {tf / 2**20:.2f} MiB, flexshard "
          f"{tx / 2**20:.2f} MiB, ratio {tx / tf:.3f}")


if __name__ == "__main__":
    main()
