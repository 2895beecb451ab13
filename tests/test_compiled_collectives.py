"""Every activation collective runs inside a torch.compile'd region with no graph
break and no recompile, and gives eager's values and gradients (gloo, aot_eager:
the graph, not inductor's kernels, is what the first test checks); a block of them
compiles with inductor too."""

from __future__ import annotations

import torch
import torch.distributed as dist

import flexshard as fs
from flexshard.compat import TRACES_COLLECTIVE_FUNCTIONS
from flexshard.collectives import HaloPlan, halo_exchange
from compile_check import compiled_graph_calls
from harness import run_world

C = fs.collectives
BIG = 1 << 18  # rows of 4 bytes: a 1 MiB piece, where gloo's rooted gather would run eagerly


def collectives(world: int, rank: int) -> dict:
    """name -> (function of x, shape of this rank's x): uneven sizes, an empty rank at 3."""
    sizes = [2, 0, 3] if world == 3 else [3] + [1] * (world - 1)  # uneven, an empty rank
    n = sum(sizes)
    plan = HaloPlan.from_edges(torch.tensor([[0, n - 1, 1], [n - 1, 0, 2]]), sizes)
    return {
        "shard_tensor": (lambda x: C.shard_tensor(x, sizes, 0), (n, 2)),
        "gather_tensor": (lambda x: C.gather_tensor(x, sizes, 0), (sizes[rank], 2)),
        "gather_tensor_1MiB": (lambda x: C.gather_tensor(x, [BIG] * world, 0), (BIG,)),
        "reduce_scatter_tensor": (lambda x: C.reduce_scatter_tensor(x, sizes, 0), (n, 2)),
        "all_reduce": (lambda x: C.reduce_scatter_tensor(x, None), (n, 2)),
        "all_reduce_grad": (lambda x: C.all_reduce_grad(x), (n, 2)),
        "all_to_all": (lambda x: C.all_to_all(x, sizes, 0, [2] * world, 1), (n, 2)),
        "halo_exchange": (lambda x: halo_exchange(x, plan), (sizes[rank], 2)),
        "halo_exchange_with_local": (lambda x: halo_exchange(x, plan, include_local=True),
                                     (sizes[rank], 2)),
    }


def compiled_against_eager() -> dict:
    """Rank body: per collective, (values equal, grads equal, graph breaks, graphs
    compiled after two calls)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (fn, shape) in collectives(world, rank).items():
        torch._dynamo.reset()
        counters.clear()
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        compiled = torch.compile(lambda t: fn(t * 2.0).sin(), backend="aot_eager",
                                 fullgraph=TRACES_COLLECTIVE_FUNCTIONS)
        got = compiled(x)
        ran = compiled_graph_calls(got)  # the call ran its graph
        got.sum().backward()
        got_grad, x.grad = x.grad, None
        compiled(x)  # a second call: no recompile
        want = fn(x * 2.0).sin()
        want.sum().backward()
        out[name] = (torch.equal(got, want), torch.equal(got_grad, x.grad),
                     sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
                     ran)
    return out


def test_every_collective_compiles_without_a_graph_break_and_matches_eager():
    # 3 ranks: uneven sizes with an empty rank (2 ranks compile the same graphs)
    for results in run_world(3, compiled_against_eager, timeout=300):
        assert len(results) == 9
        for name, (values, grads, breaks, graphs, ran) in results.items():
            assert values and grads, f"{name}: compiled differs from eager"
            if not TRACES_COLLECTIVE_FUNCTIONS:  # torch < 2.13: the collective runs eagerly
                assert breaks >= 1 and ran >= 1, f"{name}: {breaks} breaks, {ran} graphs ran"
                continue
            assert ran == 1, f"{name}: the call ran {ran} compiled graphs"
            assert breaks == 0, f"{name}: {breaks} graph break(s)"
            assert graphs == 1, f"{name}: {graphs} graphs compiled over two calls"


def block_under_inductor() -> tuple:
    """Rank body: a domain-parallel block (halo exchange, gather, all-to-all) compiled
    with inductor, the default backend users get: (values equal eager's, grads equal
    eager's, graph breaks, graphs)."""
    from torch._dynamo.utils import counters

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [2, 0, 3]
    plan = HaloPlan.from_edges(torch.tensor([[0, 4, 1, 3], [4, 0, 2, 1]]), sizes)

    def block(x):
        rows = halo_exchange(x, plan, include_local=True).sin()[:sizes[rank]]
        whole = C.gather_tensor(rows * x, sizes, 0)
        return C.all_to_all(whole[:, 2 * rank:2 * rank + 2], sizes, 0, [2] * world, 1)

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(sizes[rank], 2 * world, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    got = torch.compile(block, fullgraph=TRACES_COLLECTIVE_FUNCTIONS)(x)
    ran = compiled_graph_calls(got)
    got.sum().backward()
    got_grad, x.grad = x.grad, None
    want = block(x)
    want.sum().backward()
    return (torch.allclose(got, want, rtol=1e-6, atol=1e-6),
            torch.allclose(got_grad, x.grad, rtol=1e-6, atol=1e-6),
            sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], ran)


def test_a_block_of_collectives_compiles_with_inductor_and_matches_eager():
    for values, grads, breaks, graphs, ran in run_world(3, block_under_inductor, timeout=300):
        assert values and grads and ran >= 1
        if TRACES_COLLECTIVE_FUNCTIONS:  # before torch 2.13 each collective runs eagerly
            assert breaks == 0 and graphs == 1 and ran == 1


def _compiled_wrong_piece():
    """Every rank's piece a row short of its size: compiled, the piece check runs
    while tracing (the cross-rank check is left out of graphs)."""
    import torch._dynamo

    torch._dynamo.reset()
    fn = torch.compile(lambda x: C.gather_tensor(x * 2.0, [2, 2]), backend="aot_eager")
    fn(torch.zeros(1, 3))


def test_a_wrong_piece_is_refused_while_tracing():
    from harness import expect_all_ranks_raise

    expect_all_ranks_raise(2, _compiled_wrong_piece, ValueError,
                           r"gather_tensor: the tensor on rank \d has 1 rows along dim 0 but "
                           r"sizes\[\d\] is 2")
