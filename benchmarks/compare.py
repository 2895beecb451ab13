"""flexshard side by side with FSDP2 on the same transformer, data and grouping.

    PYTHONPATH=$PWD python -m benchmarks.compare            # world sizes 1, 2, 4
    PYTHONPATH=$PWD python -m benchmarks.compare --world-sizes 2 --steps 6
    PYTHONPATH=$PWD python -m benchmarks.compare --grid engine --world-sizes 2   # issue 12's
    PYTHONPATH=$PWD python -m benchmarks.compare --grid gather --world-sizes 2   # quantized
    torchrun --nproc-per-node 2 -m benchmarks.compare       # one world, from torchrun

Per configuration both runners (and the plain model at world size 1) train
from the same initial weights on the same batches; their steps alternate
(A B, B A, ...) so machine drift hits both alike. Step time is reported as
the median (min, max) of the per-step ratios flexshard / FSDP2, each step
timed on every rank and taken at the slowest rank. Then one instrumented
step per runner measures collectives, bytes on the wire, local copies and
memory (benchmarks/harness/measure.py). Runs on CPU with gloo, or CUDA with NCCL.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist

from .harness.comparison import cpu_cores, run_configs, unavailable
from .harness.configs import GLOO, GRIDS, MODELS
from .harness.worlds import backend, launched_by_torchrun, machine, quiet, spawn_world


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4],
                   help="world sizes to run, each in its own spawned group (default 1 2 4)")
    p.add_argument("--placements", nargs="+", default=None,
                   help="only these flexshard placements (shard ragged owned mixed shard1); "
                        "naming one this checkout lacks is an error")
    p.add_argument("--grid", choices=sorted(GRIDS), default="default",
                   help="default: one change at a time from Shard/fp32/reshard/odd; engine: "
                        "shard, ragged and owned x fp32 and bf16, reshard on (RESULTS.md's "
                        "engine targets); "
                        "gather: fp32 and bf16 x flexshard gathering param_dtype, int8 or fp8")
    p.add_argument("--models", nargs="+", choices=MODELS, default=None,
                   help="run the grid on these models (default grid: odd and even as it "
                        "lists them; engine grid: llama)")
    p.add_argument("--reshard", nargs="+", choices=("on", "off"), default=["on"],
                   help="engine and gather grids: reshard after forward on, off or both")
    p.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=None,
                   help="only these param dtypes (default: the grid's)")
    p.add_argument("--gloo", nargs="+", choices=GLOO, default=["rooted"],
                   help="flexshard's collectives on gloo: rooted (one broadcast / reduce per "
                        "rank, the default) and/or plain (all-gather / reduce-scatter)")
    p.add_argument("--steps", type=int, default=12, help="timed (paired) steps per configuration")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed steps before the timed ones (default 2)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the models train: auto = CUDA when available, else CPU "
                        "(default auto)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "runs", "compare"),
                   help="where results.json, .md and .png go (default runs/compare, ignored by git)")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG (needs matplotlib)")
    p.add_argument("--from-json", help="re-render the report of an earlier results.json; run nothing")
    return p.parse_args(argv)


def _grid(args, world_sizes) -> list:
    if args.grid in ("engine", "gather"):
        grid = GRIDS[args.grid](tuple(world_sizes), tuple(args.models or ("llama",)),
                                tuple(r == "on" for r in args.reshard))
    else:
        grid = GRIDS["default"](tuple(world_sizes))
        if args.models:  # the same variants on these models instead
            grid = list(dict.fromkeys(dataclasses.replace(c, model=m)
                                      for c in grid for m in args.models))
    if args.dtypes is not None:
        grid = [c for c in grid if c.param_dtype in args.dtypes]
    grid = [dataclasses.replace(c, gloo=g) for c in grid for g in args.gloo]
    if args.placements is None:
        return grid
    grid = [c for c in grid if c.placement in args.placements]
    missing = sorted({n for c in grid for n in unavailable(c)})
    if missing:
        raise SystemExit(f"--placements {' '.join(args.placements)} needs fs.{', fs.'.join(missing)}, "
                         "which this flexshard checkout lacks (merge main)")
    return grid


def main(argv=None) -> int:
    from .harness.report import write_outputs

    args = _parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        write_outputs(saved["results"], saved["meta"], args.out_dir, chart_png=not args.no_chart)
        return 0
    meta = machine(args.device)
    if launched_by_torchrun():
        quiet()
        torch.set_num_threads(1)
        dist.init_process_group(backend(args.device))
        ws = dist.get_world_size()
        results = run_configs(_grid(args, [ws]), args.steps, args.warmup, args.device, True)
        if dist.get_rank() == 0:
            write_outputs(results, meta, args.out_dir, chart_png=not args.no_chart)
        dist.destroy_process_group()
        return 0
    results = []
    for ws in args.world_sizes:
        if backend(args.device) == "nccl" and ws > torch.cuda.device_count():
            print(f"world size {ws}: only {torch.cuda.device_count()} GPU(s), skipped")
            continue
        print(f"world size {ws}" + (" (oversubscribes the CPU cores)" if ws > cpu_cores() else ""),
              flush=True)
        results += spawn_world(ws, _grid(args, [ws]), args.steps, args.warmup, args.device)
    meta["load_average_end"] = list(os.getloadavg())
    write_outputs(results, meta, args.out_dir, chart_png=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
