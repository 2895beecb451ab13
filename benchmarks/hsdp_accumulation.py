"""Bytes on the wire of one HSDP gradient-accumulation step, flexshard and FSDP2
side by side: the replicas' all-reduce on every micro-batch, or once per step
(`set_requires_all_reduce(False)` until the last micro-batch, in both).

Run on 4 ranks, a (2 replicas, 2 shards) mesh, the Llama shape (hidden 384,
sequence 256):

    torchrun --standalone --nproc-per-node 4 -m benchmarks.hsdp_accumulation

Bytes and collective counts only: 4 ranks oversubscribe 2 cores, so no timing.
The collectives are read by benchmarks/harness/meters.py's TrafficMeter (every c10d
op with its largest buffer), the same meter for both libraries.
"""

from __future__ import annotations

import argparse
import os
import sys

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import flexshard as fs
from benchmarks.harness.meters import TrafficMeter
from benchmarks.harness.model import batch, build_model, loss_fn


def wrap(library: str, mesh):
    model = build_model("llama")
    if library == "fsdp2":
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return fs.flex_shard(model, mesh)  # default buckets: one per block plus a root bucket


def one_step(model, micro: int, defer: bool, step: int) -> TrafficMeter:
    """Forward and backward of `micro` micro-batches under the meter."""
    rank = dist.get_rank()
    with TrafficMeter() as meter:
        for m in range(micro):
            if defer:
                model.set_requires_all_reduce(m == micro - 1)
            x, y = batch("llama", step * micro + m, rank, "cpu")
            loss_fn(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return meter


def row(library: str, defer: bool, micro: int, mesh) -> dict:
    model = wrap(library, mesh)
    one_step(model, micro, defer, 0)  # warm-up: lazy init, recorded orders
    meter = one_step(model, micro, defer, 1)
    return {"library": library, "all-reduce": "once" if defer else "every micro-batch",
            "all_reduces": meter.collectives["allreduce"],
            "all_reduce_MiB": meter.collective_bytes["allreduce"] / 2 ** 20,
            "wire_MiB": sum(meter.collective_bytes.values()) / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="micro-batches accumulated per optimizer step (default 4)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))
    rows = [row(lib, defer, args.micro_batches, mesh)
            for lib in ("flexshard", "fsdp2") for defer in (False, True)]
    if dist.get_rank() == 0:
        print("| library | all-reduce | all-reduces/step | all-reduce MiB/step | "
              "all collectives MiB/step |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['library']} | {r['all-reduce']} | {r['all_reduces']} | "
                  f"{r['all_reduce_MiB']:.2f} | {r['wire_MiB']:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
