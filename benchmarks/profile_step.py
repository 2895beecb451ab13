"""Where a runner's step time goes: CPU time per step and a cProfile of a few steps.

    PYTHONPATH=$PWD python -m benchmarks.profile_step --dtype bf16      # the RESULTS.md profile

Runs at world size 1 in one process (a 1-rank gloo group), so no communication
blurs the picture: with a cast, flexshard's hooks, gathers and reshard still run.
For each runner and reshard setting it prints the CPU time per step and the
functions of flexshard, torch.utils.checkpoint and FSDP2 with the most
cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist

_PATTERN = "flexshard/|checkpoint.py|_fully_shard/|run_backward"


def _cpu_per_step(runner, steps: int) -> float:
    start = time.process_time()
    for i in range(steps):
        runner.step(i)
    return (time.process_time() - start) / steps


def _profile(runner, steps: int, top: int, sort: str = "cumulative") -> str:
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        runner.step(i)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(_PATTERN, top)
    return out.getvalue()


def main(argv=None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from .harness.configs import Config
    from .harness.runners import Runner

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16",
                   help="fp32, or bf16 mixed precision (default bf16)")
    p.add_argument("--model", choices=("odd", "even", "llama"), default="odd",
                   help="model shape from benchmarks/harness/model.py: odd pads at every world "
                        "size, even divides evenly, llama is Llama-like (default odd)")
    p.add_argument("--placement", choices=("shard", "ragged", "owned"), default="shard",
                   help="flexshard's placement for every parameter (default shard)")
    p.add_argument("--sort", choices=("cumulative", "tottime"), default="cumulative",
                   help="cProfile column the listing is sorted by (default cumulative)")
    p.add_argument("--steps", type=int, default=20, help="steps timed per runner")
    p.add_argument("--top", type=int, default=12, help="functions listed per profile")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    try:
        for kind in ("fsdp2", "flexshard"):
            for reshard in (True, False):
                cfg = Config(1, placement=args.placement, param_dtype=args.dtype,
                             reshard=reshard, model=args.model)
                runner = Runner(kind, cfg, mesh, torch.device("cpu"), 0)
                _cpu_per_step(runner, 3)  # warm up
                cpu = _cpu_per_step(runner, args.steps)
                print(f"=== {kind}, {cfg.name}: {cpu * 1e3:.1f} ms CPU per step")
                print(_profile(runner, 5, args.top, args.sort))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
