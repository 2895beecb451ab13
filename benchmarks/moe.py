"""Mixture of experts: flexshard's torchtitan `parallelize_decoder` against torchtitan's
own FSDP2 path (`parallelize_qwen3`, i.e. `apply_fsdp_to_decoder`) on the same Qwen3 MoE
model, data and expert-parallel plan: peak memory, bytes on the wire per step and step
time, as ratios flexshard / FSDP2 from one run.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.moe             # ep 2
    torchrun --standalone --nproc-per-node 4 -m benchmarks.moe --no-time   # ep 2, efsdp 2
    torchrun --standalone --nproc-per-node 2 -m benchmarks.moe --compile aot_eager
    torchrun --standalone --nproc-per-node 2 -m benchmarks.moe --no-time --vocab 32768

The model: torchtitan's Qwen3 MoE layers at hidden 384 (6 heads of 64, 2 KV heads),
2 layers of 8 experts (top 2, expert hidden 768), vocabulary 2048, sequence 256, batch 2
per rank, AdamW, fp32 params. Both libraries run torchtitan's EP plan (experts as DTensors
over `ep`, the all-to-all token dispatcher, its bf16 grouped GEMM) and its loss (summed
over the global token count, gradients summed: FSDP2 forced to sum on gloo, which has
no PREMUL_SUM). SDPA attention (flex attention has no CPU backward). Steps alternate
A B, B A; the step-time ratio is the median of per-step ratios at the slowest rank. At 4
ranks the cores are oversubscribed: memory and bytes only. `--compile BACKEND` is
torchtitan's `--compile.enable` for both (its per-block compile); the report adds each
library's first step (the compiles) and its count of dynamo graphs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from unittest import mock

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness.meters import MemoryMeter, TrafficMeter

DIM, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 384, 6, 2, 64, 2
EXPERTS, TOP_K, EXPERT_HIDDEN, VOCAB, SEQ, BATCH = 8, 2, 768, 2048, 256, 2


def model_config():
    """torchtitan's Qwen3 MoE layers at the benchmark's shape, SDPA attention."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    base = model_registry("debugmodel_moe").model  # embeddings, norm and head configs
    cfg = type(base)(
        vocab_size=VOCAB, dim=DIM, norm=type(base.norm)(normalized_shape=DIM),
        tok_embeddings=type(base.tok_embeddings)(num_embeddings=VOCAB, embedding_dim=DIM,
                                                 param_init=base.tok_embeddings.param_init),
        lm_head=type(base.lm_head)(in_features=DIM, out_features=VOCAB,
                                   param_init=base.lm_head.param_init),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM, moe_hidden_dim=EXPERT_HIDDEN, num_experts=EXPERTS, top_k=TOP_K,
            attn_backend="flex", moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1000000.0)))
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def build(library: str, ep: int, backend: str = ""):
    """The model, parallelized by `library` ("fsdp2" or "flexshard"), and its AdamW."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims as titan_parallel_dims
    from torchtitan.distributed import utils as dist_utils

    parallelism = ParallelismConfig(expert_parallel_degree=ep, spmd_backend="partial_dtensor")
    cfg = model_config()

    class _Job:
        pass

    job = _Job()
    job.parallelism = parallelism
    cfg.update_from_config(config=job)
    torch.manual_seed(0)
    model = cfg.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=ep,
                        world_size=world, spmd_backend="partial_dtensor")
    args = dict(parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                parallelism=parallelism, ac_config=None,
                compile_config=CompileConfig(enable=bool(backend), components=["model"],
                                             backend=backend or "inductor"),
                dump_folder="")
    with mock.patch.object(titan_parallel_dims, "device_type", "cpu"):
        dist_utils.set_spmd_backend("partial_dtensor")
        dims.build_mesh()
        if library == "fsdp2":
            from torch.distributed.fsdp import FSDPModule
            from torchtitan.models.qwen3.parallelize import parallelize_qwen3

            model = parallelize_qwen3(model, **args)
            for module in model.modules():  # torchtitan's divide factor 1 is PREMUL_SUM
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        else:
            from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_decoder

            model = parallelize_decoder(model, **args, flex_shard=FlexShardConfig())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def train_step(model, opt, step: int) -> float:
    rows = tokens(step)
    logits = model(rows[:, :-1])
    global_tokens = rows[:, 1:].numel() * dist.get_world_size()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(),
                           reduction="sum") / global_tokens
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def timed(model, opt, step: int) -> float:
    """Wall seconds of one step at the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    train_step(model, opt, step)
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def first_step(model, opt) -> tuple:
    """Step 0: (loss, wall seconds at the slowest rank, graphs dynamo made in it)."""
    from torch._dynamo.utils import counters

    counters.clear()
    start = time.perf_counter()
    loss = train_step(model, opt, 0)
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return loss, took.item(), counters["stats"]["unique_graphs"]


def measured(model, opt, step: int) -> dict:
    """One step under the meters: peak live bytes (max over ranks), wire bytes per kind."""
    with MemoryMeter() as mem, TrafficMeter() as traffic:
        mem.register(model.parameters(), "param")
        train_step(model, opt, step)
    peak = torch.tensor([float(mem.peak)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"peak": peak.item(), "wire": dict(traffic.collective_bytes),
            "count": dict(traffic.collectives)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=2, help="expert parallel degree (default 2)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per library (default 6)")
    p.add_argument("--compile", default="", metavar="BACKEND",
                   help="compile each block with this torch.compile backend (default: eager)")
    p.add_argument("--vocab", type=int, default=VOCAB,
                   help="vocabulary size (default 2048; Llama 3's is 128256)")
    p.add_argument("--no-time", action="store_true",
                   help="memory and bytes only (when the cores are oversubscribed)")
    args = p.parse_args()
    globals()["VOCAB"] = args.vocab  # read by model_config and tokens
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    runs = {lib: build(lib, args.ep, args.compile) for lib in ("fsdp2", "flexshard")}
    losses, first = {}, {}
    for lib in runs:  # warm-up: lazy init, and the compiles
        losses[lib], *first[lib] = first_step(*runs[lib])
    # the meters are dispatch modes, which compiled graphs refuse: time only, compiled
    stats = None if args.compile else {lib: measured(*runs[lib], 1) for lib in runs}
    from torch._dynamo.utils import counters

    counters.clear()  # graphs made after step 0: recompiles
    times: dict = {lib: [] for lib in runs}
    order = ["fsdp2", "flexshard"]
    for step in range(2, 2 + (0 if args.no_time else args.steps)):
        for lib in order:
            times[lib].append(timed(*runs[lib], step))
        order.reverse()
    if dist.get_rank() == 0:
        report(args, losses, stats, times)
        for lib in runs if args.compile else ():
            print(f"{lib}: first step {first[lib][0]:.1f} s, {first[lib][1]} dynamo graphs")
        if args.compile:
            print(f"dynamo graphs made in the timed steps: {counters['stats']['unique_graphs']}")
    dist.destroy_process_group()


def report(args, losses: dict, stats: dict, times: dict) -> None:
    world = dist.get_world_size()
    print(f"Qwen3 MoE (hidden {DIM}, {LAYERS} layers x {EXPERTS} experts, top {TOP_K}, vocab {VOCAB}), "
          f"{world} ranks, ep {args.ep}, efsdp {world // args.ep}"
          f"{', compiled with ' + args.compile if args.compile else ''}; step-0 loss FSDP2 "
          f"{losses['fsdp2']:.5f}, flexshard {losses['flexshard']:.5f}")
    if stats is not None:
        report_bytes(stats)
    if times["fsdp2"]:
        ratios = [a / b for a, b in zip(times["flexshard"], times["fsdp2"])]
        print(f"step time: FSDP2 {statistics.median(times['fsdp2']) * 1e3:.0f} ms, flexshard "
              f"{statistics.median(times['flexshard']) * 1e3:.0f} ms, ratio median "
              f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


def report_bytes(stats: dict) -> None:
    f, x = stats["fsdp2"], stats["flexshard"]
    print(f"peak memory per rank: FSDP2 {f['peak'] / 2**20:.2f} MiB, flexshard "
          f"{x['peak'] / 2**20:.2f} MiB, ratio {x['peak'] / f['peak']:.3f}")
    kinds = sorted(set(f["wire"]) | set(x["wire"]))
    for kind in kinds:
        print(f"  {kind}: FSDP2 {f['count'].get(kind, 0)} x, {f['wire'].get(kind, 0) / 2**20:.2f} "
              f"MiB; flexshard {x['count'].get(kind, 0)} x, {x['wire'].get(kind, 0) / 2**20:.2f} MiB")
    tf, tx = sum(f["wire"].values()), sum(x["wire"].values())
    print(f"bytes on the wire per step: FSDP2 {tf / 2**20:.2f} MiB, flexshard "
          f"{tx / 2**20:.2f} MiB, ratio {tx / tf:.3f}")


if __name__ == "__main__":
    main()
