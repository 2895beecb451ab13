"""Shared pieces of the checkpoint tests: test-local placements, a training
loop for rank bodies, and a reference whose world size changes mid-run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flexshard as fs
from models import batch, loss_fn
from reference import make_model

LR = 1e-2


@dataclass(frozen=True)
class OnOneRank(fs.Placement):
    """The whole tensor on one rank (the least loaded when bound), nothing
    elsewhere: an uneven layout that no DTensor placement describes."""

    owner: int = -1

    def check(self, shape, world_size) -> None:
        if len(shape) == 0:
            raise ValueError("OnOneRank needs at least one dim")

    def bind(self, shape, itemsize, world_size, rank_bytes) -> "OnOneRank":
        if self.owner >= 0:
            return OnOneRank(self.owner % world_size)
        return OnOneRank(min(range(world_size), key=lambda r: (rank_bytes[r], r)))

    def local_shape(self, shape, rank, world_size) -> torch.Size:
        return torch.Size(shape) if rank == self.owner else torch.Size((0, *shape[1:]))

    def shard(self, full, rank, world_size) -> torch.Tensor:
        return full if rank == self.owner else full.narrow(0, 0, 0)

    def unshard(self, pieces, shape) -> torch.Tensor:
        return pieces[self.owner].clone()

    def rank_major(self, shape) -> bool:
        return True


@dataclass(frozen=True)
class FlatRange(fs.Placement):
    """torch.chunk of the flattened tensor: a rank's piece is 1-D and may
    start and end mid-row, so it covers several boxes of the full tensor."""

    def check(self, shape, world_size) -> None:
        pass

    def bind(self, shape, itemsize, world_size, rank_bytes) -> "FlatRange":
        return self

    def _bounds(self, numel, rank, world_size):
        chunk = -(-numel // world_size)
        start = min(numel, rank * chunk)
        return start, min(numel, start + chunk) - start

    def local_shape(self, shape, rank, world_size) -> torch.Size:
        return torch.Size((self._bounds(torch.Size(shape).numel(), rank, world_size)[1],))

    def shard(self, full, rank, world_size) -> torch.Tensor:
        start, length = self._bounds(full.numel(), rank, world_size)
        return full.reshape(-1).narrow(0, start, length)

    def unshard(self, pieces, shape) -> torch.Tensor:
        return torch.cat([p.reshape(-1) for p in pieces]).view(shape)

    def rank_major(self, shape) -> bool:
        return True


def mixed_uneven(fqn, param):
    """FlatRange for matrices, OnOneRank for the rest: every piece uneven."""
    return FlatRange() if param.dim() > 1 else OnOneRank()


def shard1(fqn, param):
    return fs.Shard(1) if param.dim() > 1 else fs.Shard(0)


PLACEMENTS = {"shard0": fs.Shard(0), "shard1": shard1, "ragged": fs.RaggedShard(),
              "owned": fs.Owned(), "uneven": mixed_uneven}


def train(model, opt, steps, rank: int) -> list:
    """Train `model` on this rank's batches of `steps`; the losses."""
    losses = []
    for step in steps:
        x, y = batch(step, rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def wrapped(placement_name: str, seed: int = 0, **kw):
    """A fresh TinyGPT wrapped with one of PLACEMENTS, and its AdamW."""
    model = fs.flex_shard(make_model(seed, **kw), placement=PLACEMENTS[placement_name])
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def reference(worlds: list, lr: float = LR) -> tuple:
    """Single process: step s trains on the batches of ranks < worlds[s].
    Returns (full params, AdamW state by FQN)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers: same kernels, same rounding
    try:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        for step, world in enumerate(worlds):
            xs, ys = zip(*(batch(step, r) for r in range(world)))
            loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    names = {id(p): k for k, p in model.named_parameters()}
    optim_state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return {k: v.detach().clone() for k, v in model.named_parameters()}, optim_state


def assert_rel_close(actual, expected, rel, name) -> None:
    """Norm-wise relative error (as tests/test_parity.py)."""
    err = ((actual.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err <= rel, f"{name}: relative error {err:.3g} > {rel:g}"
