"""torchtitan's llama3 debugmodel under flexshard, on CPUs only (gloo).

    torchrun --standalone --nproc-per-node 2 examples/torchtitan_cpu.py   # 2 ranks
    python examples/torchtitan_cpu.py --reference 2                       # 1 process

The model is torchtitan 0.3.0's llama3 debugmodel cut to 2 blocks, with SDPA
attention (flex attention has no CPU backward). flexshard's `parallelize_llama`
shards it over the ranks, one bucket per block plus a root bucket. Each rank
trains on its own fixed batch of random tokens with SGD, rank 0 prints the loss
of every step and a last line `final loss <value>`.

`--reference N` trains the unsharded model in this one process on the batches
N ranks would see, together: its losses are the N-rank run's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as titan_parallel_dims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flexshard from a checkout

from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_llama  # noqa: E402

LAYERS, BATCH, SEQ = 2, 2, 32  # per rank: BATCH rows of SEQ tokens


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    p.add_argument("--placement", choices=("shard", "owned", "ragged"), default="shard",
                   help="flexshard placement, as --flex_shard.placement (default shard)")
    p.add_argument("--reference", type=int, default=None, metavar="N",
                   help="no sharding: train in one process on the batches of N ranks")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.reference is not None and args.reference < 1:
        p.error(f"--reference must be >= 1, got {args.reference}")
    if args.reference is None and "WORLD_SIZE" not in os.environ:  # env:// rendezvous needs it
        p.error("no torchrun environment (WORLD_SIZE is not set): run under torchrun "
                "--nproc-per-node N, or pass --reference N")
    return args


def debugmodel() -> torch.nn.Module:
    """torchtitan's llama3 debugmodel, LAYERS blocks, SDPA attention, seed 0 on every rank."""
    config = model_registry("debugmodel").model
    config.layers = config.layers[:LAYERS]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def batch(rank: int, vocab: int) -> torch.Tensor:
    """Rank `rank`'s fixed batch: BATCH rows of SEQ + 1 tokens (inputs and shifted labels)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)


def shard(model: torch.nn.Module, world: int, placement: str) -> torch.nn.Module:
    """flexshard over a 1-D data-parallel mesh of `world` ranks, as torchtitan's
    Trainer would call its parallelize function."""
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1,
                        world_size=world, spmd_backend="partial_dtensor")
    # torchtitan picks its device type at import ("cuda" when no accelerator is found);
    # its meshes must be CPU meshes here.
    with mock.patch.object(titan_parallel_dims, "device_type", "cpu"):
        return parallelize_llama(
            model, parallel_dims=dims,
            # torchtitan's default gathers bf16 params; this recipe stays in float32
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
            compile_config=CompileConfig(), ac_config=None, dump_folder="",
            flex_shard=FlexShardConfig(placement=placement))


def train(model, rows: torch.Tensor, global_tokens: int, steps: int, lr: float,
          log: bool) -> list:
    """SGD steps on `rows`; the global mean loss of each step (printed if `log`).

    torchtitan's loss convention: each rank's loss is its *summed* cross-entropy
    divided by the GLOBAL token count (every rank's tokens), and flexshard *sums*
    the gradients over the data-parallel ranks (divide factor 1), so the summed
    loss and gradient are the global batch's mean ones.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(1, steps + 1):
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(),
                               reduction="sum") / global_tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)  # the ranks' parts add up to the global mean
        losses.append(total.item())
        if log:
            print(f"step {step} loss {losses[-1]:.8f}", flush=True)
    return losses


def main(argv=None) -> list:
    args = parse_args(argv)
    model = debugmodel()
    vocab = model.tok_embeddings.num_embeddings
    if args.reference is not None:  # one process, every rank's batch
        world, rank = args.reference, 0
        rows = torch.cat([batch(r, vocab) for r in range(world)])
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        world, rank = dist.get_world_size(), dist.get_rank()
        model = shard(model, world, args.placement)
        rows = batch(rank, vocab)
    losses = train(model, rows, world * BATCH * SEQ, args.steps, args.lr, log=rank == 0)
    if rank == 0:
        print(f"final loss {losses[-1]:.8f}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
