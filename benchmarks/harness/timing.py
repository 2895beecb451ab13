"""Paired step timing: the runners take turns, each step at its slowest rank.

Paired step timing: the runners' steps alternate, who goes first rotating each
round so machine drift hits all alike; each step's time is its slowest rank's."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def slowest_rank(values: list) -> list:
    """Elementwise max over ranks (a step takes as long as its slowest rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces CUDA tensors only
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def _max_over_ranks(value: float) -> float:
    return slowest_rank([value])[0]


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
        rec["step_s"] = slowest_rank(rec["step_s"])
        rec["optim_s"] = slowest_rank(rec["optim_s"])
        rec["cpu_s"] = slowest_rank(rec["cpu_s"])
    return record


def ratio_spread(record: dict, num: str, den: str, key: str) -> dict:
    return spread([a / b for a, b in zip(record[num][key], record[den][key])])


def loss_gap(record: dict, a: str, b: str) -> float:
    """Largest relative loss difference between two runners, over steps and ranks."""
    gaps = [abs(x - y) / abs(y) for x, y in zip(record[a]["loss"], record[b]["loss"])]
    return _max_over_ranks(max(gaps))
