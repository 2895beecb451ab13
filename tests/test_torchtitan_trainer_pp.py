"""FlexShardTrainer's pipeline-parallel step, as docs/torchtitan.md's command runs it:
`--parallelism.pipeline_parallel_degree 2` parsed by torchtitan's ConfigManager, the
stages built by the config's `pipelining_fn`, and torchtitan's own
`forward_backward_step` stepping the schedule (torchtitan 0.3.0 passes per-microbatch
lists that torch 2.13's schedules refuse: "Expecting 4 arg_mbs but got 1").

As in tests/test_torchtitan_trainer.py, torchtitan's Trainer.__init__ (accelerator,
tokenizer, dataset) is replaced by its pipeline part (`_titan_pp_init`: the same calls
in the same order), on CPU at 2 ranks (PP 2), with SDPA for flex attention.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.trainer import Trainer

import flexshard as fs
from flexshard.integrations.torchtitan.trainer import FlexShardTrainer
from harness import run_world

PP, MICROBATCHES, SEQ, VOCAB = 2, 4, 16, 2048


def pp_config() -> FlexShardTrainer.Config:
    """The documented command line, on a 2-block debugmodel with SDPA attention."""
    config = ConfigManager().parse_args([
        "--module", "flexshard.integrations.torchtitan", "--config", "flexshard_llama3_debugmodel",
        "--parallelism.pipeline_parallel_degree", str(PP),
        "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--parallelism.pipeline_parallel_microbatch_size", "1", "--training.disable_cuda_graphs",
        "--training.local_batch_size", str(MICROBATCHES), "--training.seq_len", str(SEQ),
        "--training.mixed_precision_param", "float32"])
    model = config.model_spec.model
    model.layers = model.layers[:PP]
    for layer in model.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _titan_pp_init(self, config) -> None:
    """The pipeline steps of torchtitan's Trainer.__init__, on CPU."""
    self.config, self.device, self.ntokens_seen = config, torch.device("cpu"), 0
    self.parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=PP, ep=1,
                                      world_size=PP, spmd_backend="partial_dtensor")
    self.model_config = config.model_spec.model
    self.model_config.update_from_config(config=config)
    self.loss_fn = config.loss.build(compile_config=config.compile)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = self.model_config.build()
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"):  # CPU meshes
        (self.pp_schedule, self.model_parts, self.pp_has_first_stage,
         self.pp_has_last_stage) = config.model_spec.pipelining_fn(
            model, parallel_dims=self.parallel_dims, training=config.training,
            parallelism=config.parallelism, compile_config=config.compile,
            ac_config=config.activation_checkpoint, dump_folder=config.dump_folder,
            device=self.device, model_config=self.model_config,
            parallelize_fn=config.model_spec.parallelize_fn, loss_fn=self.loss_fn)
    for part in self.model_parts:
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        part.train()
    self.optimizers = config.optimizer.build(model_parts=self.model_parts)
    self.metrics_processor = mock.Mock()
    self.train_context = contextlib.nullcontext  # get_spmd_context: no typechecking


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (MICROBATCHES, SEQ + 1), generator=g)


def pp_step() -> dict:
    """Rank body: build FlexShardTrainer with PP 2, run torchtitan's forward_backward_step."""
    with mock.patch.object(Trainer, "__init__", _titan_pp_init):
        trainer = FlexShardTrainer(pp_config())
    rows = batch()
    loss = trainer.forward_backward_step(
        input_dict=[{"input": rows[i:i + 1, :-1]} for i in range(MICROBATCHES)],
        labels=[rows[i:i + 1, 1:] for i in range(MICROBATCHES)],
        global_valid_tokens=torch.tensor(float(MICROBATCHES * SEQ)))
    grads = {k: g.abs().sum().item() for part in trainer.model_parts
             for k, g in fs.full_grads(part).items()}
    params = {k.replace("._checkpoint_wrapped_module", ""): v
              for part in trainer.model_parts for k, v in fs.full_state_dict(part).items()}
    return {"loss": loss.item(), "last": trainer.pp_has_last_stage, "grads": grads,
            "params": params}


def reference_loss(params: dict) -> float:
    model_config = pp_config().model_spec.model
    model = model_config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # the RoPE cache; the params come next
    model.load_state_dict(params, strict=False)
    rows = batch()
    logits = model(rows[:, :-1])
    return (F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum")
            / (MICROBATCHES * SEQ)).item()


@pytest.mark.world(2)
def test_trainer_steps_the_pipeline_schedule():
    results = run_world(2, pp_step, timeout=300)
    assert [r["last"] for r in results] == [False, True]
    assert results[0]["loss"] == -1.0  # torchtitan's value off the last stage
    params = {**results[0]["params"], **results[1]["params"]}
    assert results[1]["loss"] == pytest.approx(reference_loss(params), rel=1e-5)
    for r in results:  # every stage's params got gradients
        assert r["grads"] and all(g > 0 for g in r["grads"].values()), r["grads"]
