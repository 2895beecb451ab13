"""fs.collectives.halo_exchange and HaloPlan: the rows a single process would pick,
the exact adjoint in backward, uneven and empty partitions, errors before any
collective, and the example's message passing matching one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexshard as fs
from flexshard.collectives import HaloPlan, halo_exchange
from example_loader import load_example
from harness import expect_all_ranks_raise, run_world

WORLD = 3


def exchange_case(sizes: tuple, edges: list, explicit: bool, include_local: bool) -> tuple:
    """Rank body: the halo of the global features' own rows, from a plan made from
    the edges (or from the send lists that plan derived); and x's gradient for a
    fixed weight on the halo. With `include_local` the exchange returns x's rows
    then the halo, and the gradient through x's own rows is taken off."""
    rank = dist.get_rank()
    edge_index = torch.tensor(edges, dtype=torch.long).reshape(2, -1)
    plan = HaloPlan.from_edges(edge_index, sizes)
    if explicit:
        plan = HaloPlan.from_send_index([t.tolist() for t in plan.send_index], sizes)
    full = torch.arange(sum(sizes) * 2, dtype=torch.float64).reshape(-1, 2)
    start = sum(sizes[:rank])
    x = full[start:start + sizes[rank]].clone().requires_grad_(True)
    out = halo_exchange(x, plan, include_local=include_local)
    weight = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape) + rank
    (out * weight).sum().backward()
    local = sizes[rank] if include_local else 0
    assert torch.equal(out[:local], x[:local])
    grad = x.grad - weight[:local] if include_local else x.grad  # the halo's part of it
    return out[local:].detach(), torch.cat(plan.recv_ids), grad, weight[local:]


def _edges(draw_sizes, data):
    nodes = sum(draw_sizes)
    count = data.draw(st.integers(0, 12))
    ids = st.integers(0, nodes - 1)
    return [data.draw(ids) for _ in range(count)] + [data.draw(ids) for _ in range(count)]


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=st.tuples(*[st.integers(0, 5)] * WORLD).filter(lambda s: sum(s) > 0),
       explicit=st.booleans(), include_local=st.booleans(), data=st.data())
def test_the_halo_is_the_rows_one_process_would_pick_and_its_grads_add_back(
        sizes, explicit, include_local, data):
    edges = _edges(sizes, data)
    results = run_world(WORLD, exchange_case, sizes, edges, explicit, include_local)
    full = torch.arange(sum(sizes) * 2, dtype=torch.float64).reshape(-1, 2)
    grad_full = torch.zeros_like(full)
    e = torch.tensor(edges, dtype=torch.long).reshape(2, -1)
    starts = [sum(sizes[:r]) for r in range(WORLD)]
    for rank, (halo, ids, _, weight) in enumerate(results):
        mine = (e[1] >= starts[rank]) & (e[1] < starts[rank] + sizes[rank])
        remote = e[0][mine][(e[0][mine] < starts[rank]) | (e[0][mine] >= starts[rank] + sizes[rank])]
        assert ids.tolist() == sorted(set(remote.tolist()))  # every remote source, once
        assert torch.equal(halo, full[ids])
        grad_full.index_add_(0, ids, weight)
    for rank, (_, _, grad, _) in enumerate(results):
        torch.testing.assert_close(grad, grad_full[starts[rank]:starts[rank] + sizes[rank]],
                                   rtol=0, atol=0)


def adjoint_case() -> tuple:
    """Rank body, float64: <halo(x), v> and <x, halo^T(v)> on this rank (their sums
    over the ranks must agree: the backward is the exact adjoint)."""
    rank = dist.get_rank()
    sizes = (2, 0, 5)
    g = torch.Generator().manual_seed(7)
    edges = torch.randint(0, sum(sizes), (2, 20), generator=g)
    plan = HaloPlan.from_edges(edges, sizes)
    x = torch.randn(sizes[rank], 3, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    halo = halo_exchange(x, plan)
    v = torch.randn(halo.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9 + rank))
    (grad,) = torch.autograd.grad(halo, x, v)
    return (halo * v).sum().item(), (x * grad).sum().item()


def test_the_backward_is_the_exact_adjoint():
    pairs = run_world(WORLD, adjoint_case)
    assert sum(a for a, _ in pairs) == pytest.approx(sum(b for _, b in pairs), rel=1e-12)


def gradcheck_case(include_local: bool) -> bool:
    """Rank body: torch.autograd.gradcheck (float64) of one message-passing round
    as a function of the whole graph's features, the same function on every rank:
    the features enter through `shard_tensor` (each rank takes its rows), the halo
    moves through `halo_exchange`, and the nodes' outputs leave through
    `gather_tensor`, so every rank perturbs the same inputs in step."""
    rank = dist.get_rank()
    sizes = (3, 0, 4)  # uneven, an empty rank
    edges = torch.randint(0, sum(sizes), (2, 16), generator=torch.Generator().manual_seed(3))
    plan = HaloPlan.from_edges(edges, sizes)
    start = sum(sizes[:rank])
    mine = (edges[1] >= start) & (edges[1] < start + sizes[rank])
    src, dst = plan.local_index(edges[0][mine]), edges[1][mine] - start
    C = fs.collectives

    def fn(features):
        x = C.shard_tensor(features, list(sizes), 0, check_sizes=False)
        if include_local:
            rows = halo_exchange(x, plan, include_local=True)
        else:
            rows = torch.cat([x, halo_exchange(x, plan)])
        out = torch.zeros_like(x).index_add(0, dst, torch.sin(rows)[src])
        return C.gather_tensor(out * x, list(sizes), 0, check_sizes=False)

    features = torch.randn(sum(sizes), 2, dtype=torch.float64,
                           generator=torch.Generator().manual_seed(5), requires_grad=True)
    return torch.autograd.gradcheck(fn, (features,))


@pytest.mark.parametrize("include_local", [False, True])
def test_gradcheck_of_message_passing_through_the_halo(include_local):
    assert run_world(WORLD, gradcheck_case, include_local) == [True] * WORLD


def _example():
    return load_example("halo_graph")


def example_body() -> tuple:
    loss, grads, _ = _example().run()
    return loss, grads


def test_the_example_matches_one_process():
    loss, grads, _ = _example().run()
    for got_loss, got_grads in run_world(WORLD, example_body):
        assert got_loss == pytest.approx(loss, rel=1e-12)
        for k, want in grads.items():
            torch.testing.assert_close(got_grads[k], want, rtol=1e-12, atol=1e-12, msg=k)


def _disagreeing_sizes():
    sizes = (3, 3, 3) if dist.get_rank() else (4, 2, 3)
    HaloPlan.from_edges(torch.zeros(2, 1, dtype=torch.long), sizes)


def _rows_mismatch():
    plan = HaloPlan.from_edges(torch.tensor([[0], [5]]), (2, 2, 2))
    halo_exchange(torch.zeros(3, 1), plan)


def _one_rank_wrong(kind):
    """Rank 1 alone passes wrong rows, feature width or group: every rank raises."""
    bad = dist.get_rank() == 1
    plan = HaloPlan.from_edges(torch.tensor([[0, 5, 2], [5, 0, 1]]), (2, 2, 2))
    if kind == "rows":
        halo_exchange(torch.zeros(3 if bad else 2, 4), plan)
    elif kind == "no rows":  # a rank without nodes passing None: it hung the others
        halo_exchange(None if bad else torch.zeros(2, 4), plan)
    elif kind == "plan":
        halo_exchange(torch.zeros(2, 4), "plan" if bad else plan)
    elif kind == "width":
        halo_exchange(torch.zeros(2, 5 if bad else 4), plan)
    else:  # the plan of a group of two, used on the group of three
        pair = dist.new_group([1, 2])
        if dist.get_rank():
            plan = HaloPlan.from_edges(torch.tensor([[0], [3]]), (2, 2), pair)
        halo_exchange(torch.zeros(2, 4), plan)


def _plans_disagree(kind):
    """Rank 0 keeps the plan of an older graph (node 0 -> node 2 only, where the
    graph now also has node 1 -> node 2, or node 1 -> node 2 instead: the same
    counts), or each rank builds its plan from the edges into its own nodes
    (check=False: from_edges refuses them)."""
    rank, sizes = dist.get_rank(), (2, 2, 2)
    now = [[0, 1, 5], [2, 2, 0]] if kind == "more" else [[1, 5], [2, 0]]
    if kind == "own edges":
        mine = [(a, b) for a, b in zip(*now) if b // 2 == rank] or [(2 * rank, 2 * rank)]
        plan = HaloPlan.from_edges(torch.tensor(mine).T, sizes, check=False)
    else:
        plan = HaloPlan.from_edges(torch.tensor([[0, 5], [2, 0]] if rank == 0 else now),
                                   sizes, check=False)
    halo_exchange(torch.zeros(2, 4), plan)


def test_plans_that_disagree_on_the_rows_are_refused_on_every_rank():
    """What a rank sends must be what its receiver's plan expects: more rows than
    sent read uninitialised memory, other rows the wrong nodes, silently."""
    for kind in ("more", "same counts", "own edges"):
        expect_all_ranks_raise(WORLD, _plans_disagree, ValueError,
                               r"halo_exchange: the ranks' plans disagree on the rows they "
                               r"exchange .* HaloPlan\.from_send_index", kind)


def test_bad_input_is_refused_on_every_rank_before_the_data_moves():
    expect_all_ranks_raise(WORLD, _disagreeing_sizes, ValueError,
                           r"HaloPlan\.from_edges: sizes differs across the ranks of the group.*"
                           r"the whole graph's edge_index .* HaloPlan\.from_send_index")
    expect_all_ranks_raise(WORLD, _rows_mismatch, ValueError,
                           r"halo_exchange: x has 3 rows on rank \d but the plan gives it 2 nodes")
    expect_all_ranks_raise(WORLD, _one_rank_wrong, ValueError,
                           r"halo_exchange: x has 3 rows on rank 1 but the plan gives it 2 nodes",
                           "rows")
    expect_all_ranks_raise(WORLD, _one_rank_wrong, ValueError,
                           r"halo_exchange: the tensors' shapes outside the sharded dims differ "
                           r"across the ranks of the group \(ranks \[1\] differ from rank 0",
                           "width")
    expect_all_ranks_raise(WORLD, _one_rank_wrong, ValueError,
                           r"halo_exchange: the plan was built for rank 0 of 2 ranks, and this is "
                           r"rank 1 of the 3 of the group given; pass the group the plan was "
                           r"built on", "group")
    expect_all_ranks_raise(WORLD, _one_rank_wrong, TypeError,
                           r"halo_exchange: expected a tensor, got NoneType", "no rows")
    expect_all_ranks_raise(WORLD, _one_rank_wrong, TypeError,
                           r"halo_exchange: plan must be a HaloPlan, got str", "plan")
    with pytest.raises(ValueError, match=r"edge_index holds node ids outside 0\.\.3"):
        HaloPlan.from_edges(torch.tensor([[0], [4]]), (4,))
    with pytest.raises(ValueError, match=r"sizes=\[2, 2\] must hold one int >= 0 per rank"):
        HaloPlan.from_edges(torch.tensor([[0], [1]]), (2, 2))
    with pytest.raises(ValueError, match=r"send_index\[0\] holds rows outside this rank's 0\.\.1"):
        HaloPlan.from_send_index([[2]], (2,))
    with pytest.raises(ValueError, match=r"send_index\[0\] holds row numbers that are not whole"):
        HaloPlan.from_send_index([[0.7]], (2,))  # was sent as row 0
    assert HaloPlan.from_send_index([[1.0]], (2,)).send_index[0].tolist() == [1]
    plan = HaloPlan.from_edges(torch.tensor([[0], [1]]), (2,))
    with pytest.raises(ValueError, match=r"node ids \[5\] are neither rank 0's nor in its halo"):
        plan.local_index(torch.tensor([5]))


def test_one_process_has_no_halo():
    plan = HaloPlan.from_edges(torch.tensor([[0, 1], [1, 0]]), (2,))
    x = torch.randn(2, 3, requires_grad=True)
    halo = halo_exchange(x, plan)
    assert halo.shape == (0, 3)
    assert fs.collectives.halo_exchange is halo_exchange


def _second_derivatives_check(sizes: tuple, edges: list) -> bool:
    """gradcheck of a function the same on every rank (the whole graph's features
    in, every rank's rows with its halo out, gathered) and of its gradient along a
    fixed direction: the exchange's second derivatives, as a gradient penalty
    takes them (float64)."""
    from flexshard.collectives import gather_tensor, shard_tensor

    rank = dist.get_rank()
    plan = HaloPlan.from_edges(torch.tensor(edges, dtype=torch.long).reshape(2, -1), sizes)
    rows = [None] * WORLD
    dist.all_gather_object(rows, sizes[rank] + sum(plan.recv_counts))

    def fn(t):
        x = shard_tensor(t, sizes, check_sizes=False)
        out = halo_exchange(x, plan, include_local=True, check_sizes=False)
        return gather_tensor(torch.sin(out) * (rank + 1), rows, check_sizes=False)

    t = torch.randn(sum(sizes), 2, dtype=torch.float64, requires_grad=True,
                    generator=torch.Generator().manual_seed(0))
    direction = torch.randn(sum(rows), 2, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(1))

    def grad_of_fn(t):
        return torch.autograd.grad(fn(t), t, direction, create_graph=True)[0]

    return torch.autograd.gradcheck(fn, (t,)) and torch.autograd.gradcheck(grad_of_fn, (t,))


def test_second_derivatives():
    edges = [0, 3, 5, 1, 2, 4, 3, 0, 1, 5, 4, 2]  # sources then targets, across every rank
    assert run_world(WORLD, _second_derivatives_check, (2, 1, 3), edges) == [True] * WORLD
