"""Where a bucket gathers: `BucketSpec("X.*")` gathers in X's forward, as FSDP2's
`fully_shard(X)` does, even when all of X's params sit in one child, so X's own
code may read its children's params (here an orthogonality penalty on a child's
weight, troubleshooting.md's pattern), and a wrapper X whose forward checkpoints
its child recomputes with the gathered params. Trains as one process does (SGD)."""

from __future__ import annotations

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import flexshard as fs
from compile_check import compiled_graph_calls, counting_backend
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


class Checkpointed(nn.Module):
    """A hand-made activation-checkpoint wrapper (not torch's checkpoint_wrapper)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    @property
    def aux(self):
        return self.block.aux

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def model(wrapped: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [Block(), Block()]
    return nn.Sequential(*(Checkpointed(b) if wrapped else b for b in blocks))


def features(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))


def train(rank: int = 0, world: int = 1, wrapped: bool = False, reshard=True,
          compiled: bool = False) -> tuple:
    net = model(wrapped)
    runners, ran = None, []
    if world > 1:
        net = fs.flex_shard(net, buckets=[fs.BucketSpec(f"{i}.*") for i in range(2)],
                            reshard_after_forward=reshard,
                            mp_policy=fs.MixedPrecisionPolicy(param_dtype=torch.float64))
        names = {id(m): n for n, m in net.named_modules()}
        runners = [names[id(h.module)] for h in get_state(net).hooks]
        if compiled:
            torch._dynamo.reset()
            fs.compile(net, fullgraph=True, backend=counting_backend([]))
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in range(STEPS):
        x = features(step, rank) if world > 1 else torch.cat([features(step, r)
                                                             for r in range(WORLD)])
        loss = net(x).square().mean() + 0.01 * sum(b.aux for b in net)
        ran.append(compiled_graph_calls(loss) > 0)
        loss.backward()
        opt.step()
        opt.zero_grad()
    params = fs.full_state_dict(net) if world > 1 else dict(net.state_dict())
    return params, runners, ran


def _rank(wrapped: bool, reshard, compiled: bool = False) -> tuple:
    return train(dist.get_rank(), dist.get_world_size(), wrapped, reshard, compiled)


def _all(cases) -> list:
    return [_rank(*case) for case in cases]


CASES = [(False, True), (True, True), (True, False), (False, True, True)]


def test_a_block_reading_its_childs_param_gathers_in_the_block():
    """Plain blocks, and blocks wrapped in a checkpointing module (resharding after
    forward or not): the wrapper's recompute runs the child without the bucket's
    hooks, with the params the wrapper gathered (in float64, as forward computed).
    Plain blocks under fs.compile too, its graph run at every step."""
    for i, ranks in enumerate(zip(*run_world(WORLD, _all, CASES, timeout=300))):
        ref, _, _ = train(wrapped=CASES[i][0])
        for params, runners, ran in ranks:
            assert runners == ["0", "1"], CASES[i]
            assert all(ran) == (len(CASES[i]) > 2), (CASES[i], ran)
            for k, want in ref.items():
                torch.testing.assert_close(params[k], want.to(params[k].dtype), rtol=1e-5,
                                           atol=1e-6, msg=f"{CASES[i]} {k}")
