"""Parity helpers for the placement tests: a single-process reference and a
rank body that trains the same model with flex_shard on the same data.

The reference simulates the ranks: it takes each rank's gradient on that rank's
batch separately and averages them in rank order, as the bucket's reduce does,
so at two ranks the averaged gradients are bitwise those of flex_shard.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Optional

import torch

import flexshard as fs
from flexshard.runtime.state import get_state
import reference
from models import TinyGPT, batch, loss_fn
from test_parity import assert_rel_close

LR = 1e-2


def make_model(seed: int = 0, bf16_pos: bool = False, dtype=None, **kw) -> TinyGPT:
    """TinyGPT in `dtype` (default fp32); `bf16_pos` keeps the position table
    in bf16 (a mixed-dtype bucket)."""
    model = reference.make_model(seed, **kw)
    if dtype is not None:
        model.to(dtype)
    if bf16_pos:
        model.pos.data = model.pos.data.bfloat16()
    return model


def adamw(model) -> torch.optim.Optimizer:
    """AdamW over the (non-empty) parameters of a plain or wrapped model."""
    return torch.optim.AdamW([p for p in model.parameters() if p.numel()], lr=LR)


def reference_run(world: int, steps: int, make_opt: Callable = adamw,
                  param_dtype: Optional[torch.dtype] = None, model_kw=None) -> tuple:
    """(mean loss per step, final params) of single-process training on every
    rank's batch; with `param_dtype` each rank's batch runs on a low-precision
    copy of the fp32 weights, as flexshard's mixed precision does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers: same kernels, same rounding
    try:
        model = make_model(**(model_kw or {}))
        opt = make_opt(model)
        losses = []
        for step in range(steps):
            losses.append(_average_grads(model, step, world, param_dtype))
            opt.step()
            opt.zero_grad()
        return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _average_grads(model, step: int, world: int, param_dtype) -> float:
    params = list(model.parameters())
    sums = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
            for p in params]
    total = 0.0
    for r in range(world):
        run = model if param_dtype is None else copy.deepcopy(model).to(param_dtype)
        x, y = batch(step, r)
        loss = loss_fn(run(x), y)
        for s, g in zip(sums, torch.autograd.grad(loss, list(run.parameters()))):
            s.add_(g.to(s.dtype))
        total += loss.item()
    for p, s in zip(params, sums):
        p.grad = s.div_(world).to(p.dtype)
    return total / world


def train_sharded(steps: int, config: dict, make_opt: Callable = adamw, model_kw=None,
                  count_comms: bool = False) -> tuple:
    """Rank body: (mean loss per step, full params on rank 0, stats). Stats:
    'comms' and 'step_comms', the c10d collectives of each step's forward +
    backward and of its optimizer step, by op name (when `count_comms`), and
    'buckets': per bucket (name, reshard after forward, counters, gather
    layout, bound placements)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = fs.flex_shard(make_model(**(model_kw or {})), **config)
    opt = make_opt(model)
    losses, counts, step_counts = [], [], []
    for step in range(steps):
        x, y = batch(step, rank)
        with comm_counter(count_comms) as counted:
            loss = loss_fn(model(x), y)
            loss.backward()
        counts.append(counted())
        with comm_counter(count_comms) as counted:
            opt.step()
        step_counts.append(counted())
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    buckets = [(b.name, b.reshard_after_forward, dataclasses.asdict(b.counters),
                b.gather_layout, [s.placement for s in b.slots]) for b in get_state(model).buckets]
    full = fs.full_state_dict(model)
    return losses, full if rank == 0 else None, {"comms": counts, "step_comms": step_counts,
                                                  "buckets": buckets}


class comm_counter:
    """Counts c10d collectives run inside the block (CommDebugMode), when enabled."""

    def __init__(self, enabled: bool = True) -> None:
        self.mode = None
        if enabled:
            from torch.distributed.tensor.debug import CommDebugMode

            self.mode = CommDebugMode()

    def __enter__(self):
        if self.mode is not None:
            self.mode.__enter__()
        return self.counts

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)

    def counts(self) -> dict:
        if self.mode is None:
            return {}
        return {str(op).split(".")[-1]: n for op, n in self.mode.get_comm_counts().items()}


def check_parity(world: int, config: dict, steps: int = 4, make_opt: Callable = adamw,
                 param_dtype=None, model_kw=None, rtol: float = 1e-5,
                 count_comms: bool = False, exact: bool = False) -> list:
    """Train with flex_shard and the reference; compare losses every step and
    full params at the end (bitwise when `exact`). Returns the per-rank results."""
    from harness import run_world

    results = run_world(world, train_sharded, steps, config, make_opt, model_kw, count_comms,
                        timeout=180)
    ref_losses, ref_params = reference_run(world, steps, make_opt, param_dtype, model_kw)
    losses, full, _ = results[0]
    assert all(r[0] == losses for r in results), "ranks disagree on the loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                               rtol=rtol, atol=1e-6)
    assert full.keys() == ref_params.keys()
    for k, ref in ref_params.items():
        assert full[k].dtype == ref.dtype, k
        if exact:
            assert torch.equal(full[k], ref), f"{k} is not bitwise equal to the reference"
        assert_rel_close(full[k], ref, rtol, k)
    return results


def assert_one_collective_per_bucket(results) -> None:
    """Every step: one reduce-scatter per bucket and one all-gather per bucket
    (two for a bucket that reshards after forward: backward gathers again)."""
    for _, _, stats in results:
        buckets = stats["buckets"]
        want = {"_reduce_scatter_base_": len(buckets)}
        for _, reshard, _, _, _ in buckets:
            want["_allgather_base_"] = want.get("_allgather_base_", 0) + (2 if reshard else 1)
        for step, got in enumerate(stats["comms"]):
            assert got == want, f"step {step}: collectives {got}, expected {want}"
