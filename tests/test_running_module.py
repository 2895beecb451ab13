"""Where a bucket gathers: `BucketSpec("X.*")` gathers in X's forward, as FSDP2's
`fully_shard(X)` does, even when all of X's params sit in one child, so X's own
code may read its children's params (here an orthogonality penalty on a child's
weight, troubleshooting.md's pattern). Trains as one process does (SGD)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs
from flexshard.runtime.state import get_state
from harness import run_world

WORLD, STEPS, LR = 2, 3, 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.aux = None

    def forward(self, x):
        w = self.lin.weight  # the child's param, read by the block itself
        self.aux = (w @ w.T - torch.eye(16)).square().sum()
        return torch.tanh(self.lin(x))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def features(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))


def train(rank: int = 0, world: int = 1) -> tuple:
    net = model()
    runners = None
    if world > 1:
        net = fs.flex_shard(net, buckets=[fs.BucketSpec(f"{i}.*") for i in range(2)])
        names = {id(m): n for n, m in net.named_modules()}
        runners = [names[id(h.module)] for h in get_state(net).hooks]
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        x = features(step, rank) if world > 1 else torch.cat([features(step, r)
                                                             for r in range(WORLD)])
        (net(x).square().mean() + 0.01 * sum(b.aux for b in net)).backward()
        opt.step()
        opt.zero_grad()
    params = fs.full_state_dict(net) if world > 1 else dict(net.state_dict())
    return params, runners


def _rank() -> tuple:
    return train(dist.get_rank(), dist.get_world_size())


def test_a_block_reading_its_childs_param_gathers_in_the_block():
    ref, _ = train()
    for params, runners in run_world(WORLD, _rank):
        assert runners == ["0", "1"]
        for k, want in ref.items():
            torch.testing.assert_close(params[k], want, rtol=1e-5, atol=1e-6, msg=k)
