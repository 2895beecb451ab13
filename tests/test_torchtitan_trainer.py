"""FlexShardTrainer, built: its `--flex_shard` section reaches flex_shard, and
each optimizer step clips by the global gradient norm, as single-process
training clips the unsharded model.

torchtitan's Trainer.__init__ needs an accelerator, its tokenizer and dataset
assets; here its model and optimizer part runs instead (`_titan_init`, the
same calls in the same order), so FlexShardTrainer.__init__ itself runs
unchanged on CPU at 2 ranks.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.trainer import Trainer

import flexshard as fs
from flexshard.integrations.torchtitan.trainer import FlexShardTrainer
from flexshard.runtime.state import get_state
from harness import run_world
from test_torchtitan import BATCH, SEQ, titan_loss, tokens

MAX_NORM = 0.5


def trainer_config(placement: str) -> FlexShardTrainer.Config:
    """The command line a user types, parsed by torchtitan's ConfigManager."""
    config = ConfigManager().parse_args([
        "--module", "flexshard.integrations.torchtitan", "--config", "flexshard_llama3_debugmodel",
        "--flex_shard.placement", placement, "--training.max_norm", str(MAX_NORM),
        "--training.mixed_precision_param", "float32"])
    for layer in config.model_spec.model.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _titan_init(self, config) -> None:
    """The model and optimizer steps of torchtitan's Trainer.__init__, on CPU."""
    import torch.distributed as dist

    self.config, world = config, dist.get_world_size()
    self.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1,
                                      world_size=world, spmd_backend="partial_dtensor")
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"):  # CPU meshes
        model = config.model_spec.parallelize_fn(
            model, parallel_dims=self.parallel_dims, training=config.training,
            parallelism=config.parallelism, compile_config=config.compile,
            ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    self.model_parts = [model]
    self.optimizers = config.optimizer.build(model_parts=self.model_parts)
    self.metrics_processor = _LoggedMetrics()


class _LoggedMetrics:
    """torchtitan's MetricsProcessor.log signature; remembers what it was given."""

    def __init__(self) -> None:
        self.logged = []

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.logged.append(grad_norm)


def _full(model) -> dict:
    """Full params, named as in the unwrapped model (torchtitan's AC wrapper dropped)."""
    return {k.replace("._checkpoint_wrapped_module", ""): v
            for k, v in fs.full_state_dict(model).items()}


def train_one_step(placement: str) -> dict:
    """Rank body: build FlexShardTrainer, run one step; what it set up and did."""
    import torch.distributed as dist

    with mock.patch.object(Trainer, "__init__", _titan_init):
        trainer = FlexShardTrainer(trainer_config(placement))
    model = trainer.model_parts[0]
    before = _full(model)
    buffers = {k.replace("._checkpoint_wrapped_module", ""): v.clone()
               for k, v in model.named_buffers()}
    loss = titan_loss(model, tokens(0, dist.get_rank()), dist.get_world_size() * BATCH * SEQ)
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)  # per-rank sums over the global count add up to the mean
    norm, norm32 = _global_norm(model), _global_norm(model, torch.float32)
    # torchtitan's train_step: its clip (switched off: this rank's shards), the step, the log
    titan_norm = dist_utils.clip_grad_norm_(list(model.parameters()), trainer.config.training.max_norm,
                                       foreach=True, pp_mesh=None)
    trainer.optimizers.step()
    trainer.metrics_processor.log(1, loss.item(), loss.item(), titan_norm.item())
    placements = {type(s.placement).__name__ for b in get_state(model).buckets for s in b.slots}
    return {"max_norm": trainer.config.training.max_norm, "placements": placements,
            "wrapped": isinstance(model, fs.FlexShardModule), "norm": norm, "clipped": _global_norm(model, torch.float32), "loss": loss.item(),
            "mp": trainer.config.training.mixed_precision_param, "norm32": norm32,
            "logged": trainer.metrics_processor.logged,
            "before": before, "buffers": buffers, "after": _full(model)}


def _global_norm(model, dtype=torch.float64) -> float:
    """The global norm of the sharded grads (float64 by default: a float32 norm of
    lm_head's 2048x256 grad is off by ~1e-4 on CPU): each sharded grad's norm is
    its full gradient's (a collective, runtime/sharded_grad.py)."""
    sq = sum(torch.linalg.vector_norm(p.grad, dtype=dtype).square()
             for p in model.parameters())
    return sq.sqrt().item()


def reference_step(config, before: dict, buffers: dict) -> tuple:
    """One step of the unsharded model from the same weights, clipped by
    torch.nn.utils.clip_grad_norm_, with the same optimizer config."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers
    try:
        model_config = config.model_spec.model
        model_config.update_from_config(config=config)
        model = model_config.build()
        model.load_state_dict(before)
        with torch.no_grad():
            for k, b in model.named_buffers():  # RoPE caches, not in the state dict
                b.copy_(buffers[k])
        opt = config.optimizer.build(model_parts=[model])
        rows = torch.cat([tokens(0, r) for r in range(2)])
        loss = titan_loss(model, rows, 2 * BATCH * SEQ)
        loss.backward()
        norm = _clip_grad_norm(model, MAX_NORM)
        opt.step()
        return loss.item(), norm, {k: v.detach() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _clip_grad_norm(model, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_, with the norm summed in float64."""
    norm = math.sqrt(sum(torch.linalg.vector_norm(p.grad, dtype=torch.float64).item() ** 2
                         for p in model.parameters()))
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


@pytest.mark.world(2)
@pytest.mark.parametrize("placement, kind", [("shard", "Shard"), ("ragged", "RaggedShard")])
def test_trainer_applies_its_section_and_clips_by_the_global_norm(placement, kind):
    results = run_world(2, train_one_step, placement, timeout=300)
    for got in results:
        assert got["wrapped"] and got["placements"] == {kind}  # --flex_shard.placement
        assert got["max_norm"] == math.inf  # torchtitan's per-rank clip is switched off
    first = results[0]
    loss, norm, want = reference_step(trainer_config(placement), first["before"], first["buffers"])
    assert norm > MAX_NORM  # so the clip acts
    assert first["loss"] == pytest.approx(loss, rel=1e-6)
    assert first["mp"] == "float32"
    assert first["norm"] == pytest.approx(norm, rel=1e-6)
    # torchtitan's logged grad_norm is the global one (as under FSDP2)
    assert first["logged"] == [pytest.approx(first["norm32"], rel=1e-6)]  # summed in float32
    # Clipped before the step (summed in float32, as fs.clip_grad_norm_ sums).
    assert first["clipped"] == pytest.approx(MAX_NORM, rel=1e-5)
    for k, ref in want.items():
        moved = (ref - first["before"][k]).norm()
        err = (first["after"][k] - ref).norm() / max(moved, 1e-12)
        assert err < 1e-3, f"{k}: the step differs from the clipped reference by {err:.2e}"
