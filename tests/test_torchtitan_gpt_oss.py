"""torchtitan 0.3.0's gpt-oss decoder through flexshard's parallelize_decoder, 2 ranks
against one process (SGD: losses, first-step gradients, params).

gpt-oss's attention rescales each head's output by a learned sink through the attention's
log-sum-exp, so it needs an inner attention that returns it: torchtitan offers varlen (CUDA
flash kernels, bf16) and flex (no CPU backward). The test model uses the same math in plain
torch ops (causal, gpt-oss's sliding window, its lse handed to the sinks' out_transform).
Its experts' grouped GEMM casts to bf16; as in test_torchtitan_moe, both sides run them in
fp32, one matmul per expert.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Optional
from unittest import mock

import pytest
import torch
from torchtitan.config import CompileConfig, ConfigManager, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims
from torchtitan.models.gpt_oss import model_registry
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, swiglu
from torchtitan.protocols.module import Module

from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_decoder
from flexshard.integrations.torchtitan.config_registry import flexshard_gpt_oss_debugmodel
from flexshard.runtime.state import get_state
from harness import run_world
from test_torchtitan import titan_loss, tokens  # one fixed batch per rank, torchtitan's loss
from test_torchtitan_moe import _full_grads, assert_matches_one_process

WORLD, STEPS, LR = 2, 3, 0.05
LAYERS, EXPERTS, TOP_K, HIDDEN = 2, 4, 2, 64


class SinkAttention(Module):
    """Causal (optionally sliding-window) softmax attention that hands its output and
    log-sum-exp, (B, L, N, H) and (B, L, N), to gpt-oss's sink rescale, as torchtitan's
    varlen attention does."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        window: Optional[int] = None  # gpt-oss's sliding_window_size: keys within it

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.window = config.window

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, scale=None, enable_gqa=False,
                out_transform=None, **_):  # the argument names torchtitan's sharding configs use
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
        if enable_gqa:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scores = (q @ k.transpose(-2, -1)) * scale
        pos = torch.arange(scores.shape[-1])
        keep = pos[:, None] >= pos[None, :]
        if self.window is not None:
            keep &= pos[:, None] - pos[None, :] < self.window
        scores = scores.masked_fill(~keep, float("-inf"))
        lse = scores.logsumexp(-1)
        out = ((scores - lse[..., None]).exp() @ v).transpose(1, 2)
        lse = lse.transpose(1, 2)
        return out if out_transform is None else out_transform(out, lse)


def _fp32_experts(self, x_RD, num_tokens_per_expert_E):
    """GptOssGroupedExperts.forward in fp32, one matmul per expert (this rank's experts
    under EP; no TP here)."""
    w1, b1, w2, b2 = (w.to_local() if hasattr(w, "to_local") else w for w in (
        self.mlp1_weight_EGD, self.mlp1_bias_EG, self.mlp2_weight_EDF, self.mlp2_bias_ED))
    assert int(num_tokens_per_expert_E.sum()) == x_RD.shape[0]
    out, start = [], 0
    for e, n in enumerate(num_tokens_per_expert_E.tolist()):
        x = x_RD[start:start + n]
        out.append(swiglu(x @ w1[e].T + b1[e], limit=self.swiglu_limit) @ w2[e].T + b2[e])
        start += n
    return torch.cat(out) if out else x_RD[:0]


def gpt_oss_config(ep: int):
    """torchtitan's gpt-oss debugmodel (dim 256, sinks, sliding window on even layers)
    cut to 2 layers of 4 experts (top 2, hidden 64), with SinkAttention, set up for
    expert parallel degree `ep`."""
    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:LAYERS]
    for layer in cfg.layers:
        attention = layer.attention
        attention.inner_attention = SinkAttention.Config(window=attention.sliding_window_size)
        moe = layer.moe
        moe.num_experts = moe.router.num_experts = moe.router.gate.out_features = EXPERTS
        moe.router.top_k = moe.routed_experts.token_dispatcher.top_k = TOP_K
        moe.routed_experts.token_dispatcher.num_experts = EXPERTS
        moe.routed_experts.inner_experts.num_experts = EXPERTS
        moe.routed_experts.inner_experts.hidden_dim = HIDDEN

    class _Job:  # as torchtitan's trainer: the model's sharding configs from the job's
        parallelism = ParallelismConfig(expert_parallel_degree=ep, spmd_backend="partial_dtensor")

    cfg.update_from_config(config=_Job())
    return cfg


@functools.lru_cache(maxsize=2)
def _pristine(ep: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = gpt_oss_config(ep).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _train(model, rows, global_tokens, full_grads, all_reduce=None) -> tuple:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first = [], None
    for step in range(STEPS):
        loss = titan_loss(model, rows, global_tokens)
        loss.backward()
        if step == 0:
            first = full_grads(model)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if all_reduce is not None:
            all_reduce(total)  # per-rank sums over the global count add up to the mean
        losses.append(total.item())
    return losses, first


@functools.lru_cache(maxsize=1)
def reference() -> tuple:
    """One process on both ranks' tokens: (losses, step-0 grads, params)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mock.patch.object(GptOssGroupedExperts, "forward", _fp32_experts):
            model = copy.deepcopy(_pristine(1))
            rows = torch.cat([tokens(0, r) for r in range(WORLD)])
            losses, first = _train(model, rows, rows[:, 1:].numel(), lambda m: {
                k: p.grad.clone() for k, p in m.named_parameters()})
            return losses, first, {k: p.detach().clone() for k, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def train_sharded(ep: int, placement: str) -> tuple:
    """Rank body: (losses, full step-0 grads, full params)."""
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils

    import flexshard as fs

    dims = ParallelDims(dp_replicate=1, dp_shard=WORLD, cp=1, tp=1, pp=1, ep=ep,
                        world_size=WORLD, spmd_backend="partial_dtensor")
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"), \
            mock.patch.object(GptOssGroupedExperts, "forward", _fp32_experts):
        dist_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's Trainer does, then
        dims.build_mesh()  # the meshes, before parallelizing
        model = parallelize_decoder(
            copy.deepcopy(_pristine(ep)), parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32"),
            parallelism=ParallelismConfig(expert_parallel_degree=ep,
                                          spmd_backend="partial_dtensor"),
            compile_config=CompileConfig(), ac_config=None, dump_folder="",
            flex_shard=FlexShardConfig(placement=placement))
        rows = tokens(0, dist.get_rank())
        losses, first = _train(model, rows, rows[:, 1:].numel() * WORLD, _full_grads,
                               dist.all_reduce)
        names = [b.name for b in get_state(model).buckets]
        return losses, first, fs.full_state_dict(model), names


@pytest.mark.parametrize("ep, placement", [(1, "shard"), (2, "shard")])
def test_gpt_oss_matches_one_process(ep, placement):
    """EP 1: the experts shard over fsdp with their block; EP 2: torchtitan's EP plan and
    all-to-all dispatch, the experts in a bucket of their own over efsdp."""
    ref_losses, ref_first, ref_params = reference()
    assert any(k.endswith("attention.sinks") for k in ref_first)  # the sinks train too
    for losses, first, params, names in run_world(WORLD, train_sharded, ep, placement,
                                                  timeout=300):
        assert ("layers.0.experts" in names) == (ep > 1), names
        assert_matches_one_process(losses, first, params, ref_losses, ref_first, ref_params)


def test_gpt_oss_debug_config_is_registered():
    """`--config flexshard_gpt_oss_debugmodel`: torchtitan's gpt-oss debugmodel with
    flex_shard's parallelize and pipeline functions."""
    config = ConfigManager().parse_args([
        "--module", "flexshard.integrations.torchtitan", "--config", "flexshard_gpt_oss_debugmodel"])
    assert type(config) is type(flexshard_gpt_oss_debugmodel())
    assert config.model_spec.name == "flexshard/gpt_oss"
    assert config.model_spec.parallelize_fn is parallelize_decoder
    assert config.parallelism.spmd_backend == "partial_dtensor"
