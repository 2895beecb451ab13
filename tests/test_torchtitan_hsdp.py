"""torchtitan's `--parallelism.data_parallel_replicate_degree` with flexshard's
parallelize_llama: HSDP on torchtitan's (dp_replicate, fsdp) mesh, at 4 ranks as
(2, 2), on the debugmodel with SDPA, against single-process training."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims

import flexshard as fs
from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_llama
from flexshard.runtime.state import get_state
from harness import run_world
from test_torchtitan import (BATCH, LR, SEQ, STEPS, _train_reference, check_matches_reference,
                             debugmodel, titan_loss, tokens)

WORLD, REPLICATE = 4, 2


def _parallelize_hsdp(model, placement: str):
    dims = ParallelDims(dp_replicate=REPLICATE, dp_shard=WORLD // REPLICATE, cp=1, tp=1, pp=1,
                        ep=1, world_size=WORLD, spmd_backend="partial_dtensor")
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"):  # CPU meshes
        return parallelize_llama(
            model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                          data_parallel_replicate_degree=REPLICATE),
            compile_config=CompileConfig(), ac_config=None, dump_folder="",
            flex_shard=FlexShardConfig(placement=placement))


def _train_hsdp(placement: str) -> tuple:
    rank = dist.get_rank()
    model = _parallelize_hsdp(debugmodel(), placement)
    state = get_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = titan_loss(model, tokens(step, rank), WORLD * BATCH * SEQ)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    all_reduces = sum(b.counters.all_reduces for b in state.buckets)
    full = fs.full_state_dict(model)  # gathers: every rank takes part
    return (losses, full if rank == 0 else None,
            (state.replicate_size, state.world_size), all_reduces, len(state.buckets))


@pytest.mark.world(4)
def test_data_parallel_replicate_degree_is_hsdp():
    # One placement: tests/test_hsdp.py covers every placement under HSDP.
    results = run_world(WORLD, _train_hsdp, "ragged", timeout=300)
    check_matches_reference(results, *_train_reference(WORLD))
    for _, _, rank_shape, all_reduces, buckets in results:
        # (replicate, shard) = (2, 2): every bucket all-reduces across replicas each step.
        assert rank_shape == (REPLICATE, WORLD // REPLICATE)
        assert all_reduces == STEPS * buckets
