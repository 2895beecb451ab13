"""Train a small GPT on Shakespeare with flexshard.

    torchrun --standalone --nproc-per-node 2 examples/train.py     # 2 ranks
    python examples/train.py                                        # 1 rank

CPU runs use gloo; with CUDA each rank takes GPU LOCAL_RANK and NCCL. The
process group gets a 120 s timeout (PG_TIMEOUT): a rank that dies or hangs
makes the others fail within two minutes instead of torch's default 30.
Rank 0 prints the bucket plan (one line per bucket; --show-plan adds every
parameter), a progress bar, and a summary whose last line
is `final loss <value>`; the loss curve goes to --plot (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt.py beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # flexshard from a checkout

import flexshard as fs  # noqa: E402
from gpt import GPT, GPTConfig, batch, load_text, loss_fn  # noqa: E402
from checkpointing import Checkpointer  # noqa: E402
from report import Traffic, peak_memory_bytes, plot_losses, progress  # noqa: E402

PG_TIMEOUT = datetime.timedelta(seconds=120)
WARMUP = 10  # steps of linear learning-rate warm-up, then cosine decay to 10%
PLACEMENTS = ("shard", "owned", "ragged", "mixed")


def _sharding_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", choices=PLACEMENTS, default="shard",
                   help="how parameters are split across ranks: shard = Shard(0) on every "
                        "parameter (FSDP-like); owned = each parameter whole on one rank, "
                        "owners balanced by bytes; ragged = balanced RaggedShard rows; "
                        "mixed = Owned norms and biases, RaggedShard embeddings, Shard(0) "
                        "matrices, all in the same buckets (default shard)")
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="plan buckets with fs.plan_buckets under this many bytes each, "
                        "in execution order (default: one bucket per block plus a root bucket)")
    p.add_argument("--mp", choices=("fp32", "bf16"), default="fp32",
                   help="fp32 = no mixed precision; bf16 = compute and gather in bfloat16, "
                        "reduce gradients in float32, keep float32 master weights (default fp32)")
    p.add_argument("--gather", choices=("param", "int8", "fp8"), default="param",
                   help="what the all-gathers send: param = the weights in the --mp dtype; "
                        "int8 / fp8 = block matrices quantized with a scale per row "
                        "(fs.QuantizedGather), dequantized after the gather; master weights, "
                        "grads and AdamW stay full precision (default param)")
    p.add_argument("--no-reshard", action="store_true",
                   help="keep each block's parameters unsharded from forward to backward "
                        "(one gather per bucket per step instead of two; more memory)")
    p.add_argument("--show-plan", action="store_true",
                   help="print every parameter of the bucket plan (its placement, shape and "
                        "dtype) under the table of buckets (default: the buckets only)")
    p.add_argument("--offload", action="store_true",
                   help="CPU offload (fs.OffloadPolicy): sharded params, grads and AdamW state in "
                        "(pinned) CPU memory, copied to the GPU for each gather; the optimizer "
                        "steps on the CPU")


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="directory for checkpoints (torch.distributed.checkpoint format through "
                        "fs.save_checkpoint, one step_* sub-directory per save; saves are atomic)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save a checkpoint every N steps and at the last step "
                        "(needs --checkpoint-dir; 0 = never; default 0)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir: same "
                        "model, optimizer, step and loss curve as an uninterrupted run")


def _cannot_write(directory: Path) -> Optional[str]:
    """Why no file can be written in `directory`, or None; makes it if missing, as the run would."""
    if directory.exists() and not directory.is_dir():
        return "not a directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _check_outputs(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any training, a --plot or --checkpoint-dir the run could not write."""
    if importlib.util.find_spec("matplotlib"):  # without it no plot is written
        why = _cannot_write(args.plot.parent)
        if why:
            p.error(f"--plot {args.plot}: cannot write in {args.plot.parent} ({why}); "
                    "pass a path in a writable directory")
    if args.checkpoint_every:
        why = _cannot_write(args.checkpoint_dir)
        if why:
            p.error(f"--checkpoint-dir {args.checkpoint_dir}: cannot write in it ({why}); "
                    "pass a writable directory")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small byte-level GPT on the texts in data/ with flexshard. "
                    "Run under torchrun for several ranks, or plainly for one.")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to train (default 200)")
    _sharding_flags(p)
    _checkpoint_flags(p)
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the model initialisation and the data order (default 0)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step (default 16)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--plot", type=Path, default=Path("runs/loss.png"),
                   help="where to write the loss curve PNG (default runs/loss.png)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        p.error(f"--lr must be a finite number >= 0, got {args.lr}")
    if (args.checkpoint_every or args.resume) and args.checkpoint_dir is None:
        p.error("--checkpoint-every and --resume need --checkpoint-dir")
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.checkpoint_every and not args.resume and Checkpointer.holds_steps(args.checkpoint_dir):
        p.error(f"--checkpoint-dir {args.checkpoint_dir} holds another run's checkpoints: pass "
                "--resume to continue that run, or another directory to start over")
    if args.bucket_bytes is not None and args.bucket_bytes < 1:
        p.error(f"--bucket-bytes must be positive, got {args.bucket_bytes}")
    _check_outputs(p, args)
    return args


class Dist(NamedTuple):
    rank: int
    world_size: int
    device: torch.device


def setup_distributed() -> Dist:
    """Join torchrun's process group if launched by torchrun; else world size 1.

    A process group the caller already set up is used as it is.
    """
    if dist.is_available() and dist.is_initialized():
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        return Dist(dist.get_rank(), dist.get_world_size(), device)
    if "WORLD_SIZE" not in os.environ:
        return Dist(0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=PG_TIMEOUT, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def mixed_placement(fqn: str, param: torch.Tensor):
    """--placement mixed: one choice per parameter, all sharing the buckets."""
    if param.dim() == 1:
        return fs.Owned()  # norms and biases: small, whole on one rank
    if fqn in ("tok.weight", "pos"):
        return fs.RaggedShard()  # embeddings: balanced rows
    return fs.Shard(0)


def placement_for(name: str):
    """The --placement choice: one Placement, or a callable choosing per parameter."""
    if name == "owned":
        return fs.Owned()
    if name == "ragged":
        return fs.RaggedShard()
    return mixed_placement if name == "mixed" else fs.Shard(0)


def build_model(args, env: Dist) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig()).to(env.device)
    mp = (fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.mp == "bf16" else fs.MixedPrecisionPolicy())
    if args.gather != "param":
        wire = torch.int8 if args.gather == "int8" else torch.float8_e4m3fn
        mp = dataclasses.replace(mp, gather_format=fs.QuantizedGather(wire))
    buckets = None
    if args.bucket_bytes is not None:
        example = (torch.zeros(1, model.cfg.seq, dtype=torch.long, device=env.device),)
        buckets = fs.plan_buckets(model, bucket_bytes=args.bucket_bytes,
                                  example_inputs=example)  # traced execution order
    return fs.flex_shard(model, buckets=buckets, placement=placement_for(args.placement),
                         mp_policy=mp, reshard_after_forward=not args.no_reshard,
                         offload_policy=fs.OffloadPolicy() if args.offload else None)


def mean_over_ranks(value: torch.Tensor, env: Dist) -> float:
    value = value.detach().float().reshape(1).clone()
    if env.world_size > 1:
        dist.all_reduce(value)
    return value.item() / env.world_size


class RunResult(NamedTuple):
    losses: list  # mean loss over ranks, one per step from step 0
    steps_run: int  # steps this process trained (fewer than --steps after --resume)
    seconds: float
    traffic: Traffic  # flexshard collectives during those steps


def lr_schedule(total: int):
    """Multiplier of --lr at each step: linear warm-up, then cosine decay to 10%."""
    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        progress = (step - WARMUP) / max(1, total - WARMUP)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def train(args, env: Dist, model, opt, data, ckpt: Optional[Checkpointer], start: int,
          losses: list) -> RunResult:
    cfg, log = model.cfg, env.rank == 0
    lr_at = lr_schedule(args.steps)
    saved = Traffic.zero()
    before = Traffic.of(model)
    t0 = time.perf_counter()
    bar = progress(range(start, args.steps), enabled=log, initial=start, total=args.steps)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_at(step)
        x, y = batch(data, step, env.rank, args.batch_size, cfg.seq, args.seed)
        loss = loss_fn(model(x.to(env.device)), y.to(env.device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss, env))
        done = step + 1 - start
        tok_s = done * args.batch_size * cfg.seq * env.world_size / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s:,.0f}")
        if ckpt is not None and ckpt.due(step + 1, args.steps):
            mark = Traffic.of(model)
            ckpt.save(step + 1, model, opt, losses)
            saved = saved + (Traffic.of(model) - mark)
    seconds = time.perf_counter() - t0
    return RunResult(losses, args.steps - start, seconds, Traffic.of(model) - before - saved)


def summary(args, env: Dist, model, result: RunResult) -> None:
    peaks = peak_memory_bytes(env)
    if env.rank != 0:
        return
    n = max(result.steps_run, 1)
    tokens = result.steps_run * args.batch_size * model.cfg.seq * env.world_size
    t = result.traffic
    print(f"\nsteps {len(result.losses)} ({result.steps_run} this run) on {env.world_size} "
          f"rank(s), {env.device.type}, placement {args.placement}, mp {args.mp}, "
          f"reshard after forward {not args.no_reshard}, offload {args.offload}")
    print(f"tokens/s {tokens / max(result.seconds, 1e-9):,.0f} (all ranks)")
    measure = "CUDA max allocated" if env.device.type == "cuda" else "max RSS of the process"
    print(f"peak memory per rank ({measure}) " + ", ".join(f"r{r}: {b / 2**20:.1f} MiB"
                                                           for r, b in enumerate(peaks)))
    print(f"collectives per step: {t.gathers / n:.1f} all-gathers, {t.reduces / n:.1f} "
          f"reduce-scatters; bytes per step per rank: {t.wire_bytes / n / 2**20:.3f} MiB on "
          f"the wire ({t.padding_bytes / n / 2**10:.1f} KiB of it padding)")
    print(f"loss {result.losses[0]:.4f} at step 1, {result.losses[-1]:.4f} at step "
          f"{len(result.losses)}")
    written = plot_losses(result.losses, args.plot)
    print(f"loss curve: {written}")
    print(f"final loss {result.losses[-1]:.4f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    owns_group = "WORLD_SIZE" in os.environ and not dist.is_initialized()
    env = setup_distributed()
    try:
        model = build_model(args, env)
        if env.rank == 0:
            print(fs.describe(model).table(per_param=args.show_plan), flush=True)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        ckpt = (Checkpointer(args.checkpoint_dir, args.checkpoint_every)
                if args.checkpoint_dir else None)
        start, losses = (ckpt.load(model, opt) if args.resume else (0, []))
        if start > args.steps:  # the same checkpoint on every rank: every rank raises
            raise ValueError(f"--steps {args.steps} is before the checkpoint's step {start} in "
                             f"{args.checkpoint_dir}: pass --steps {start} or more (the run's "
                             "total steps, counted from step 0)")
        if env.rank == 0 and args.resume:
            left = "" if start < args.steps else f": --steps {args.steps} reached, nothing to train"
            print(f"resumed from step {start}{left}", flush=True)
        if start == args.steps:  # a finished run started again (a requeued job) is done
            return
        result = train(args, env, model, opt, load_text(), ckpt, start, losses)
        summary(args, env, model, result)
    finally:
        if owns_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
