"""Parity: flex_shard training matches a single-process reference on the same data."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from reference import check_parity


def shard1_for_matrices(fqn, param):
    """Shard(1) where a param has a dim 1, else Shard(0)."""
    return fs.Shard(1) if param.dim() > 1 else fs.Shard(0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard0_fp32(world):
    check_parity(world, {})


@pytest.mark.parametrize("world", [2, 3])
def test_shard0_no_reshard(world):
    check_parity(world, {"reshard_after_forward": False})


@pytest.mark.parametrize("reshard", [True, False])
def test_shard1(reshard):
    check_parity(2, {"placement": shard1_for_matrices, "reshard_after_forward": reshard})


def test_shard1_four_ranks():
    check_parity(4, {"placement": shard1_for_matrices})


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_param_dtype(world):
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    check_parity(world, {"mp_policy": mp}, param_dtype=torch.bfloat16)


def test_explicit_buckets_match_default():
    buckets = [fs.BucketSpec("layers.1.*"), fs.BucketSpec("layers.0.*", name="first"),
               fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], name="rest")]
    check_parity(2, {"buckets": buckets})
