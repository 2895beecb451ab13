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
memory (benchmarks/measure.py). Runs on CPU with gloo, or CUDA with NCCL.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist

import flexshard as fs

from .configs import GLOO, GRIDS, MODELS, Config
from .measure import measure_step, plain_copies
from .runners import Runner


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _slowest_rank(values: list) -> list:
    """Elementwise max over ranks (a step takes as long as its slowest rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces CUDA tensors only
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _max_over_ranks(value: float) -> float:
    return _slowest_rank([value])[0]


def time_steps(runners: list, first_step: int, steps: int, world_size: int) -> dict:
    """Alternate the runners' steps, rotating who goes first; per runner the
    step and optimizer times (slowest rank) and the losses (this rank)."""
    record = {r.kind: {"step_s": [], "optim_s": [], "cpu_s": [], "loss": []} for r in runners}
    for i in range(steps):
        shift = i % len(runners)
        for r in runners[shift:] + runners[:shift]:
            if world_size > 1:
                dist.barrier()
            st = r.step(first_step + i)
            record[r.kind]["step_s"].append(st.step_s)
            record[r.kind]["optim_s"].append(st.optim_s)
            record[r.kind]["cpu_s"].append(st.cpu_s)
            record[r.kind]["loss"].append(st.loss)
    for rec in record.values():
        rec["step_s"] = _slowest_rank(rec["step_s"])
        rec["optim_s"] = _slowest_rank(rec["optim_s"])
        rec["cpu_s"] = _slowest_rank(rec["cpu_s"])
    return record


def _ratios(record: dict, num: str, den: str, key: str) -> dict:
    return _spread([a / b for a, b in zip(record[num][key], record[den][key])])


def _loss_gap(record: dict, a: str, b: str) -> float:
    """Largest relative loss difference between two runners, over steps and ranks."""
    gaps = [abs(x - y) / abs(y) for x, y in zip(record[a]["loss"], record[b]["loss"])]
    return _max_over_ranks(max(gaps))


def _unavailable(cfg: Config) -> list:
    return [name for name in cfg.needs if not hasattr(fs, name)]


def _runner_kinds(cfg: Config) -> list:
    kinds = ["fsdp2", "flexshard"]
    if cfg.world_size == 1 and cfg.param_dtype == "fp32":
        kinds.append("plain")  # the zero-overhead limit (no bf16 twin: it would not be plain)
    return kinds


def _gather_ranks(value):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_config(cfg: Config, mesh, device: torch.device, steps: int, warmup: int) -> dict:
    """Both runners (and plain at world size 1) on one configuration. Times,
    the loss gap and peak memory cover every rank; the other measures of each
    runner are this rank's (compare.py reports rank 0's)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    base = {"name": cfg.name, "config": dataclasses.asdict(cfg),
            "oversubscribed": cfg.world_size > cpu_cores() and device.type == "cpu"}
    missing = _unavailable(cfg)
    if missing:
        return {**base, "status": "unavailable",
                "reason": f"fs.{' and fs.'.join(missing)} not in this flexshard checkout "
                          "(they come with the placements work: merge main)"}
    runners = [Runner(k, cfg, mesh, device, rank) for k in _runner_kinds(cfg)]
    for i in range(warmup):
        for r in runners:
            r.step(i)
    record = time_steps(runners, warmup, steps, cfg.world_size)
    measured = {r.kind: measure_step(r, warmup + steps, cfg.world_size) for r in runners}
    peaks = _gather_ranks({k: m["memory"]["peak_bytes"] for k, m in measured.items()})
    for kind, m in measured.items():
        m["memory"]["peak_bytes_per_rank"] = [p[kind] for p in peaks]
    result = {**base, "status": "ok", "steps": steps, "warmup": warmup,
              "step_time_s": {k: _spread(v["step_s"]) for k, v in record.items()},
              "optim_time_s": {k: _spread(v["optim_s"]) for k, v in record.items()},
              "cpu_time_s": {k: _spread(v["cpu_s"]) for k, v in record.items()},
              "ratio": {"flexshard/fsdp2": _ratios(record, "flexshard", "fsdp2", "step_s"),
                        "cpu flexshard/fsdp2": _ratios(record, "flexshard", "fsdp2", "cpu_s"),
                        "optim flexshard/fsdp2": _ratios(record, "flexshard", "fsdp2", "optim_s")},
              "loss_gap_flexshard_fsdp2": _loss_gap(record, "flexshard", "fsdp2"),
              "plain_copies": plain_copies(cfg.model, cfg.param_dtype, 0, rank, device),
              "runners": measured}
    if "plain" in record:
        result["ratio"]["flexshard/plain"] = _ratios(record, "flexshard", "plain", "step_s")
        result["ratio"]["fsdp2/plain"] = _ratios(record, "fsdp2", "plain", "step_s")
        result["ratio"]["cpu flexshard/plain"] = _ratios(record, "flexshard", "plain", "cpu_s")
    return result


def local_device(requested: str = "auto") -> torch.device:
    """CUDA (one device per local rank) when available or asked for, else CPU."""
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def run_configs(configs, steps: int, warmup: int, device: str = "auto",
                verbose: bool = False) -> list:
    """Run `configs` in the current process group (all must match its world size)."""
    from torch.distributed.device_mesh import init_device_mesh

    ws = dist.get_world_size() if dist.is_initialized() else 1
    dev = local_device(device)
    wrong = [c.name for c in configs if c.world_size != ws]
    if wrong:
        raise ValueError(f"configurations {wrong} are not for world size {ws}")
    mesh = init_device_mesh(dev.type, (ws,)) if dist.is_initialized() else None
    results = []
    for cfg in configs:
        t0 = time.perf_counter()
        result = run_config(cfg, mesh, dev, steps, warmup)
        result["wall_s"] = time.perf_counter() - t0
        results.append(result)
        if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
            from .report import target_line

            note = (target_line(result) if result["status"] == "ok"
                    else f"ws={ws} {cfg.name}: {result.get('reason', '')}")
            print(f"  {note} ({result['wall_s']:.1f}s)", flush=True)
    return results


def _quiet() -> None:
    """Silence the warnings every configuration repeats (they say nothing about the numbers)."""
    for message in ("FSDP2-wrapped module", "Full backward hook is firing"):
        warnings.filterwarnings("ignore", message=message)


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "gloo"


def _worker(rank: int, ws: int, port: int, configs, steps, warmup, device, out_path) -> None:
    _quiet()
    torch.set_num_threads(1)
    if _backend(device) == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(_backend(device), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=600))
    try:
        results = run_configs(configs, steps, warmup, device, verbose=True)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_world(ws: int, configs, steps: int, warmup: int, device: str) -> list:
    """Start `ws` processes in one new process group, run `configs`, return rank 0's results."""
    import torch.multiprocessing as mp

    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        mp.start_processes(_worker, args=(ws, _free_port(), configs, steps, warmup, device,
                                          out_path), nprocs=ws, start_method="spawn")
        with open(out_path) as f:
            return json.load(f)


def machine(device: str) -> dict:
    """What the numbers were measured on."""
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_cores": cpu_cores(),
            "backend": _backend(device), "threads_per_rank": 1,
            "load_average_start": list(os.getloadavg())}
    if _backend(device) == "nccl":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4],
                   help="world sizes to run, each in its own spawned group (default 1 2 4)")
    p.add_argument("--placements", nargs="+", default=None,
                   help="only these flexshard placements (shard ragged owned mixed); "
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
    missing = sorted({n for c in grid for n in _unavailable(c)})
    if missing:
        raise SystemExit(f"--placements {' '.join(args.placements)} needs fs.{', fs.'.join(missing)}, "
                         "which this flexshard checkout lacks (merge main)")
    return grid


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def main(argv=None) -> int:
    from .report import write_outputs

    args = _parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        write_outputs(saved["results"], saved["meta"], args.out_dir, chart_png=not args.no_chart)
        return 0
    meta = machine(args.device)
    if _launched_by_torchrun():
        _quiet()
        torch.set_num_threads(1)
        dist.init_process_group(_backend(args.device))
        ws = dist.get_world_size()
        results = run_configs(_grid(args, [ws]), args.steps, args.warmup, args.device, True)
        if dist.get_rank() == 0:
            write_outputs(results, meta, args.out_dir, chart_png=not args.no_chart)
        dist.destroy_process_group()
        return 0
    results = []
    for ws in args.world_sizes:
        if _backend(args.device) == "nccl" and ws > torch.cuda.device_count():
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
