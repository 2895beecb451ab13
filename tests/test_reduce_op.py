"""How a bucket averages its grads (GradReduce.reduce_op): the backend's AVG where
it has one (NCCL), else a power-of-two pre-divide before the sum and the rest
of the factor after it, so low-precision sums do not overflow at large world
sizes; set_gradient_divide_factor keeps its meaning. Simulated worlds in one
process: every rank is taken to send what this one sends."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from benchmarks.hot_path import LocalComm, make_bucket

BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)


class EqualRanksComm(LocalComm):
    """A world where every rank sent the same reduce input: SUM adds W copies
    of this rank's segment pairwise in the reduce dtype (as a tree would: a
    one-by-one bf16 sum of 1024 terms stalls once each term is below half an
    ulp); AVG, where `avg`, returns it as is."""

    def __init__(self, avg: bool = False) -> None:
        super().__init__()
        self.avg, self.ops = avg, []

    def averages(self, group) -> bool:
        return self.avg

    def reduce_scatter(self, output, input, group, async_op=False, op=dist.ReduceOp.SUM):
        self.ops.append(op)
        world = input.numel() // output.numel()
        mine = input.view(world, -1)[self.rank]
        if op == dist.ReduceOp.AVG:
            output.copy_(mine)
            return
        terms = [mine.clone() for _ in range(world)]
        while len(terms) > 1:
            terms = [a + b for a, b in zip(terms[::2], terms[1::2])] + terms[len(terms) // 2 * 2:]
        output.copy_(terms[0])


def _reduce(world, grad, comm, mp=BF16, factor=None):
    bucket = make_bucket(world, fs.Shard(0), [tuple(grad.shape)], mp=mp, comm=comm)
    if factor is not None:
        bucket.grads.gradient_divide_factor = factor
    (sharded,) = bucket.grads.finish(bucket.grads.start([grad]))
    rows = bucket.slots[0].local_shapes[0][0]
    return sharded, rows


@pytest.mark.parametrize("world", [64, 48, 1024])
def test_bf16_mean_of_grads_whose_sum_overflows_is_right(world):
    # 2**123: its multiples by up to 1024 are exact in bf16, so any error would be
    # the reduction's, not the fake's bf16 accumulation.
    grad = torch.full((world, 2), 2.0 ** 123)
    assert torch.isinf(torch.tensor(2.0 ** 123, dtype=torch.bfloat16) * world)  # sum first: inf
    sharded, rows = _reduce(world, grad, EqualRanksComm())
    assert torch.equal(sharded, grad[:rows])  # the mean of equal grads is the grad


def test_a_power_of_two_world_is_exactly_the_mean():
    grad = torch.randn(64, 3)
    sharded, rows = _reduce(64, grad, EqualRanksComm())
    assert torch.equal(sharded, grad[:rows].to(torch.bfloat16).float())


def test_the_backends_average_is_used_where_it_has_one():
    comm = EqualRanksComm(avg=True)
    grad = torch.randn(8, 3)
    sharded, rows = _reduce(8, grad, comm, mp=fs.MixedPrecisionPolicy())
    assert comm.ops == [dist.ReduceOp.AVG]
    assert torch.equal(sharded, grad[:rows])  # no pre-divide, no post-divide


def test_a_divide_factor_of_one_sums():
    comm = EqualRanksComm(avg=True)
    grad = torch.randn(8, 3)
    sharded, rows = _reduce(8, grad, comm, mp=fs.MixedPrecisionPolicy(), factor=1.0)
    assert comm.ops == [dist.ReduceOp.SUM]
    torch.testing.assert_close(sharded, grad[:rows] * 8)


@pytest.mark.parametrize("factor", [10.0, 0.5, 3.0])
def test_another_divide_factor_pre_and_post_divides(factor):
    comm = EqualRanksComm(avg=True)  # AVG divides by the world size only: not used
    grad = torch.randn(8, 3)
    sharded, rows = _reduce(8, grad, comm, mp=fs.MixedPrecisionPolicy(), factor=factor)
    assert comm.ops == [dist.ReduceOp.SUM]
    torch.testing.assert_close(sharded, grad[:rows] * 8 / factor)


def test_nccl_groups_average_and_others_do_not():
    assert fs.Comm().averages(None) is False
