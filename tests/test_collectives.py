"""flexshard.collectives: uneven shard/gather/reduce-scatter with autograd,
values and gradients against single-process autograd, empty pieces included."""

from __future__ import annotations

import re

import pytest
import torch

import flexshard as fs
from flexshard.collectives import (FullGrad, all_reduce_grad, all_to_all, gather_tensor,
                                   reduce_scatter_tensor, shard_tensor)
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


def test_errors_on_every_rank_before_the_data_moves():
    expect_all_ranks_raise(2, _sum_mismatch, ValueError,
                           r"shard_tensor: the tensor has 5 rows along dim 0 but sum\(sizes\) is 4")
    expect_all_ranks_raise(2, _piece_mismatch, ValueError,
                           r"gather_tensor: the tensor on rank 0 has 3 rows along dim 0 but "
                           r"sizes\[0\] is 1; pass sizes that match each rank's tensor")


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
    with pytest.raises(ValueError, match=r"gather_tensor: sizes=5 must be a list of one int >= 0 "
                                         r"per rank of the group \(1 ranks\)"):
        gather_tensor(x, 5)  # was: 'int' object is not iterable


def test_a_0d_tensor_is_all_reduced_whole():
    """sizes=None on a 0-d tensor (a loss): the documented all-reduce; it refused
    with "dim=0 is out of range for a tensor of shape ()"."""
    loss = torch.tensor(3.0, requires_grad=True)
    out = reduce_scatter_tensor(loss, None)
    out.backward()
    assert out.item() == 3.0 and loss.grad.item() == 1.0
    assert gather_tensor(torch.tensor(2.0), None).item() == 2.0


def test_world_of_one_without_process_group():
    x = torch.randn(4, 3, requires_grad=True)
    y = gather_tensor(shard_tensor(x, [4]), [4])
    y.sum().backward()
    torch.testing.assert_close(y, x)
    torch.testing.assert_close(x.grad, torch.ones(4, 3))


# ---- all_to_all and all_reduce_grad (values and gradients: test_collective_properties.py)


class CountingComm(fs.Comm):
    """Counts collectives; `forbid` names kinds that must not run."""

    def __init__(self, forbid=()):
        self.calls, self.forbid = [], set(forbid)

    def _note(self, kind):
        if kind in self.forbid:
            raise AssertionError(f"a {kind} ran before the error")
        self.calls.append(kind)

    def all_gather(self, *args, **kwargs):
        self._note("all_gather")
        return super().all_gather(*args, **kwargs)

    def all_to_all(self, *args, **kwargs):
        self._note("all_to_all")
        return super().all_to_all(*args, **kwargs)

    def all_reduce(self, *args, **kwargs):
        self._note("all_reduce")
        return super().all_reduce(*args, **kwargs)


EVERY = ("all_gather", "all_to_all", "all_reduce")
DATA = ("all_to_all", "all_reduce")  # the size check is an all-gather


def _collectives_issued(check_sizes):
    """Points sharded [3, 1] -> heads sharded [0, 2]; which collectives ran."""
    import torch.distributed as dist

    comm = CountingComm()
    x = torch.randn(4, [3, 1][dist.get_rank()], 2, requires_grad=True)
    y = all_to_all(x, [0, 2], 2, [3, 1], 1, comm=comm, check_sizes=check_sizes)
    y.sum().backward()
    return comm.calls


def test_all_to_all_is_one_collective_each_way():
    assert run_world(2, _collectives_issued, False) == [["all_to_all"] * 2] * 2
    # the size check is one small all-gather before the forward's all-to-all
    assert run_world(2, _collectives_issued, True) == [["all_gather"] + ["all_to_all"] * 2] * 2


def _a2a_local(case):
    """Bad sizes or dims that every rank sees: raised after the size check's small
    all-gather (which carries a refused rank's error to the others), before any data
    moves."""
    import torch.distributed as dist

    x = torch.zeros(4, [2, 3][dist.get_rank()])  # points along dim 1: concat_sizes [2, 3]
    args = {"split sum": ([2, 1], 0, [2, 3], 1), "length": ([1, 1, 2], 0, [2, 3], 1),
            "negative": ([5, -1], 0, [2, 3], 1), "same dim": ([2, 3], 1, [2, 3], 1),
            "dim range": ([2, 2], 2, [2, 3], 1)}[case]
    all_to_all(x, *args, comm=CountingComm(forbid=DATA))


A2A_LOCAL = {
    "split sum": r"all_to_all: the tensor has 4 rows along split_dim 0 but sum\(split_sizes\) "
                 r"is 3; pass sizes that sum to it",
    "length": r"all_to_all: split_sizes=\[1, 1, 2\] must hold one int >= 0 per rank of the "
              r"group \(2 ranks\)",
    "negative": r"all_to_all: split_sizes=\[5, -1\] must hold one int >= 0",
    "same dim": r"all_to_all: split_dim and concat_dim are both 1; an all-to-all moves",
    "dim range": r"all_to_all: split_dim=2 is out of range for a tensor of shape",
}


@pytest.mark.parametrize("case", sorted(A2A_LOCAL))
def test_all_to_all_bad_sizes_raise_before_the_data_moves(case):
    expect_all_ranks_raise(2, _a2a_local, ValueError, A2A_LOCAL[case], case)


def _disagree(kind):
    """Ranks that disagree, or one rank's piece that does not match its sizes:
    found by the check's all-gather, the only collective that may run."""
    import torch.distributed as dist

    rank, comm = dist.get_rank(), CountingComm(forbid=("all_to_all", "all_reduce"))
    if kind == "piece":  # rank 0 holds 2 rows, told 3: rank 1 (fine) raises too
        all_to_all(torch.zeros(4, [2, 3][rank]), [2, 2], 0, [3, 3], 1, comm=comm)
    elif kind == "concat_sizes":  # rank 0: [2, 3], rank 1: [3, 3]; each holds its own rows
        all_to_all(torch.zeros(4, [2, 3][rank]), [2, 2], 0, [[2, 3], [3, 3]][rank], 1, comm=comm)
    elif kind == "split_dim":
        all_to_all(torch.zeros(4, 2, 4), [2, 2], [0, 2][rank], [2, 2], 1, comm=comm)
    elif kind == "shape":
        all_to_all(torch.zeros(4, 2, 3 + rank), [2, 2], 0, [2, 2], 1, comm=comm)
    elif kind == "gather":
        gather_tensor(torch.zeros(2, 3), [[2, 2], [1, 2]][rank], comm=comm)
    elif kind == "all_reduce":
        reduce_scatter_tensor(torch.zeros(2, 3 + rank), None, comm=comm)
    else:
        all_reduce_grad(torch.zeros(2 + rank), comm=comm)


DISAGREE = {
    "piece": r"all_to_all: the tensor on rank 0 has 2 rows along concat_dim 1 but "
             r"concat_sizes\[0\] is 3; pass sizes that match each rank's tensor",
    "concat_sizes": r"all_to_all: concat_sizes differs across the ranks of the group "
                    r"\(rank 0: \[2, 3\], rank 1: \[3, 3\]\); every rank must pass the same",
    "split_dim": r"all_to_all: split_dim differs across the ranks of the group "
                 r"\(rank 0: 0, rank 1: 2\)",
    "shape": r"all_to_all: the tensors' shapes outside the sharded dims differ across the ranks "
             r"of the group \(ranks \[1\] differ from rank 0; this rank has shape \(4, 2, [34]\)\)",
    "gather": r"gather_tensor: sizes differs across the ranks of the group "
              r"\(rank 0: \[2, 2\], rank 1: \[1, 2\]\)",
    "all_reduce": r"reduce_scatter_tensor: the tensors' shapes outside the sharded dims differ",
    "all_reduce_grad": r"all_reduce_grad: the tensors' shapes outside the sharded dims differ",
}


@pytest.mark.parametrize("kind", sorted(DISAGREE))
def test_ranks_that_disagree_all_raise(kind):
    expect_all_ranks_raise(2, _disagree, ValueError, DISAGREE[kind], kind)


def test_all_to_all_and_all_reduce_grad_bad_arguments_single_process():
    x = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="all_to_all: split_dim must be an int, got '0'"):
        all_to_all(x, [4], "0", [2], 1)
    with pytest.raises(TypeError, match="all_to_all: check_sizes must be a bool, got 1"):
        all_to_all(x, [4], 0, [2], 1, check_sizes=1)
    with pytest.raises(TypeError, match="all_reduce_grad: expected a tensor, got list"):
        all_reduce_grad([1.0])


def test_world_of_one_all_to_all_and_all_reduce_grad():
    x = torch.randn(4, 3, requires_grad=True)
    y = all_reduce_grad(all_to_all(x, [4], 0, [3], 1))
    (y * 2).sum().backward()
    torch.testing.assert_close(y, x)
    torch.testing.assert_close(x.grad, torch.full((4, 3), 2.0))


def _piece_unchecked():
    import torch.distributed as dist

    if dist.get_rank() == 0:  # with check_sizes=False only the rank that sees it raises
        all_to_all(torch.zeros(4, 2), [2, 2], 0, [3, 3], 1, check_sizes=False,
                   comm=CountingComm(forbid=EVERY))
    return "ran"


def test_unchecked_piece_raises_on_its_rank_before_any_collective():
    with pytest.raises(Exception) as err:
        run_world(2, _piece_unchecked)
    assert err.value.failures[0].message.startswith(
        "all_to_all: the tensor on rank 0 has 2 rows along concat_dim 1 but concat_sizes[0] is 3")
    assert err.value.results == {1: "ran"}


# ---- one rank's mistake, dtypes, grad modes: every rank raises, or trains


def _one_rank_wrong(kind):
    """Rank 1 alone passes something wrong: every rank raises the same error after
    the size check's all-gather and before the data moves. Returns (message, the
    collectives that ran)."""
    import torch.distributed as dist

    bad, comm = dist.get_rank() == 1, CountingComm()
    try:
        if kind == "sum":
            shard_tensor(torch.zeros(6 if bad else 5, 2), [2, 3], comm=comm)
        elif kind == "length":
            gather_tensor(torch.zeros(2, 2), [2, 2, 2] if bad else [2, 2], comm=comm)
        elif kind == "dim":
            gather_tensor(torch.zeros(2, 2), [2, 2], 5 if bad else 0, comm=comm)
        elif kind == "dtype":  # an empty piece made without the others' dtype
            gather_tensor(torch.zeros(0 if bad else 2, 2, dtype=torch.bfloat16 if not bad
                                      else torch.float32), [2, 0], full_grad=FullGrad.PARTIAL,
                          comm=comm)
        elif kind == "full_grad":
            shard_tensor(torch.zeros(4, 2), [2, 2], comm=comm,
                         full_grad=FullGrad.PARTIAL if bad else FullGrad.REPLICATE)
        elif kind == "none piece":  # an empty piece passed as None: it hung the others
            gather_tensor(None if bad else torch.zeros(2, 2), [2, 0], comm=comm)
        elif kind == "full_grad type":
            gather_tensor(torch.zeros(2, 2), [2, 2], full_grad="partial" if bad
                          else FullGrad.REPLICATE, comm=comm)
        else:  # rank 1 under no_grad: its backward would never run the all-gather
            with torch.set_grad_enabled(not bad):
                shard_tensor(torch.zeros(4, 2, requires_grad=True), [2, 2], comm=comm)
    except (ValueError, RuntimeError, TypeError) as e:
        return str(e), comm.calls
    return "no error", comm.calls


ONE_RANK_WRONG = {
    "sum": r"shard_tensor: the tensor has 6 rows along dim 0 but sum\(sizes\) is 5",
    "length": r"gather_tensor: sizes=\[2, 2, 2\] must hold one int >= 0 per rank of the group "
              r"\(2 ranks\)",
    "dim": r"gather_tensor: dim=5 is out of range for a tensor of shape \(2, 2\)",
    "dtype": r"gather_tensor: the tensors' dtypes differ across the ranks of the group \(rank 0: "
             r"torch.bfloat16, rank 1: torch.float32\); pass one dtype on every rank",
    "full_grad": r"shard_tensor: full_grad differs across the ranks of the group \(rank 0: "
                 r"replicate, rank 1: partial\)",
    "none piece": r"gather_tensor: expected a tensor, got NoneType",
    "full_grad type": r"gather_tensor: full_grad must be a fs.collectives.FullGrad, got 'partial'",
    "grad mode": r"shard_tensor: ranks \[1\] run it with gradients off \(torch.no_grad\) while "
                 r"other ranks' tensors require grad",
}


@pytest.mark.parametrize("kind", sorted(ONE_RANK_WRONG))
def test_one_ranks_mistake_raises_on_every_rank_before_the_data_moves(kind):
    for rank, (message, calls) in enumerate(run_world(2, _one_rank_wrong, kind)):
        assert re.search(ONE_RANK_WRONG[kind], message), (rank, message)
        assert calls == ["all_gather"], (rank, calls)  # the check's, nothing after it


def _empty_piece_without_grad():
    """Rank 1 holds no rows and makes its piece without requires_grad, as
    `torch.zeros(0, C)` does: its backward's reduce-scatter runs all the same."""
    import torch.distributed as dist

    rank, sizes = dist.get_rank(), (2, 0, 3)
    whole, _, whole_w, _ = _data(sizes, 0, 3)
    piece = whole.narrow(0, sum(sizes[:rank]), sizes[rank]).clone()
    if rank != 1:
        piece.requires_grad_()
    out = gather_tensor(piece, sizes, full_grad=FullGrad.PARTIAL)
    (out * whole_w[rank]).sum().backward()
    return out.detach(), piece.grad


def test_an_empty_piece_without_grad_trains_as_one_process():
    got = run_world(3, _empty_piece_without_grad)
    want = _reference("gather", (2, 0, 3), 0, FullGrad.PARTIAL, 3)
    for rank in (0, 2):
        torch.testing.assert_close(got[rank][0], want[rank][0])
        torch.testing.assert_close(got[rank][1], want[rank][1])
    assert got[1][1] is None and got[1][0].shape == (5, 4)


def _in_place_on_outputs():
    """Each collective's output modified in place (relu_, as nn.ReLU(inplace=True))
    gives what the out-of-place relu gives, values and gradients."""
    import torch.distributed as dist

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(3)
    whole, wide = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    piece = whole[[0, 2][rank]: [2, 5][rank]]
    calls = {
        "shard": (whole, lambda x: shard_tensor(x, [2, 3])),
        "gather": (piece, lambda x: gather_tensor(x, [2, 3])),
        "gather dim 1": (wide[:, [0, 1][rank]: [1, 4][rank]], lambda x: gather_tensor(x, [1, 3], 1)),
        "reduce_scatter": (whole, lambda x: reduce_scatter_tensor(x, [2, 3])),
        "all_reduce": (whole, lambda x: reduce_scatter_tensor(x, None)),
        "all_to_all": (wide[:, [0, 1][rank]: [1, 4][rank]],
                       lambda x: all_to_all(x, [2, 3], 0, [1, 3], 1)),
    }
    out = {}
    for name, (data, fn) in calls.items():
        results = []
        for in_place in (True, False):
            x = data.clone().requires_grad_()
            y = fn(x * 1.0)
            y = y.relu_() if in_place else y.relu()
            (y * torch.arange(y.numel()).view(y.shape)).sum().backward()
            results.append((y.detach(), x.grad))
        out[name] = results
    return out


def test_outputs_can_be_modified_in_place():
    for rank, per_call in enumerate(run_world(2, _in_place_on_outputs)):
        for name, ((y, grad), (ref_y, ref_grad)) in per_call.items():
            torch.testing.assert_close(y, ref_y, msg=f"rank {rank} {name}")
            torch.testing.assert_close(grad, ref_grad, msg=f"rank {rank} {name}")


def _groups_as_users_pass_them():
    """A 1-D DeviceMesh as the group, numpy sizes, and a process outside the group."""
    import numpy as np
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("model",))
    x = torch.full((rank + 1, 2), float(rank))
    by_mesh = gather_tensor(x, np.array([1, 2, 3]), group=mesh)
    pair = dist.new_group([0, 1])
    try:
        gather_tensor(torch.ones(2, 2), [2, 2], group=pair)
        outside = None
    except ValueError as e:
        outside = str(e)
    return by_mesh, gather_tensor(x, [1, 2, 3]), outside


def test_a_mesh_numpy_sizes_and_a_process_outside_the_group():
    for rank, (by_mesh, by_default, outside) in enumerate(run_world(3, _groups_as_users_pass_them)):
        torch.testing.assert_close(by_mesh, by_default)
        if rank == 2:
            assert outside.startswith("gather_tensor: this process (rank 2 of the default group) "
                                      "is not in the group given"), outside
        else:
            assert outside is None
