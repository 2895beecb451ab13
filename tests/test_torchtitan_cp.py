"""torchtitan's context parallelism (`--parallelism.context_parallel_degree`) with flexshard.

torch's CP does not run on CPU (torch 2.13, gloo): its attention dispatch has no rule for
the op CPU's SDPA lowers to. So flex_shard over dp_shard x cp cannot be tested against one
process here, and parallelize_decoder refuses the flag with that measured reason. The
first test runs torch's CP as torchtitan applies it and checks the reason still holds: if a
later torch runs it, the test fails and CP can be folded in and tested.
"""

from __future__ import annotations

import pytest
import torch
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims

from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_decoder
from harness import run_world

CPU_CP_ERROR = ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not "
                "have a sharding strategy registered")


def _cp_attention_on_cpu() -> str:
    """torchtitan's SDPA inner attention under its apply_cp_to_forward on a 2-rank cp
    mesh: this rank's half of the sequence, forward and backward. The error's text, or ''."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel import apply_cp_to_forward
    from torchtitan.models.common.attention import ScaledDotProductAttention

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
    apply_cp_to_forward([attention], mesh)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 2, 8, generator=g).chunk(world, dim=1)[rank]  # (B, L, N, H)
    w = torch.randn(8, 8, generator=g).requires_grad_()
    try:
        q = x @ w
        attention(q, 2 * q, 3 * q).sum().backward()
    except NotImplementedError as e:  # raised on every rank before any collective
        return str(e)
    return ""


def test_torch_context_parallelism_does_not_run_on_cpu():
    errors = run_world(2, _cp_attention_on_cpu)
    assert all(CPU_CP_ERROR in e for e in errors), errors


def _parallelize(dims: ParallelDims, parallelism: ParallelismConfig):
    return parallelize_decoder(torch.nn.Linear(2, 2), parallel_dims=dims,
                               training=TrainingConfig(), parallelism=parallelism,
                               compile_config=CompileConfig(), ac_config=None, dump_folder="",
                               flex_shard=FlexShardConfig())


def test_context_parallel_degree_is_refused_with_the_measured_reason():
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=1, pp=1, ep=1, world_size=2,
                        spmd_backend="partial_dtensor")
    pattern = (r"--parallelism.context_parallel_degree 2: .* does not shard over the cp mesh, "
               r".*on CPU its SDPA dispatch raises NotImplementedError '"
               + CPU_CP_ERROR.replace(".", r"\.")
               + r"'.* Set --parallelism.context_parallel_degree 1 and give those ranks to dp_shard")
    with pytest.raises(NotImplementedError, match=pattern):
        _parallelize(dims, ParallelismConfig(spmd_backend="partial_dtensor"))


def test_fsdp_symm_mem_is_refused():
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1,
                        spmd_backend="partial_dtensor")
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    parallelism.enable_fsdp_symm_mem = True  # its constructor asks for a CUDA device
    with pytest.raises(NotImplementedError, match=r"tensor, expert and pipeline parallelism "
                       r"only; drop --parallelism.enable_fsdp_symm_mem"):
        _parallelize(dims, parallelism)


def test_tensor_parallel_without_a_dp_shard_dim_is_refused_before_the_model_is_touched():
    """flex_shard needs 2+ ranks to shard TP blocks over: said in torchtitan's flags,
    before torchtitan's TP plan converts the params (dp_replicate too: HSDP of 1)."""
    for replicate in (1, 2):
        dims = ParallelDims(dp_replicate=replicate, dp_shard=1, cp=1, tp=2, pp=1, ep=1,
                            world_size=2 * replicate, spmd_backend="partial_dtensor")
        model = torch.nn.Linear(2, 2)
        with pytest.raises(NotImplementedError, match=r"--parallelism.tensor_parallel_degree 2 "
                           r"with --parallelism.data_parallel_shard_degree 1: .* give dp_shard 2 "
                           r"or more ranks"):
            parallelize_decoder(model, parallel_dims=dims, training=TrainingConfig(),
                                parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
                                compile_config=CompileConfig(), ac_config=None, dump_folder="",
                                flex_shard=FlexShardConfig())
