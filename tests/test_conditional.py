"""Conditional computation: params that some ranks, or no rank, use in a step,
and params used twice, train exactly as one process would.

The model routes each row to one of four experts (each expert its own bucket):
- expert 0 gets rows on every rank and runs twice per step (used twice);
- expert 1 gets rows on rank 0 only: the other ranks run it on zero rows;
- expert 2 gets rows on no rank and is not run at all (as a MoE skips an
  expert no rank routed a token to): its grads stay None, as unsharded;
- expert 3 gets rows on the last rank at even steps and is not run at odd steps.
The root bucket's `inp` runs twice too. The reference runs every rank's rows
in one process with the same routing; AdamW with weight decay tells a None
grad (skipped) from a zero one (decayed), so the optimizer must see what it
sees unsharded. First-step grads are compared as well.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flexshard as fs
from harness import run_world
from training_helpers import full_grads

DIM, HID, OUT, ROWS, STEPS = 16, 24, 5, 6, 4
PLACEMENTS = {"shard": fs.Shard(0), "ragged": fs.RaggedShard(), "owned": fs.Owned()}


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, HID), nn.Linear(HID, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(Expert() for _ in range(4))
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor, route: torch.Tensor, skip: frozenset) -> torch.Tensor:
        h = self.inp(x)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            if e in skip:  # no rank routed a row here: the expert does not run
                continue
            rows = (route == e).nonzero().squeeze(1)  # may be empty on this rank
            z = expert(h[rows])
            if e == 0:
                z = expert(z)  # used twice
            y = y.index_add(0, rows, z)
        return self.out(self.inp(y) + h)  # inp used twice


def routing(step: int, rank: int, world: int) -> tuple:
    """(route per row, experts no rank runs) for `rank`'s rows at `step`."""
    route = torch.zeros(ROWS, dtype=torch.long)
    if rank == 0:
        route[ROWS // 2:] = 1
    if rank == world - 1 and step % 2 == 0:
        route[-1] = 3
    skip = frozenset({2} if step % 2 == 0 else {2, 3})
    return route, skip


def data(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(ROWS, DIM, generator=g), torch.randint(0, OUT, (ROWS,), generator=g)


def make_model() -> Routed:
    torch.manual_seed(0)
    return Routed()


def buckets(placement) -> list:
    return ([fs.BucketSpec(f"experts.{e}.*", placement=placement) for e in range(4)]
            + [fs.BucketSpec(["inp.*", "out.*"], placement=placement)])


def reference(world: int) -> tuple:
    """One process on every rank's rows: (losses, first grads, final params)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers: same kernels
    try:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses, first = [], None
        for step in range(STEPS):
            loss = 0.0
            for rank in range(world):  # the mean of the ranks' mean losses
                x, y = data(step, rank)
                route, skip = routing(step, rank, world)
                loss = loss + F.cross_entropy(model(x, route, skip), y) / world
            loss.backward()
            if first is None:
                first = {k: None if p.grad is None else p.grad.clone()
                         for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return losses, first, {k: p.detach().clone() for k, p in model.named_parameters()}


def sharded(placement_name: str, reshard) -> tuple:
    """Rank body: the same training under flex_shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = fs.flex_shard(make_model(), buckets=buckets(PLACEMENTS[placement_name]),
                          reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, first = [], None
    for step in range(STEPS):
        x, y = data(step, rank)
        route, skip = routing(step, rank, world)
        loss = F.cross_entropy(model(x, route, skip), y)
        loss.backward()
        if first is None:
            first = full_grads(model)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses, first, fs.full_state_dict(model)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_unused_and_twice_used_params_train_as_one_process(world, reshard, placement):
    ref_losses, ref_first, ref_params = reference(world)
    assert ref_first["experts.2.w1.weight"] is None  # the matrix covers a None grad
    assert ref_first["experts.1.w1.weight"].abs().sum() > 0
    for losses, first, params in run_world(world, sharded, placement, reshard):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        assert first.keys() == ref_first.keys()
        for k, want in ref_first.items():
            if want is None:
                assert first[k] is None, f"{k}: no rank used it, so its grad must stay None"
            else:
                torch.testing.assert_close(first[k], want, rtol=1e-5, atol=1e-7, msg=k)
        for k, want in ref_params.items():
            torch.testing.assert_close(params[k], want, rtol=1e-5, atol=1e-6, msg=k)


class WithSpare(Routed):
    """Routed with a param in the root bucket (which runs) that no rank uses."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(DIM, DIM)


def spare_grads(placement_name: str) -> tuple:
    """Rank body: one step of WithSpare; the full grads of `spare` and of `inp`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = fs.flex_shard(WithSpare(), placement=PLACEMENTS[placement_name], buckets=[
        *(fs.BucketSpec(f"experts.{e}.*") for e in range(4)),
        fs.BucketSpec(["inp.*", "out.*", "spare.*"])])
    x, y = data(0, rank)
    route, skip = routing(0, rank, world)
    F.cross_entropy(model(x, route, skip), y).backward()
    grads = full_grads(model)
    return grads["spare.weight"], grads["experts.2.w1.weight"], grads["inp.weight"]


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_a_param_no_rank_used_in_a_bucket_that_ran_gets_a_zero_grad(placement):
    """As FSDP2 with set_reduce_scatter_unused_params(True): the bucket's one
    reduce-scatter carries zeros for it (docs/placements-and-buckets.md says so);
    a bucket whose module ran on no rank keeps None grads."""
    for spare, skipped, used in run_world(2, spare_grads, placement):
        assert spare is not None and torch.count_nonzero(spare) == 0
        assert skipped is None
        assert used is not None and torch.count_nonzero(used) > 0
