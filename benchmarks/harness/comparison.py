"""One comparison: every runner on one configuration, timed in pairs, then measured.

One comparison: every runner (flexshard, FSDP2, and the plain model at world
size 1) on one configuration, from the same weights on the same batches; their
steps timed in pairs, then one instrumented step each (measure.py)."""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

import flexshard as fs

from .configs import Config
from .measure import measure_step, plain_copies
from .runners import Runner
from .timing import loss_gap, ratio_spread, spread, time_steps


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def unavailable(cfg: Config) -> list:
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
    missing = unavailable(cfg)
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
              "step_time_s": {k: spread(v["step_s"]) for k, v in record.items()},
              "optim_time_s": {k: spread(v["optim_s"]) for k, v in record.items()},
              "cpu_time_s": {k: spread(v["cpu_s"]) for k, v in record.items()},
              "ratio": {name: ratio_spread(record, "flexshard", "fsdp2", key)
                        for name, key in (("flexshard/fsdp2", "step_s"),
                                          ("cpu flexshard/fsdp2", "cpu_s"),
                                          ("optim flexshard/fsdp2", "optim_s"))},
              "loss_gap_flexshard_fsdp2": loss_gap(record, "flexshard", "fsdp2"),
              "plain_copies": plain_copies(cfg.model, cfg.param_dtype, 0, rank, device),
              "runners": measured}
    if "plain" in record:
        result["ratio"]["flexshard/plain"] = ratio_spread(record, "flexshard", "plain", "step_s")
        result["ratio"]["fsdp2/plain"] = ratio_spread(record, "fsdp2", "plain", "step_s")
        result["ratio"]["cpu flexshard/plain"] = ratio_spread(record, "flexshard", "plain", "cpu_s")
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
