"""Qwen3 MoE (torchtitan's debugmodel_moe, shrunk as in test_torchtitan_moe.py) through
parallelize_decoder with `--compile.enable`: each block compiled by torchtitan's own
apply_compile (fullgraph=True), experts in their block's bucket (EP 1), 2 CPU ranks
(DP 2), against one process on the same tokens: losses, first-step grads, params
after SGD steps. Every step runs each block's compiled graph, and no step after the
first recompiles.

Test-only swaps: SDPA attention (in the shared config), and the experts in fp32 with
static shapes (`_fp32_masked_experts`); the one-process reference keeps the eager
per-expert swap of test_torchtitan_moe.py, an independent formulation of the same math.
The backend is aot_eager: dynamo and AOTAutograd as under inductor, whose CPU code
generation tests/test_torchtitan.py's Llama compile test already pays for.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common.moe import GroupedExperts

from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_decoder
from flexshard.runtime.state import get_state
from harness import run_world
from test_torchtitan import titan_loss, tokens
from test_torchtitan_moe import (LR, STEPS, TOP_K, _full_grads, _pristine,
                                 assert_matches_one_process, reference)

pytestmark = pytest.mark.world

WORLD = 2


def _fp32_masked_experts(self, x_RD, num_tokens_per_expert_E):
    """GroupedExperts.forward in fp32 with static shapes: every expert on every routed
    row, each row keeping its own expert's output (one-hot, from the offsets).
    torchtitan's fp32 grouped GEMM has no CPU meta kernel (it asks for bf16), and the
    eager swap's per-expert slices are data-dependent shapes (unbacked symbols: 6x
    the compile time, measured)."""
    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w  # under EP: this rank's
                  for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))  # experts, as torchtitan's
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    rows_R = torch.arange(x_RD.shape[0], dtype=torch.int32, device=x_RD.device)
    expert_R = torch.searchsorted(offsets_E, rows_R, right=True)
    mask_RE = F.one_hot(expert_R.long(), w1.shape[0]).to(x_RD.dtype)
    h_REF = F.silu(torch.einsum("rd,efd->ref", x_RD, w1))
    h_REF = h_REF * torch.einsum("rd,efd->ref", x_RD, w3)
    out_RED = torch.einsum("ref,edf->red", h_REF, w2)
    return (out_RED * mask_RE[..., None]).sum(1)


def _parallelize_compiled(ep: int):
    dims = ParallelDims(dp_replicate=1, dp_shard=WORLD, cp=1, tp=1, pp=1, ep=ep,
                        world_size=WORLD, spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's Trainer does, then
    dims.build_mesh()  # the meshes, before parallelizing
    model = parallelize_decoder(
        copy.deepcopy(_pristine(ep, "qwen3")), parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(expert_parallel_degree=ep, spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=True, components=["model"], backend="aot_eager"),
        ac_config=None, dump_folder="", flex_shard=FlexShardConfig(placement="shard"))
    return model


def train_compiled(ep: int) -> tuple:
    """Rank body: (losses, full step-0 grads, full params, compiled graph calls per
    step, tokens each block's experts received, compiled modules, hooked buckets)."""
    import torch.distributed as dist
    from compile_check import compiled_graph_calls

    import flexshard as fs

    torch._dynamo.reset()  # another test's graphs (this world's) leave no dynamic shapes
    rows = tokens(0, dist.get_rank())
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"), \
            mock.patch.object(GroupedExperts, "forward", _fp32_masked_experts):
        model = _parallelize_compiled(ep)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, first, calls = [], None, []
        for step in range(STEPS):
            # step 0 compiles; a later step that needs another graph fails here
            with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
                loss = titan_loss(model, rows, rows[:, 1:].numel() * WORLD)
            calls.append(compiled_graph_calls(loss))
            loss.backward()
            if step == 0:
                first = _full_grads(model)
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
        routed = [b.moe.tokens_per_expert_E.clone() for b in model.layers.children()]
        compiled = {n for n, m in model.named_modules() if m._compiled_call_impl is not None}
        hooked = {b.name for b in get_state(model).buckets if b.needs_hooks}
        return losses, first, fs.full_state_dict(model), calls, routed, compiled, hooked


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_compiled_blocks_match_one_process(ep):
    """EP 1: each block compiled whole. EP 2: the routed experts are a bucket of their
    own (on efsdp, one rank here), hooked inside their block, so the block's pieces
    around them are compiled and the experts inside their hooks."""
    ref_losses, ref_first, ref_params = reference("qwen3", WORLD)
    results = run_world(WORLD, train_compiled, ep, timeout=240)
    for losses, first, params, calls, routed, compiled, hooked in results:
        assert_matches_one_process(losses, first, params, ref_losses, ref_first, ref_params)
        assert calls == [len(compiled)] * STEPS  # each compiled graph ran, every step
        for counts in routed:  # the compiled graphs routed tokens to several experts
            assert counts.sum() == STEPS * tokens(0, 0)[:, 1:].numel() * TOP_K
            assert (counts > 0).sum() > 1
        if ep == 1:
            assert compiled == {"layers.0", "layers.1"}
            assert hooked == {"tok_embeddings", "layers.0", "layers.1", "root"}
        else:
            for i in "01":
                assert f"layers.{i}.experts" in hooked and f"layers.{i}" not in compiled
                assert {f"layers.{i}.attention", f"layers.{i}.moe.router",
                        f"layers.{i}.moe.routed_experts.inner_experts"} <= compiled
