"""Compiled vs eager flexshard: step time and peak memory, reshard on and off.

    PYTHONPATH=$PWD python -m benchmarks.compile_bench [--model even] [--world-size 2]

Each configuration trains `benchmarks/model.py`'s model under flex_shard (one
bucket per block plus root), eager or with every block compiled after flex_shard
(`block.compile()`, inductor). Warm-up steps (the compile among them) are not
timed; wall and process CPU time per step are medians over the timed steps, the
slowest rank's. Peak memory is the highest sum of live CPU allocations during one
step, read from the profiler's allocator events (these see inductor's buffers as
much as eager's, which a TorchDispatchMode would not), max over ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import flexshard as fs

from .allocator_peak import allocated
from .model import batch, build_model, loss_fn

CONFIGS = [(compiled, reshard) for reshard in (True, False) for compiled in (False, True)]


def _step(model, opt, name: str, step: int, rank: int) -> float:
    x, y = batch(name, step, rank, torch.device("cpu"))
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def peak_bytes(run) -> int:
    """Peak of live CPU allocator bytes while `run()` runs (profiler memory events;
    an allocation or free outside every op, e.g. inductor's buffers, counts too)."""
    return allocated(run)[2]


def run_config(name: str, compiled: bool, reshard: bool, warmup: int, steps: int) -> dict:
    rank = dist.get_rank()
    model = fs.flex_shard(build_model(name), reshard_after_forward=reshard)
    if compiled:
        for block in model.layers:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(warmup):
        _step(model, opt, name, step, rank)
    walls, cpus = [], []
    for step in range(warmup, warmup + steps):
        dist.barrier()
        w, c = time.perf_counter(), time.process_time()
        loss = _step(model, opt, name, step, rank)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    peak = peak_bytes(lambda: _step(model, opt, name, warmup + steps, rank))
    out = torch.tensor([statistics.median(walls), statistics.median(cpus), float(peak)])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return {"compiled": compiled, "reshard": reshard, "wall_s": out[0].item(),
            "cpu_s": out[1].item(), "peak_mib": out[2].item() / 2**20, "loss": loss}


def _worker(rank: int, world: int, port: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    rows = [run_config(args.model, c, r, args.warmup, args.steps) for c, r in CONFIGS]
    if rank == 0:
        print(f"model {args.model}, world size {world}, {args.steps} timed steps after "
              f"{args.warmup} warm-up, CPU inductor, torch {torch.__version__}")
        print("| reshard | mode | wall s/step | CPU s/step | peak MiB | last loss |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {'on' if r['reshard'] else 'off'} | "
                  f"{'compiled blocks' if r['compiled'] else 'eager'} | {r['wall_s']:.4f} | "
                  f"{r['cpu_s']:.4f} | {r['peak_mib']:.2f} | {r['loss']:.5f} |")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="even", help="a name in benchmarks/model.py")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--port", type=int, default=29613)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_worker, (args.world_size, args.port, args),
                                nprocs=args.world_size)


if __name__ == "__main__":
    main()
