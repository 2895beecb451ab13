"""torchtitan's MoE decoders (Qwen3 MoE and DeepSeek-V3 debugmodels, shrunk) through
flexshard's parallelize_decoder at 4 CPU ranks: expert parallelism 2 (experts as torchtitan's
DTensors over `ep`, in buckets of their own on `efsdp`) and 1 (experts in their
block's bucket), against one process holding every expert on every rank's tokens.

Test-only swaps, as the Llama tests swap flex attention for SDPA: SDPA attention,
and the experts' grouped GEMM in fp32 per expert (torchtitan's casts to bf16, which
leaves runs 3e-3 apart even between its own EP 1 and EP 2).
"""

from __future__ import annotations

import copy
import functools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.qwen3 import model_registry

from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_decoder
from flexshard.runtime.state import get_state
from harness import run_world
from test_torchtitan import titan_loss, tokens  # one fixed batch per rank, the same loss

pytestmark = pytest.mark.world

WORLD, STEPS, LR = 4, 3, 0.05
EXPERTS, TOP_K, HIDDEN, LAYERS = 8, 2, 64, 2


def _fp32_experts(self, x_RD, num_tokens_per_expert_E):
    """GroupedExperts.forward in fp32, one matmul per expert (torch's own ops)."""
    w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w
                  for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    out, start = [], 0
    for e, n in enumerate(num_tokens_per_expert_E.tolist()):
        x = x_RD[start:start + n]
        out.append((F.silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T)
        start += n
    return torch.cat(out) if out else x_RD[:0]


def moe_config(ep: int, tp: int = 1):
    """torchtitan's qwen3 debugmodel_moe, 2 layers of 8 experts (top 2, hidden 64),
    SDPA attention, set up for expert parallel degree `ep` (and tensor parallel `tp`)."""
    cfg = model_registry("debugmodel_moe").model
    cfg.layers = cfg.layers[:LAYERS]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        moe = layer.moe
        moe.num_experts = moe.router.num_experts = moe.router.gate.out_features = EXPERTS
        moe.router.top_k = moe.routed_experts.token_dispatcher.top_k = TOP_K
        moe.routed_experts.inner_experts.num_experts = EXPERTS
        moe.routed_experts.token_dispatcher.num_experts = EXPERTS
        moe.routed_experts.inner_experts.hidden_dim = HIDDEN

    class _Job:
        parallelism = ParallelismConfig(expert_parallel_degree=ep, tensor_parallel_degree=tp,
                                        spmd_backend="partial_dtensor")

    cfg.update_from_config(config=_Job())
    return cfg


def deepseek_config(ep: int):
    """torchtitan's deepseek_v3 debugmodel, its dense first layer and one MoE layer
    (8 experts, top 3, 2 shared experts, MLA attention), SDPA attention, set up for
    expert parallel degree `ep`."""
    from torchtitan.models.deepseek_v3 import model_registry as deepseek_registry

    cfg = deepseek_registry("debugmodel").model
    cfg.layers = cfg.layers[:LAYERS]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()

    class _Job:
        parallelism = ParallelismConfig(expert_parallel_degree=ep,
                                        spmd_backend="partial_dtensor")

    cfg.update_from_config(config=_Job())
    return cfg


CONFIGS = {"qwen3": moe_config, "deepseek_v3": deepseek_config}


@functools.lru_cache(maxsize=4)
def _pristine(ep: int, family: str = "qwen3", tp: int = 1) -> torch.nn.Module:
    torch.manual_seed(0)
    model = (CONFIGS[family](ep) if tp == 1 else moe_config(ep, tp)).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


@functools.lru_cache(maxsize=2)
def reference(family: str = "qwen3", dp: int = WORLD) -> tuple:
    """One process, every expert, the tokens of `dp` data-parallel ranks: (losses,
    step-0 grads, params). Cached per arguments, shared read-only by the tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mock.patch.object(GroupedExperts, "forward", _fp32_experts):
            model = copy.deepcopy(_pristine(1, family))
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            rows = torch.cat([tokens(0, r) for r in range(dp)])
            losses, first = [], None
            for step in range(STEPS):
                loss = titan_loss(model, rows, rows[:, 1:].numel())
                loss.backward()
                if step == 0:
                    first = {k: p.grad.clone() for k, p in model.named_parameters()}
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses, first, {k: p.detach().clone() for k, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def train_sharded(ep: int, placement: str, family: str = "qwen3") -> tuple:
    """Rank body: (losses, full step-0 grads, full params, buckets and their group sizes)."""
    import torch.distributed as dist

    import flexshard as fs

    rank = dist.get_rank()
    dims = ParallelDims(dp_replicate=1, dp_shard=WORLD, cp=1, tp=1, pp=1, ep=ep,
                        world_size=WORLD, spmd_backend="partial_dtensor")
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"), \
            mock.patch.object(GroupedExperts, "forward", _fp32_experts):
        dist_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's Trainer does, then
        dims.build_mesh()  # the meshes, before parallelizing
        model = parallelize_decoder(
            copy.deepcopy(_pristine(ep, family)), parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(expert_parallel_degree=ep,
                                          spmd_backend="partial_dtensor"),
            compile_config=CompileConfig(), ac_config=None, dump_folder="",
            flex_shard=FlexShardConfig(placement=placement))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        rows = tokens(0, rank)
        losses, first = [], None
        for step in range(STEPS):
            loss = titan_loss(model, rows, rows[:, 1:].numel() * WORLD)
            loss.backward()
            if step == 0:
                first = _full_grads(model)
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
        buckets = [(b.name, b.world_size) for b in get_state(model).buckets]
        return losses, first, fs.full_state_dict(model), buckets


def _full_grads(model) -> dict:
    """The full step-0 grads: each sharded grad placed as its param, gathered
    like a param (fs.full_state_dict of a copy holding the grads)."""
    import flexshard as fs

    saved = {id(p): p.detach().clone() for p in model.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    grads = fs.full_state_dict(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(saved[id(p)])
    return grads


def assert_matches_one_process(losses, first, params, ref_losses, ref_first, ref_params):
    """A rank's losses, first-step grads and params against the one-process run's."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)
    for k, want in ref_first.items():
        torch.testing.assert_close(first[k], want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, k=k: f"grad of {k}: {m}")
    for k, want in ref_params.items():
        torch.testing.assert_close(params[k], want, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("family,ep,placement", [
    ("qwen3", 2, "shard"), ("qwen3", 2, "owned"), ("qwen3", 1, "ragged"),
    ("qwen3", 4, "shard"),  # efsdp of 1 rank: the experts' bucket only re-wraps DTensors
    ("deepseek_v3", 2, "ragged")])
def test_moe_decoder_matches_one_process(family, ep, placement):
    ref_losses, ref_first, ref_params = reference(family)
    results = run_world(WORLD, train_sharded, ep, placement, family, timeout=300)
    for losses, first, params, buckets in results:
        assert_matches_one_process(losses, first, params, ref_losses, ref_first, ref_params)
        sizes = dict(buckets)
        moe = "layers.1" if family == "deepseek_v3" else "layers.0"  # its layer 0 is dense
        if ep > 1:  # experts in buckets of their own over efsdp (2 ranks)
            assert sizes[f"{moe}.experts"] == WORLD // ep and sizes[moe] == WORLD
        else:
            assert f"{moe}.experts" not in sizes and sizes[moe] == WORLD
