"""The one reference stack the distributed tests compare against: the test model,
single-process training on every rank's batch, the sharded rank body, and the
parity check between them.

The reference simulates the ranks: it takes each rank's gradient on that rank's
batch separately (on a `param_dtype` copy of the fp32 weights under mixed
precision, as flexshard's gather casts them) and averages them in rank order,
as a bucket's reduce does, so at two ranks the averaged gradients are bitwise
those of flex_shard.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Optional

import torch

import flexshard as fs
from models import TinyGPT, batch, loss_fn

LR = 1e-2


def make_model(seed: int = 0, bf16_pos: bool = False, dtype=None, **kw) -> TinyGPT:
    """TinyGPT in `dtype` (default fp32); `bf16_pos` keeps the position table
    in bf16 (a mixed-dtype bucket)."""
    torch.manual_seed(seed)
    model = TinyGPT(**kw)
    if dtype is not None:
        model.to(dtype)
    if bf16_pos:
        model.pos.data = model.pos.data.bfloat16()
    return model


def adamw(model, lr: float = LR) -> torch.optim.Optimizer:
    """AdamW over the (non-empty) parameters of a plain or wrapped model."""
    return torch.optim.AdamW([p for p in model.parameters() if p.numel()], lr=lr)


def reference_run(world: int, steps: int, lr: float = LR, param_dtype=None, model_kw=None,
                  make_opt: Optional[Callable] = None) -> tuple:
    """Single-process training on every rank's batch: (mean loss per step, final
    params, step-0 grads). `make_opt(model)` builds the optimizer (AdamW at `lr`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers: same kernels, same rounding
    try:
        model = make_model(**(model_kw or {}))
        opt = make_opt(model) if make_opt is not None else adamw(model, lr)
        losses, first_grads = [], None
        for step in range(steps):
            losses.append(average_grads(model, step, world, param_dtype))
            if step == 0:
                first_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        params = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
        return losses, params, first_grads
    finally:
        torch.set_num_threads(threads)


def average_grads(model, step: int, world: int, param_dtype=None, batch_fn=batch,
                  loss=loss_fn) -> float:
    """Each rank's batch on `model` (or a `param_dtype` copy of it), the grads
    averaged in rank order into `model`'s .grad (summed in fp32 at least);
    returns the mean loss."""
    params = list(model.parameters())
    sums = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
            for p in params]
    total = 0.0
    for r in range(world):
        run = model if param_dtype is None else copy.deepcopy(model).to(param_dtype)
        x, y = batch_fn(step, r)
        value = loss(run(x), y)
        for s, g in zip(sums, torch.autograd.grad(value, list(run.parameters()))):
            s.add_(g.to(s.dtype))
        total += value.item()
    for p, s in zip(params, sums):
        p.grad = s.div_(world).to(p.dtype)
    return total / world


def train_sharded(steps: int, config: dict, model_kw=None, make_opt: Optional[Callable] = None,
                  count_comms: bool = False) -> tuple:
    """Rank body: flex_shard(TinyGPT, **config) trained on this rank's batches:
    (mean loss per step, full params on rank 0, step-0 sharded grads, stats).
    Stats: 'comms' and 'step_comms', the c10d collectives of each step's forward
    + backward and of its optimizer step, by op name (when `count_comms`), and
    'buckets': per bucket (name, reshard after forward, counters, gather layout,
    bound placements); 'made_once': the buckets whose unsharded params are made once
    and refilled (runtime/unsharded.py)."""
    import torch.distributed as dist

    from flexshard.runtime.state import get_state

    rank, world = dist.get_rank(), dist.get_world_size()
    model = fs.flex_shard(make_model(**(model_kw or {})), **config)
    opt = make_opt(model) if make_opt is not None else adamw(model)
    losses, counts, step_counts, first_grads = [], [], [], None
    for step in range(steps):
        x, y = batch(step, rank)
        with comm_counter(count_comms) as counted:
            loss = loss_fn(model(x), y)
            loss.backward()
        counts.append(counted())
        if step == 0:
            first_grads = sharded_grads(model)
        with comm_counter(count_comms) as counted:
            opt.step()
        step_counts.append(counted())
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    buckets = [(b.name, b.gather.reshard_after_forward, dataclasses.asdict(b.counters),
                b.gather.layout, [s.placement for s in b.slots]) for b in get_state(model).buckets]
    full = fs.full_state_dict(model)
    made_once = [b.name for b in get_state(model).buckets if b.gather.unsharded is not None]
    stats = {"comms": counts, "step_comms": step_counts, "buckets": buckets,
             "made_once": made_once}
    return losses, full if rank == 0 else None, first_grads, stats


def sharded_grads(model) -> dict:
    """fqn -> (bound placement, full shape, this rank's sharded grad)."""
    from flexshard.runtime.state import get_state

    return {s.fqn: (s.placement, s.shape, None if p.grad is None else p.grad.clone())
            for b in get_state(model).buckets for s, p in zip(b.slots, b.params)}


def assemble_grads(results) -> dict:
    """Full grads from every rank's sharded grads (each result's third item),
    joined by each placement; params without a grad on some rank are left out."""
    grads = [r[2] for r in results]
    return {fqn: placement.unshard([g[fqn][2] for g in grads], shape)
            for fqn, (placement, shape, _) in grads[0].items()
            if all(g[fqn][2] is not None for g in grads)}


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


def check_parity(world: int, config: dict, steps: int = 4, make_opt: Optional[Callable] = None,
                 param_dtype=None, model_kw=None, rtol: float = 1e-5, atol: float = 1e-6,
                 count_comms: bool = False, exact: bool = False) -> list:
    """Train with flex_shard and with the reference on the same data; compare the
    losses of every step, the first step's grads (AdamW is blind to their scale)
    and the params at the end (bitwise when `exact`). Returns the per-rank results."""
    from harness import run_world

    results = run_world(world, train_sharded, steps, config, model_kw, make_opt, count_comms,
                        timeout=180)
    compare_to_reference(results, world, steps, make_opt, param_dtype, model_kw, rtol, atol, exact)
    return results


def compare_to_reference(results: list, world: int, steps: int,
                         make_opt: Optional[Callable] = None, param_dtype=None, model_kw=None,
                         rtol: float = 1e-5, atol: float = 1e-6, exact: bool = False) -> None:
    """Check `train_sharded`'s per-rank results against `reference_run` (see check_parity)."""
    ref_losses, ref_params, ref_grads = reference_run(world, steps, param_dtype=param_dtype,
                                                      model_kw=model_kw, make_opt=make_opt)
    losses, full = results[0][0], results[0][1]
    assert all(r[0] == losses for r in results), "ranks disagree on the loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    grads = assemble_grads(results)
    assert grads.keys() == ref_grads.keys(), "a trained param got no grad"
    for k, ref in ref_grads.items():
        torch.testing.assert_close(grads[k], ref, rtol=rtol, atol=atol * 0.1,
                                   msg=lambda m, k=k: f"grad of {k}: {m}")
    assert full.keys() == ref_params.keys()
    for k, ref in ref_params.items():
        assert full[k].dtype == ref.dtype, k
        if exact:
            assert torch.equal(full[k], ref), f"{k} is not bitwise equal to the reference"
        assert_rel_close(full[k], ref, rtol, k)


def assert_rel_close(actual, expected, rel, name) -> None:
    """Norm-wise relative error: AdamW turns fp32 rounding in a near-zero grad
    into a full step for that one element, so elementwise bounds test noise."""
    err = ((actual.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err <= rel, f"{name}: relative error {err:.3g} > {rel:g}"


def assert_one_collective_per_bucket(results) -> None:
    """Every step: one reduce-scatter per bucket and one all-gather per bucket
    (two for a bucket that reshards after forward: backward gathers again). A
    bucket of whole tensors (Owned) on unequal ranks reduces by a list
    reduce-scatter (`reduce_scatter_`, its reduce layout uneven), the rest by
    `_reduce_scatter_base_`."""
    for result in results:
        stats = result[3]
        buckets = stats["buckets"]
        # and one small all-reduce: the ranks agree on what trains (RankAgreement)
        want = {"_reduce_scatter_base_": len(buckets), "allreduce_": 1}
        for _, reshard, _, _, _ in buckets:
            want["_allgather_base_"] = want.get("_allgather_base_", 0) + (2 if reshard else 1)
        for step, got in enumerate(stats["comms"]):
            got = reduce_scatters_as_one(got)
            assert got == want, f"step {step}: collectives {got}, expected {want}"


def reduce_scatters_as_one(counts: dict) -> dict:
    """Collective counts with the list reduce-scatters (`reduce_scatter_`: a bucket
    of whole tensors on unequal ranks, an uneven RaggedShard group) counted as
    `_reduce_scatter_base_`: a bucket's reduce is one of the two."""
    counts = dict(counts)
    listed = counts.pop("reduce_scatter_", 0)
    if listed:
        counts["_reduce_scatter_base_"] = counts.get("_reduce_scatter_base_", 0) + listed
    return counts
