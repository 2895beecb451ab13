"""Property tests of fs.collectives at 2 to 4 ranks: random uneven sizes with
zeros, random shapes and dims, every collective and FullGrad.

- values and gradients match one process that holds every rank's tensors
  (float64, so only summation order differs);
- torch.autograd.gradcheck (float64) of each collective wrapped into a
  function that is the same on every rank, and of that function's gradient
  (second derivatives, as a gradient penalty takes them): rank-specific pieces enter through
  `shard_tensor` and leave through `gather_tensor` / an all-reduce, so every
  rank perturbs the same inputs and runs the same backward passes in step.

Hypothesis draws in the test process; each example runs in the one persistent
world of its size (tests/harness.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexshard.collectives import (FullGrad, all_reduce_grad, all_to_all, gather_tensor,
                                   reduce_scatter_tensor, shard_tensor)
from harness import run_world

pytestmark = pytest.mark.world

OPS = ["all_to_all", "shard", "gather", "reduce_scatter", "all_reduce", "all_reduce_grad"]
WORLDS = [2, 3, 4]


@st.composite
def cases(draw, world, max_rows=3, max_width=3):
    """One collective call: op, FullGrad, sizes per rank, dims, other dims, seed."""
    op = draw(st.sampled_from(OPS))
    ndim = draw(st.integers(2, 3))
    sizes = st.lists(st.integers(0, max_rows), min_size=world, max_size=world)
    dims = draw(st.permutations(range(ndim)))
    return dict(op=op, full_grad=draw(st.sampled_from(list(FullGrad))), world=world,
                sizes=tuple(draw(sizes)), other_sizes=tuple(draw(sizes)),
                dim=dims[0], other_dim=dims[1],
                shape=[draw(st.integers(1, max_width)) for _ in range(ndim)],
                seed=draw(st.integers(0, 2**16)))


def _global_shape(case):
    """The whole tensor: sum(sizes) along dim, sum(other_sizes) along other_dim."""
    shape = list(case["shape"])
    shape[case["dim"]] = sum(case["sizes"])
    if case["op"] == "all_to_all":
        shape[case["other_dim"]] = sum(case["other_sizes"])
    return shape


def _piece(t, sizes, dim, r):
    return t.narrow(dim, sum(sizes[:r]), sizes[r])


def _data(case):
    """(whole, per-rank whole tensors, per-rank loss weights shaped as the rank's output)."""
    g = torch.Generator().manual_seed(case["seed"])
    shape, world = _global_shape(case), case["world"]
    whole = torch.randn(shape, generator=g, dtype=torch.float64)
    per_rank = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]
    weights = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(world)]
    op, sizes, dim = case["op"], case["sizes"], case["dim"]
    if op in ("all_to_all", "shard", "reduce_scatter"):  # sharded outputs
        weights = [_piece(w, sizes, dim, r) for r, w in enumerate(weights)]
    replicated_out = op in ("gather", "all_reduce") and case["full_grad"] is FullGrad.REPLICATE
    if replicated_out:  # one logical tensor: every rank weighs it the same
        weights = [weights[0]] * world
    return whole, per_rank, weights


# ------------------------------------------------------------------ the ranks


def _run(case, x, check_sizes=True):
    op, sizes, dim, fg = case["op"], case["sizes"], case["dim"], case["full_grad"]
    kw = dict(check_sizes=check_sizes)
    if op == "all_to_all":
        return all_to_all(x, sizes, dim, case["other_sizes"], case["other_dim"], **kw)
    if op == "shard":
        return shard_tensor(x, sizes, dim, full_grad=fg, **kw)
    if op == "gather":
        return gather_tensor(x, sizes, dim, full_grad=fg, **kw)
    if op == "reduce_scatter":
        return reduce_scatter_tensor(x, sizes, dim, **kw)
    if op == "all_reduce":
        return reduce_scatter_tensor(x, None, full_grad=fg, **kw)
    return all_reduce_grad(x, **kw)


def _rank_input(case, rank, whole, per_rank):
    op = case["op"]
    if op == "all_to_all":
        return _piece(whole, case["other_sizes"], case["other_dim"], rank)
    if op == "gather":
        return _piece(whole, case["sizes"], case["dim"], rank)
    if op in ("reduce_scatter", "all_reduce"):
        return per_rank[rank]
    return whole  # shard, all_reduce_grad: a replicated input


def _body(case):
    import torch.distributed as dist

    rank = dist.get_rank()
    whole, per_rank, weights = _data(case)
    x = _rank_input(case, rank, whole, per_rank).clone().requires_grad_()
    out = _run(case, x)
    (out * weights[rank]).sum().backward()
    return out.detach(), x.grad


# ------------------------------------------------------------------ one process


def _reference(case):
    """Per rank (output, input grad), computed from every rank's tensors at once."""
    op, sizes, dim, world = case["op"], case["sizes"], case["dim"], case["world"]
    whole, per_rank, weights = _data(case)
    if op in ("shard", "all_reduce_grad"):  # a replicated input
        x = whole.clone().requires_grad_()
        outs = list(x.split(list(sizes), dim)) if op == "shard" else [x] * world
        losses = [(o * w).sum() for o, w in zip(outs, weights)]
        if case["full_grad"] is FullGrad.PARTIAL and op == "shard":  # rank r's summand
            grads = [torch.autograd.grad(l, x)[0] for l in losses]
        else:  # the whole gradient on every rank
            grads = [torch.autograd.grad(sum(losses), x)[0]] * world
        return [(o.detach(), g) for o, g in zip(outs, grads)]
    xs = [_rank_input(case, r, whole, per_rank).clone().requires_grad_() for r in range(world)]
    outs = _global_outputs(case, xs)
    if op in ("gather", "all_reduce") and case["full_grad"] is FullGrad.REPLICATE:
        loss = (outs[0] * weights[0]).sum()  # one logical tensor, counted once
    else:
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, xs, allow_unused=True)
    return [(o.detach(), g) for o, g in zip(outs, grads)]


def _global_outputs(case, xs):
    op, sizes, dim = case["op"], case["sizes"], case["dim"]
    if op == "all_to_all":
        return list(torch.cat(xs, case["other_dim"]).split(list(sizes), dim))
    if op == "gather":
        return [torch.cat(xs, dim)] * len(xs)
    total = sum(xs)
    return list(total.split(list(sizes), dim)) if op == "reduce_scatter" else [total] * len(xs)


def _check(case):
    got, want = run_world(case["world"], _body, case), _reference(case)
    for r, ((out, grad), (ref_out, ref_grad)) in enumerate(zip(got, want)):
        where = f"rank {r} of {case}"
        torch.testing.assert_close(out, ref_out, msg=lambda m, w=where: f"{w} value: {m}")
        torch.testing.assert_close(grad, ref_grad, msg=lambda m, w=where: f"{w} grad: {m}")


@pytest.mark.parametrize("world", WORLDS)
def test_matches_one_process(world):
    @settings(max_examples=25, deadline=None)
    @given(case=cases(world))
    def check(case):
        _check(case)

    check()


# ------------------------------------------------------------------ gradcheck


def _same_everywhere(case):
    """The collective wrapped into a function of one tensor that is the same on
    every rank (see the module docstring); float64, size checks off."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    op, sizes, dim, fg = case["op"], case["sizes"], case["dim"], case["full_grad"]
    kw = dict(check_sizes=False)
    share = (rank + 1) / (world * (world + 1) / 2)  # sums to 1 over the ranks
    out_sizes, out_dim = sizes, dim

    def enter(t):
        if op == "all_to_all":
            return shard_tensor(t, case["other_sizes"], case["other_dim"], **kw)
        if op == "gather":
            return shard_tensor(t, sizes, dim, **kw)
        if op in ("reduce_scatter", "all_reduce"):  # t stacks one whole tensor per rank
            return shard_tensor(t, [1] * world, 0, **kw).squeeze(0)
        if op == "shard" and fg is FullGrad.PARTIAL:
            return all_reduce_grad(t, **kw)  # its summand gradients are summed here
        return t

    def leave(y):
        if op in ("all_to_all", "shard", "reduce_scatter"):  # pieces
            return gather_tensor(y, out_sizes, out_dim, **kw)
        if op == "all_reduce_grad" or fg is FullGrad.PARTIAL:  # summand gradients
            return reduce_scatter_tensor(y * share, None, **kw)
        return y  # a replicated tensor with replicated gradient

    # A replicated output with a replicated gradient must stay the same on every rank.
    factor = 1 if op in ("gather", "all_reduce") and fg is FullGrad.REPLICATE else rank + 1

    def fn(t):
        return leave(torch.sin(_run(case, enter(t), check_sizes=False)) * factor)

    shape = _global_shape(case)
    if op in ("reduce_scatter", "all_reduce"):
        shape = [world, *shape]
    t = torch.randn(shape, generator=torch.Generator().manual_seed(case["seed"]),
                    dtype=torch.float64, requires_grad=True)
    # The second derivative along a fixed direction (a gradient penalty's): the
    # gradient of fn as a function of t, which is the same on every rank too.
    # (gradgradcheck would also perturb the output's gradient, which each rank
    # reads in its own part only.)
    direction = torch.randn(fn(t).shape, generator=torch.Generator().manual_seed(case["seed"]),
                            dtype=torch.float64)

    def grad_of_fn(t):
        return torch.autograd.grad(fn(t), t, direction, create_graph=True)[0]

    return torch.autograd.gradcheck(fn, (t,)) and torch.autograd.gradcheck(grad_of_fn, (t,))


@pytest.mark.parametrize("world", WORLDS)
def test_gradcheck(world):
    @settings(max_examples=12, deadline=None)
    @given(case=cases(world, max_rows=2, max_width=2))
    def check(case):
        assert run_world(world, _same_everywhere, case) == [True] * world

    check()
