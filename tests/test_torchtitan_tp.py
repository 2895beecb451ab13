"""torchtitan with --parallelism.tensor_parallel_degree 2: flexshard's
parallelize_llama applies torchtitan's TP plan, then flex_shard over the fsdp
mesh; 4 ranks as (dp 2, tp 2) on the debugmodel with SDPA, against a single
process trained on both dp ranks' batches."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims

import flexshard as fs
from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_llama
from harness import run_world
from test_torchtitan import (BATCH, LR, SEQ, STEPS, _train_reference, check_matches_reference,
                             debugmodel_config, titan_loss, tokens)

DP, TP = 2, 2


def tp_debugmodel() -> torch.nn.Module:
    """The debugmodel (SDPA, seed 0) with torchtitan's TP sharding declarations, as its
    Trainer fills them in (update_from_config); they do not change the initial values."""
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = debugmodel_config()
    set_llama3_sharding_config(cfg, enable_sp=ParallelismConfig().enable_sequence_parallel)
    torch.manual_seed(0)
    model = cfg.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def parallelize_tp(model, placement: str = "shard", reshard: str = "default"):
    dims = ParallelDims(dp_replicate=1, dp_shard=DP, cp=1, tp=TP, pp=1, ep=1,
                        world_size=DP * TP, spmd_backend="partial_dtensor")
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"):  # CPU meshes
        model = parallelize_llama(
            model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor", tensor_parallel_degree=TP,
                                          data_parallel_shard_degree=DP,
                                          fsdp_reshard_after_forward=reshard),
            compile_config=CompileConfig(), ac_config=None, dump_folder="",
            flex_shard=FlexShardConfig(placement=placement))
    return model, dims


def _train_tp(placement: str, reshard: str) -> tuple:
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    model, dims = parallelize_tp(tp_debugmodel(), placement, reshard)
    dp_rank = dims.get_mesh("fsdp").get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        with loss_parallel():  # as torchtitan's train context: the logits are vocab-sharded
            loss = titan_loss(model, tokens(step, dp_rank), DP * BATCH * SEQ)
            loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().full_tensor().clone()  # Replicate over tp
        dist.all_reduce(total)  # each tp rank holds its dp rank's sum
        losses.append(total.item() / TP)
    return losses, fs.full_state_dict(model)


@pytest.mark.world(4)
@pytest.mark.parametrize("placement, reshard", [("shard", "default"), ("ragged", "never")])
def test_tensor_parallel_matches_single_process_training(placement, reshard):
    results = run_world(DP * TP, _train_tp, placement, reshard, timeout=400)
    check_matches_reference(results, *_train_reference(DP))


def _init_on_meta_tp() -> tuple:
    """As torchtitan's Trainer: build on meta, parallelize (TP, then flex_shard),
    to_empty, init_weights; then the first step's loss (summed over the dp ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = debugmodel_config()
    set_llama3_sharding_config(cfg, enable_sp=ParallelismConfig().enable_sequence_parallel)
    with torch.device("meta"):
        model = cfg.build()
    model, dims = parallelize_tp(model, "ragged")
    before = {k: type(b) for k, b in model.named_buffers()}
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=None)
    params = fs.full_state_dict(model)
    after = {k: type(b) for k, b in model.named_buffers()}
    assert after == before and DTensor in after.values(), (before, after)  # the RoPE caches
    buffers = {k: b.full_tensor() if isinstance(b, DTensor) else b
               for k, b in model.named_buffers()}
    with loss_parallel():  # torchtitan's train context: vocab-sharded logits
        loss = titan_loss(model, tokens(0, dims.get_mesh("fsdp").get_local_rank()),
                          DP * BATCH * SEQ)
        loss.backward()
    total = loss.detach().full_tensor().clone()
    dist.all_reduce(total)  # each tp rank holds its dp rank's sum
    return params, buffers, total.item() / TP


@pytest.mark.world(4)
def test_meta_model_initialises_like_the_unsharded_one():
    """...and trains: its RoPE caches stayed DTensors (Replicate over tp), where
    flexshard's init_weights made them plain tensors and every rank's first forward
    raised (mixed torch.Tensor and DTensor)."""
    results = run_world(DP * TP, _init_on_meta_tp, timeout=300)
    ref = debugmodel_config().build()
    torch.manual_seed(0)
    with torch.no_grad():  # torchtitan's own init: children first, one module at a time
        ref.init_weights(buffer_device=None)
    ref_loss = titan_loss(ref, torch.cat([tokens(0, r) for r in range(DP)]), DP * BATCH * SEQ)
    for params, buffers, loss in results:
        assert params.keys() == dict(ref.named_parameters()).keys()
        for k, p in ref.named_parameters():
            assert torch.equal(params[k], p), k
        assert buffers.keys() == dict(ref.named_buffers()).keys()
        for k, b in ref.named_buffers():
            assert torch.equal(buffers[k], b), k
        torch.testing.assert_close(loss, ref_loss.item(), rtol=1e-5, atol=0)
