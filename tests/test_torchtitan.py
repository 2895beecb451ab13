"""torchtitan 0.3.0 integration: flexshard's parallelize function on Llama 3's debugmodel.

Flex attention has no CPU backward, so each test model swaps in torchtitan's
SDPA inner attention; everything else is torchtitan's debugmodel as built by
its model registry.
"""

from __future__ import annotations

import copy
import functools
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torchtitan.config import CompileConfig, ConfigManager, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry

import flexshard as fs
from flexshard.integrations.torchtitan import FlexShardConfig, llama_buckets, parallelize_llama
from flexshard.integrations.torchtitan.pipeline import pipeline_decoder
from flexshard.integrations.torchtitan.trainer import (FlexShardTrainer, check_trainer_config,
                                                       clip_before_step)
from flexshard.runtime.sharded_grad import plain
from flexshard.runtime.state import get_state
from harness import run_world

STEPS = 3
AC_CONFIGS = {"none": lambda: None, "full": FullAC.Config, "selective": SelectiveAC.Config}
LR = 8e-4  # torchtitan's debugmodel learning rate
BATCH, SEQ, VOCAB = 2, 32, 2048


LAYERS = 2  # of the debugmodel's 6: each block is one bucket, and two show the handoff


def debugmodel_config():
    """torchtitan's llama3 debugmodel config cut to LAYERS blocks, with SDPA attention."""
    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:LAYERS]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


@functools.lru_cache(maxsize=1)
def _pristine_debugmodel() -> torch.nn.Module:
    torch.manual_seed(0)
    model = debugmodel_config().build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def debugmodel() -> torch.nn.Module:
    """torchtitan's llama3 debugmodel (LAYERS blocks) on CPU, with SDPA attention, initialised (seed 0)."""
    return copy.deepcopy(_pristine_debugmodel())  # building it computes 6 large RoPE caches


def tokens(step: int, rank: int) -> torch.Tensor:
    """One fixed batch per rank (step ignored), so three steps visibly lower the loss."""
    del step
    g = torch.Generator().manual_seed(7919 + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def titan_loss(model, rows: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """torchtitan's loss: summed cross-entropy over the global valid-token count."""
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(),
                           reduction="sum") / global_tokens


def parallelize(model, world: int, placement: str = "shard", param: str = "float32",
                reshard: str = "default", ac: str = "none", compile_config=None,
                offload: bool = False):
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1,
                        world_size=world, spmd_backend="partial_dtensor")
    # torchtitan builds its meshes for an accelerator ("cuda" when none is found); this
    # CPU test needs CPU meshes over the gloo group.
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"):
        return parallelize_llama(
            model, parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param=param, enable_cpu_offload=offload),
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                          fsdp_reshard_after_forward=reshard),
            compile_config=compile_config or CompileConfig(), ac_config=AC_CONFIGS[ac](),
            dump_folder="", flex_shard=FlexShardConfig(placement=placement))


def _train_sharded(placement: str, ac: str = "none", compile_model: bool = False,
                   offload: bool = False) -> tuple:
    import torch.distributed as dist
    from compile_check import compiled_graph_calls

    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.reset()  # another test's graphs (this world's) leave no dynamic shapes
    model = parallelize(debugmodel(), world, placement, ac=ac, offload=offload,
                        compile_config=CompileConfig(enable=compile_model, components=["model"]))
    if offload:  # --training.enable_cpu_offload: every bucket offloaded (fs.OffloadPolicy)
        assert all(b.offload is not None for b in get_state(model).buckets)
    # torchtitan's compile of each block, inside its AC wrapper; none without --compile.enable
    compiled = [_compiled_inside(b, ac) for b in model.layers.children()]
    assert all(compiled) if compile_model else not any(
        b._compiled_call_impl is not None for b in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = titan_loss(model, tokens(step, rank), world * BATCH * SEQ)
        # every compiled block ran its graph this step (one dynamo skipped would not)
        assert compiled_graph_calls(loss) == (len(compiled) if compile_model else 0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # per-rank sums over the global count add up to the mean
        losses.append(total.item())
    full = {k.replace("._checkpoint_wrapped_module", ""): v  # torchtitan's AC wrapper
            for k, v in fs.full_state_dict(model).items()}
    return losses, full if rank == 0 else None


def _compiled_inside(block, ac: str) -> bool:
    """The block is compiled: itself without AC, else the one inside its AC wrapper."""
    if ac == "none":
        return block._compiled_call_impl is not None
    return (block._compiled_call_impl is None
            and block._checkpoint_wrapped_module._compiled_call_impl is not None)


@functools.lru_cache(maxsize=None)
def _train_reference(world: int) -> tuple:
    """Single-process training on every rank's batches: (losses, params). Computed
    once per world size and shared by the tests that compare with it (read only)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers
    try:
        model = debugmodel()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            rows = torch.cat([tokens(step, r) for r in range(world)])
            loss = titan_loss(model, rows, world * BATCH * SEQ)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.world(2)
@pytest.mark.parametrize("placement, ac", [("shard", "none"), ("owned", "none"),
                                           ("ragged", "full"), ("shard", "selective")])
def test_parallelize_llama_matches_single_process_training(placement, ac):
    """Also with torchtitan's activation checkpointing (its AC wrappers sit inside
    the flex_shard buckets, as inside FSDP2's)."""
    results = run_world(2, _train_sharded, placement, ac, timeout=240)
    check_matches_reference(results, *_train_reference(2))


@pytest.mark.world(2)
def test_cpu_offload_flag_matches_single_process_training():
    """--training.enable_cpu_offload: fs.OffloadPolicy() on every bucket (torchtitan's
    FSDP2 path passes CPUOffloadPolicy()); on CPU its staging copies run CPU to CPU."""
    results = run_world(2, _train_sharded, "shard", "none", False, True, timeout=240)
    check_matches_reference(results, *_train_reference(2))


@pytest.mark.world(2)
@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_compile_with_activation_checkpointing_matches_single_process_training(ac):
    """--compile.enable, alone and with torchtitan's AC: each block (with AC, the
    block inside each AC wrapper) is compiled, the wrapper runs eagerly around it,
    flex_shard's gather recomputes with the block."""
    results = run_world(2, _train_sharded, "shard", ac, True, timeout=300)
    check_matches_reference(results, *_train_reference(2))


def check_matches_reference(results, ref_losses, ref_params) -> None:
    """Every rank's losses equal; rank 0's losses and full params match the
    single-process run's (`results[r]` starts with (losses, full state dict))."""
    losses, full = results[0][:2]
    assert all(r[0] == losses for r in results), "ranks disagree on the loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert losses[-1] < losses[0]
    assert full.keys() == ref_params.keys()
    for k, ref in ref_params.items():
        err = (full[k] - ref).norm() / ref.norm()
        assert err < 1e-5, f"{k}: relative error {err:.2e}"


def _init_on_meta(placement: str) -> tuple:
    """As torchtitan's Trainer: build on meta, parallelize, to_empty, init_weights."""
    import torch.distributed as dist

    with torch.device("meta"):
        model = debugmodel_config().build()
    model = parallelize(model, dist.get_world_size(), placement)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=None)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    return fs.full_state_dict(model), buffers


@pytest.mark.world(2)
def test_meta_model_initialises_like_the_unsharded_one():
    results = run_world(2, _init_on_meta, "ragged", timeout=240)
    ref = debugmodel_config().build()
    torch.manual_seed(0)
    with torch.no_grad():  # torchtitan's own init: children first, one module at a time
        ref.init_weights(buffer_device=None)
    params, buffers = results[0]
    assert params.keys() == dict(ref.named_parameters()).keys()
    for k, p in ref.named_parameters():
        assert torch.equal(params[k], p), k
    assert len(buffers) == LAYERS  # one RoPE cache per block
    for k, b in ref.named_buffers():
        assert torch.equal(buffers[k], b), k
    assert not torch.equal(params["layers.0.feed_forward.w1.weight"][:384],
                           params["layers.0.feed_forward.w1.weight"][384:])


@pytest.mark.parametrize("reshard_root", [False, True])
def test_embeddings_one_bucket_per_block_then_root(reshard_root):
    """torchtitan's FSDP groups: the embeddings reshard as the blocks (they were in the
    root bucket, unsharded through forward and backward: about 1 GiB a rank on
    Llama-3-8B); the final norm and LM head only under "always"."""
    model = debugmodel()
    specs = llama_buckets(model, reshard_after_forward=True, reshard_root=reshard_root)
    assert [s.name for s in specs] == \
        ["tok_embeddings"] + [f"layers.{i}" for i in range(LAYERS)] + ["root"]
    assert list(specs[0].patterns) == ["tok_embeddings.weight"]
    assert sorted(specs[-1].patterns) == ["lm_head.weight", "norm.weight"]
    assert [s.reshard_after_forward for s in specs] == [True] * (LAYERS + 1) + [reshard_root]


def test_tied_embeddings_stay_in_the_root_bucket():
    model = debugmodel()
    model.lm_head.weight = model.tok_embeddings.weight
    specs = llama_buckets(model, reshard_after_forward=True)
    assert [s.name for s in specs] == [f"layers.{i}" for i in range(LAYERS)] + ["root"]
    assert sorted(specs[-1].patterns) == ["norm.weight", "tok_embeddings.weight"]


@pytest.mark.parametrize("policy, blocks_reshard", [("default", True), ("always", True),
                                                    ("never", False)])
def test_mixed_precision_and_reshard_come_from_torchtitan_config(policy, blocks_reshard):
    model = parallelize(debugmodel(), 1, param="bfloat16", reshard=policy)
    buckets = get_state(model).buckets
    for b in buckets:
        assert b.mp == fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32,
                                               cast_forward_inputs=False)
        root_reshards = policy == "always"
        assert b.gather.reshard_after_forward == \
            (root_reshards if b.name == "root" else blocks_reshard), b.name
        assert b.grads.gradient_divide_factor == 1.0  # torchtitan's loss is already normalised
    if policy == "default":
        loss = titan_loss(model, tokens(0, 0), BATCH * SEQ)
        loss.backward()
        assert math.isfinite(loss.item())
        assert all(p.grad is not None and p.grad.dtype == torch.float32
                   for p in model.parameters())


def test_spmd_backend_is_refused():
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    with pytest.raises(NotImplementedError, match=r"--parallelism.spmd_backend spmd_types: .*; "
                       r"pass --parallelism.spmd_backend partial_dtensor \(the flexshard_\* "):
        parallelize_llama(torch.nn.Linear(2, 2), parallel_dims=dims, training=TrainingConfig(),
                          parallelism=ParallelismConfig(spmd_backend="spmd_types"),
                          compile_config=CompileConfig(enable=True), ac_config=None,
                          dump_folder="")


def test_parallelize_without_the_flex_shard_section_is_refused():
    """A hand-written loop calling the config's parallelize_fn without flex_shard=
    would drop --flex_shard.placement; it is refused, naming the fix."""
    config = ConfigManager().parse_args([
        "--module", "flexshard.integrations.torchtitan", "--config", "flexshard_llama3_debugmodel",
        "--flex_shard.placement", "owned"])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"flex_shard is None, so the job config's --flex_shard "
                       r"section \(its placement\) would be dropped; pass flex_shard=config"):
        config.model_spec.parallelize_fn(
            model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
            compile_config=config.compile, ac_config=None, dump_folder="")
    assert not isinstance(model, fs.FlexShardModule)


def test_experiment_config_is_selected_like_torchtitans_own():
    config = ConfigManager().parse_args([
        "--module", "flexshard.integrations.torchtitan", "--config", "flexshard_llama3_debugmodel",
        "--flex_shard.placement", "ragged", "--training.steps", "7"])
    assert isinstance(config, FlexShardTrainer.Config)
    assert config.flex_shard == FlexShardConfig(placement="ragged")
    assert config.training.steps == 7
    assert config.model_spec.parallelize_fn is parallelize_llama
    assert config.model_spec.pipelining_fn is pipeline_decoder
    assert config.model_spec.name == "flexshard/llama3" and config.model_spec.flavor == "debugmodel"
    assert config.parallelism.spmd_backend == "partial_dtensor"
    assert isinstance(config.activation_checkpoint, SelectiveAC.Config)  # torchtitan's own
    check_trainer_config(config)  # the loss is one FlexShardTrainer accepts


def test_chunked_loss_is_refused():
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()  # torchtitan's own: chunked loss
    with pytest.raises(NotImplementedError, match="ChunkedLossWrapper calls lm_head outside"):
        check_trainer_config(config)


@pytest.mark.parametrize("name, placement", [("shard", fs.Shard(0)), ("owned", fs.Owned()),
                                             ("ragged", fs.RaggedShard())])
def test_placement_names(name, placement):
    assert FlexShardConfig(placement=name).build_placement() == placement


def test_unknown_placement_name_is_refused():
    with pytest.raises(ValueError, match=r"--flex_shard.placement='rows': choose one of"):
        FlexShardConfig(placement="rows").build_placement()


def _clipped_step() -> tuple:
    """Rank body: clip before the step by the global norm; (norm before, after)."""
    import torch.distributed as dist

    model = parallelize(debugmodel(), dist.get_world_size())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clip_before_step(opt, [model], max_norm=0.5)
    titan_loss(model, tokens(0, dist.get_rank()), 2 * BATCH * SEQ).backward()

    def global_norm() -> float:  # summed as clip_grad_norm_ sums, to compare like with like
        sq = sum(torch.linalg.vector_norm(plain(p.grad), dtype=torch.float32).square()
                 for p in model.parameters()).reshape(1)
        dist.all_reduce(sq)
        return sq.sqrt().item()

    before = global_norm()
    opt.step()
    return before, global_norm()


@pytest.mark.world(2)
def test_trainer_clips_by_the_global_norm_before_the_step():
    (before, after), other = run_world(2, _clipped_step, timeout=120)
    assert other == (before, after)
    assert before > 0.5  # so the clip acts
    assert after == pytest.approx(0.5, rel=1e-5)


def test_gradient_divide_factor_is_checked():
    model = fs.flex_shard(copy.deepcopy(torch.nn.Linear(3, 2)))
    with pytest.raises(ValueError, match=r"factor must be > 0, got 0; use 1.0 to sum"):
        model.set_gradient_divide_factor(0)
    with pytest.raises(TypeError, match="set_gradient_divide_factor expects a number, got '2'"):
        model.set_gradient_divide_factor("2")
