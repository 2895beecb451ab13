"""Qwen3 MoE (torchtitan's debugmodel_moe, shrunk as in test_torchtitan_moe.py) through
parallelize_decoder with each other mesh at 4 CPU ranks: HSDP (dp_replicate 2 x fsdp 2),
tensor parallelism (dp 2 x tp 2) and torchtitan's activation checkpointing at EP 2;
against one process holding every expert on the same tokens: losses, first-step grads,
params after SGD steps. Same test-only swaps as there (SDPA, fp32 experts). Compiled
MoE blocks (EP 1 and 2) are tested in test_torchtitan_moe_compile.py."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.common.moe import GroupedExperts

from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_decoder
from flexshard.runtime.state import get_state
from harness import run_world
from test_torchtitan import titan_loss, tokens
from test_torchtitan_moe import (LR, STEPS, WORLD, _fp32_experts, _full_grads, _pristine,
                                 assert_matches_one_process, reference)

pytestmark = pytest.mark.world

MESHES = {  # name: (dp_replicate, tp, ep, activation checkpointing, compile)
    "hsdp": (2, 1, 1, False, False),
    "tp": (1, 2, 1, False, False),
    "ac": (1, 1, 2, True, False),
}


def _parallelize(mesh: str):
    replicate, tp, ep, ac, compiled = MESHES[mesh]
    shard = WORLD // (replicate * tp)
    dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, cp=1, tp=tp, pp=1, ep=ep,
                        world_size=WORLD, spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's Trainer does, then
    dims.build_mesh()  # the meshes, before parallelizing
    model = parallelize_decoder(
        copy.deepcopy(_pristine(ep, "qwen3", tp)), parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(expert_parallel_degree=ep, tensor_parallel_degree=tp,
                                      data_parallel_replicate_degree=replicate,
                                      data_parallel_shard_degree=shard,
                                      spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=compiled, components=["model"],
                                     backend="aot_eager"),
        ac_config=FullAC.Config() if ac else None, dump_folder="",
        flex_shard=FlexShardConfig(placement="shard"))
    return model, dims


def train_on_mesh(mesh: str) -> tuple:
    """Rank body: (losses, full step-0 grads, full params, bucket shapes)."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    import flexshard as fs

    tp = MESHES[mesh][1]
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"), \
            mock.patch.object(GroupedExperts, "forward", _fp32_experts):
        model, dims = _parallelize(mesh)
        dp_rank = dist.get_rank() // tp  # the mesh is (dp_replicate, fsdp, tp), tp innermost
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        rows = tokens(0, dp_rank)
        losses, first = [], None
        for step in range(STEPS):
            with loss_parallel() if tp > 1 else contextlib.nullcontext():  # vocab-sharded logits under TP
                loss = titan_loss(model, rows, rows[:, 1:].numel() * WORLD // tp)
                loss.backward()
            if step == 0:
                first = _full_grads(model)
            opt.step()
            opt.zero_grad()
            total = (loss.full_tensor() if tp > 1 else loss).detach().clone()
            dist.all_reduce(total)  # every tp rank holds its dp rank's sum
            losses.append(total.item() / tp)
        full = {k.replace("._checkpoint_wrapped_module", ""): v
                for k, v in fs.full_state_dict(model).items()}
        shapes = {(b.replicate_size, b.world_size) for b in get_state(model).buckets}
        compiled = [m for m in model.modules() if m._compiled_call_impl is not None]
        return losses, {k.replace("._checkpoint_wrapped_module", ""): v for k, v in first.items()}, \
            full, shapes, len(compiled)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_moe_with_each_mesh_matches_one_process(mesh):
    replicate, tp, ep, ac, compiled = MESHES[mesh]
    ref_losses, ref_first, ref_params = reference("qwen3", WORLD // tp)
    results = run_world(WORLD, train_on_mesh, mesh, timeout=400)
    for losses, first, params, shapes, n_compiled in results:
        assert ref_first.keys() <= first.keys() and ref_params.keys() <= params.keys()
        assert_matches_one_process(losses, first, params, ref_losses, ref_first, ref_params)
        if mesh == "hsdp":
            assert (replicate, WORLD // replicate) in shapes
        assert (n_compiled > 0) == compiled

