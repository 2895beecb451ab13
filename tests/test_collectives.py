"""flexshard.collectives: uneven shard/gather/reduce-scatter with autograd,
values and gradients against single-process autograd, empty pieces included."""

from __future__ import annotations

import pytest
import torch

from flexshard.collectives import FullGrad, gather_tensor, reduce_scatter_tensor, shard_tensor
from harness import expect_all_ranks_raise, run_world

pytestmark = pytest.mark.world

CASES = [((2, 0, 3), 1), ((0, 4), 0), ((1, 1, 0), 0)]  # (sizes, dim): empty pieces everywhere


def _data(sizes, dim, world):
    """Deterministic tensors: a whole tensor, and per-rank weights shaped as the whole / pieces."""
    g = torch.Generator().manual_seed(7)
    shape = [3, 4]
    if sizes is None:  # a replicated tensor: no pieces
        sizes = [3] * world
    shape[dim] = sum(sizes)
    piece_shape = lambda r: [s if d != dim else sizes[r] for d, s in enumerate(shape)]  # noqa: E731
    whole = torch.randn(shape, generator=g)
    per_rank = [torch.randn(shape, generator=g) for _ in range(world)]  # rank-specific inputs
    whole_w = [torch.randn(shape, generator=g) for _ in range(world)]  # rank-specific loss weights
    piece_w = [torch.randn(piece_shape(r), generator=g) for r in range(world)]
    return whole, per_rank, whole_w, piece_w


def _body(op, sizes, dim, full_grad):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    whole, per_rank, whole_w, piece_w = _data(sizes, dim, world)
    if op == "shard":
        x = whole.clone().requires_grad_()
        out = shard_tensor(x, sizes, dim, full_grad=full_grad)
        (out * piece_w[rank]).sum().backward()
    elif op == "gather":
        x = whole.narrow(dim, sum(sizes[:rank]), sizes[rank]).clone().requires_grad_()
        out = gather_tensor(x, sizes, dim, full_grad=full_grad)
        w = whole_w[0] if full_grad is FullGrad.REPLICATE else whole_w[rank]
        (out * w).sum().backward()
    else:
        x = per_rank[rank].clone().requires_grad_()
        out = reduce_scatter_tensor(x, sizes, dim, full_grad=full_grad)
        w = piece_w[rank] if sizes is not None else (
            whole_w[0] if full_grad is FullGrad.REPLICATE else whole_w[rank])
        (out * w).sum().backward()
    return out.detach(), x.grad


def _reference(op, sizes, dim, full_grad, world):
    """Per rank (output, input grad) from one process holding every rank's tensors."""
    whole, per_rank, whole_w, piece_w = _data(sizes, dim, world)
    if op == "shard":
        x = whole.clone().requires_grad_()
        pieces = x.split(list(sizes), dim)
        sum((p * w).sum() for p, w in zip(pieces, piece_w)).backward()
        grads = [x.grad] * world
        if full_grad is FullGrad.PARTIAL:  # rank r's summand: its own slice only
            grads = [_pad_like(x, x.grad, sizes, dim, r) for r in range(world)]
        return [(p.detach(), g) for p, g in zip(pieces, grads)]
    if op == "gather":
        xs = [p.clone().requires_grad_() for p in whole.split(list(sizes), dim)]
        full = torch.cat(xs, dim)
        ws = whole_w[:1] if full_grad is FullGrad.REPLICATE else whole_w
        sum((full * w).sum() for w in ws).backward()
        return [(full.detach(), x.grad) for x in xs]
    xs = [t.clone().requires_grad_() for t in per_rank]
    total = sum(xs)
    if sizes is None:
        ws = whole_w[:1] if full_grad is FullGrad.REPLICATE else whole_w
        sum((total * w).sum() for w in ws).backward()
        return [(total.detach(), x.grad) for x in xs]
    pieces = total.split(list(sizes), dim)
    sum((p * w).sum() for p, w in zip(pieces, piece_w)).backward()
    return [(p.detach(), x.grad) for p, x in zip(pieces, xs)]


def _pad_like(x, piece, sizes, dim, r):
    out = torch.zeros_like(x)
    out.narrow(dim, sum(sizes[:r]), sizes[r]).copy_(piece.narrow(dim, sum(sizes[:r]), sizes[r]))
    return out


def _compare(op, sizes, dim, full_grad):
    world = len(sizes) if sizes is not None else 2
    got = run_world(world, _body, op, sizes, dim, full_grad)
    want = _reference(op, sizes, dim, full_grad, world)
    for r, ((out, grad), (ref_out, ref_grad)) in enumerate(zip(got, want)):
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6, msg=f"rank {r} value")
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6, msg=f"rank {r} grad")


@pytest.mark.parametrize("full_grad", list(FullGrad))
@pytest.mark.parametrize("sizes,dim", CASES)
@pytest.mark.parametrize("op", ["shard", "gather"])
def test_shard_and_gather(op, sizes, dim, full_grad):
    _compare(op, sizes, dim, full_grad)


@pytest.mark.parametrize("sizes,dim", CASES)
def test_reduce_scatter(sizes, dim):
    _compare("reduce_scatter", sizes, dim, FullGrad.REPLICATE)


@pytest.mark.parametrize("full_grad", list(FullGrad))
def test_replicated_sizes_none(full_grad):
    _compare("reduce_scatter", None, 0, full_grad)  # an all-reduce
    got = run_world(2, _replicated_identity)
    assert all(got)


def _replicated_identity():
    x = torch.randn(3, 2)
    return shard_tensor(x, None) is x and gather_tensor(x, None) is x


def _all_empty():
    x = torch.zeros(0, 3, requires_grad=True)
    out = gather_tensor(x, [0, 0], full_grad=FullGrad.PARTIAL)
    out.sum().backward()
    return tuple(out.shape), tuple(x.grad.shape)


def test_all_pieces_empty():
    assert run_world(2, _all_empty) == [((0, 3), (0, 3))] * 2


def _sum_mismatch():
    shard_tensor(torch.zeros(5, 2), [2, 2])


def _piece_mismatch():
    gather_tensor(torch.zeros(3, 2), [1, 1])


def test_errors_on_every_rank_before_any_collective():
    expect_all_ranks_raise(2, _sum_mismatch, ValueError,
                           r"shard_tensor: the tensor has 5 rows along dim 0 but sum\(sizes\) is 4")
    expect_all_ranks_raise(2, _piece_mismatch, ValueError,
                           r"gather_tensor: the tensor has 3 rows .* "
                           r"sizes\[\d\] \(this rank\) is 1")


def test_bad_arguments_single_process():
    x = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"sizes=\[2, 2\] must hold one int >= 0 per rank "
                                         r"of the group \(1 ranks\)"):
        shard_tensor(x, [2, 2])
    with pytest.raises(ValueError, match=r"sizes=\[-4\] must hold one int >= 0"):
        reduce_scatter_tensor(x, [-4])
    with pytest.raises(ValueError, match="dim=2 is out of range for a tensor of shape"):
        gather_tensor(x, [4], dim=2)
    with pytest.raises(TypeError, match="full_grad must be a fs.collectives.FullGrad"):
        gather_tensor(x, [4], full_grad="partial")
    with pytest.raises(TypeError, match="expected a tensor"):
        shard_tensor([1, 2], [2])


def test_world_of_one_without_process_group():
    x = torch.randn(4, 3, requires_grad=True)
    y = gather_tensor(shard_tensor(x, [4]), [4])
    y.sum().backward()
    torch.testing.assert_close(y, x)
    torch.testing.assert_close(x.grad, torch.ones(4, 3))
