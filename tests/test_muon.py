"""Muon on Owned matrices (examples/muon.py, flexshard.optim): parity with
single-process Muon + AdamW, and no collective inside optimizer.step()."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import flexshard as fs
from flexshard.optim import split_for_muon
from flexshard.runtime.state import find_state
from harness import expect_all_ranks_raise, run_world
from reference import LR, assert_one_collective_per_bucket, check_parity, make_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import muon as muon_example  # noqa: E402

pytestmark = pytest.mark.world


def is_block_matrix(fqn, shape):
    return fqn.startswith("layers.") and len(shape) == 2


def owned_matrices(fqn, param):
    return fs.Owned() if is_block_matrix(fqn, param.shape) else fs.RaggedShard()


def muon_adamw(model):
    """Muon on the blocks' matrices, AdamW on the rest: sharded or plain model."""
    if find_state(model) is not None:
        matrices, others = split_for_muon(model, is_block_matrix)
    else:  # the single-process reference
        named = list(model.named_parameters())
        matrices = [p for n, p in named if is_block_matrix(n, p.shape)]
        others = [p for n, p in named if not is_block_matrix(n, p.shape)]
    opts = [torch.optim.AdamW(others, lr=LR)]
    if matrices:
        opts.append(torch.optim.Muon(matrices, lr=LR))
    return muon_example.Optimizers(*opts)


@pytest.mark.parametrize("world,dtype", [(1, None), (2, None), (3, torch.float64)])
def test_parity_and_no_collective_in_step(world, dtype):
    """Muon runs Newton-Schulz in bf16, which turns a last-bit difference in a
    gradient into a bf16 rounding flip. Two ranks sum in an order-free way, so
    fp32 runs are bitwise equal; at three ranks gloo sums in another order than
    the reference, so that run is fp64, whose last bits no bf16 cast can see."""
    results = check_parity(world, {"placement": owned_matrices}, make_opt=muon_adamw,
                           model_kw={"dtype": dtype}, count_comms=True, exact=world <= 2)
    for *_, stats in results:
        assert stats["step_comms"] == [{}] * len(stats["step_comms"])
    if world > 1:
        assert_one_collective_per_bucket(results)


def _split_sizes():
    import torch.distributed as dist

    model = fs.flex_shard(make_model(), placement=owned_matrices)
    matrices, others = split_for_muon(model, is_block_matrix)
    return (dist.get_rank(), [tuple(p.shape) for p in matrices if p.numel()], len(others),
            len(matrices))


def test_each_matrix_on_exactly_one_rank():
    results = run_world(2, _split_sizes)
    model = make_model()
    want = sorted(tuple(p.shape) for n, p in model.named_parameters()
                  if is_block_matrix(n, p.shape))
    assert sorted(s for _, shapes, *_ in results for s in shapes) == want
    assert all(shapes for _, shapes, *_ in results)  # both ranks own matrices
    # each list holds every picked param on every rank (empty pieces included)
    assert {(n, m) for *_, n, m in results} == {(len(list(model.parameters())) - len(want),
                                                 len(want))}


def _muon_on_row_shards():
    model = fs.flex_shard(make_model(), placement=fs.Shard(0))
    split_for_muon(model, is_block_matrix)


def _muon_on_a_vector():
    model = fs.flex_shard(make_model(), placement=fs.Owned())
    split_for_muon(model, lambda fqn, shape: fqn == "layers.1.norm2.bias")


def test_errors_name_param_and_bucket():
    expect_all_ranks_raise(
        2, _muon_on_row_shards, ValueError,
        r"parameter 'layers\.0\.qkv\.weight' in bucket 'layers\.0' is picked for Muon but "
        r"Shard\(dim=0\) splits it across ranks; Muon needs whole matrices: give it placement "
        r"fs\.Owned\(\)")
    expect_all_ranks_raise(
        2, _muon_on_a_vector, ValueError,
        r"parameter 'layers\.1\.norm2\.bias' in bucket 'layers\.1' has shape \(30,\); "
        r"torch\.optim\.Muon takes 2-D params only")


def _run_example():
    return muon_example.train(steps=10)


def test_example_trains():
    losses = run_world(2, _run_example)
    assert losses[0] == losses[1]
    assert losses[0][-1] < 0.5 * losses[0][0]
