"""Experiment configs: torchtitan's decoder configs (Llama 3, Qwen3 dense and MoE,
DeepSeek-V3, gpt-oss), sharded by flex_shard.

`--module flexshard.integrations.torchtitan --config <function>` selects one.
Each starts from torchtitan's own config of the same model and changes only
what flex_shard needs: the trainer (FlexShardTrainer, `--flex_shard.*`), the
parallelize function, a plain cross-entropy loss (the chunked loss calls the LM
head outside forward) and the partial_dtensor SPMD backend. torchtitan's activation
checkpointing stays as configured: its wrappers sit inside flex_shard's buckets.
"""

from __future__ import annotations

import dataclasses

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3
from torchtitan.models.gpt_oss import config_registry as gpt_oss
from torchtitan.models.llama3 import config_registry as llama3
from torchtitan.models.qwen3 import config_registry as qwen3
from torchtitan.trainer import Trainer

from .parallelize import parallelize_decoder
from .pipeline import pipeline_decoder
from .trainer import FlexShardTrainer


def flexshard_config(config: Trainer.Config) -> FlexShardTrainer.Config:
    """A torchtitan decoder's Trainer.Config turned into a FlexShardTrainer.Config."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    out = FlexShardTrainer.Config(**values)
    spec = out.model_spec
    out.model_spec = dataclasses.replace(spec, name=f"flexshard/{spec.name}",
                                         parallelize_fn=parallelize_decoder,
                                         pipelining_fn=pipeline_decoder)
    if isinstance(out.loss, ChunkedLossWrapper.Config):
        out.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
    out.parallelism.spmd_backend = "partial_dtensor"
    return out


def flexshard_llama3_debugmodel() -> FlexShardTrainer.Config:
    """torchtitan's llama3_debugmodel (6 layers, dim 256) with flex_shard."""
    return flexshard_config(llama3.llama3_debugmodel())


def flexshard_llama3_8b() -> FlexShardTrainer.Config:
    """torchtitan's llama3_8b with flex_shard."""
    return flexshard_config(llama3.llama3_8b())


def flexshard_qwen3_debugmodel() -> FlexShardTrainer.Config:
    """torchtitan's qwen3_debugmodel (dense) with flex_shard."""
    return flexshard_config(qwen3.qwen3_debugmodel())


def flexshard_qwen3_moe_debugmodel() -> FlexShardTrainer.Config:
    """torchtitan's qwen3_moe_debug (8 layers, 64 experts, top 8) with flex_shard; with
    --parallelism.expert_parallel_degree > 1 the routed experts get buckets of their
    own over the efsdp mesh."""
    return flexshard_config(qwen3.qwen3_moe_debug())


def flexshard_deepseek_v3_debugmodel() -> FlexShardTrainer.Config:
    """torchtitan's deepseek_v3_debugmodel (MLA attention, MoE) with flex_shard."""
    return flexshard_config(deepseek_v3.deepseek_v3_debugmodel())


def flexshard_gpt_oss_debugmodel() -> FlexShardTrainer.Config:
    """torchtitan's gpt_oss_debugmodel (4 layers, 8 experts, attention sinks, varlen
    attention) with flex_shard; the routed experts shard as Qwen3's do."""
    return flexshard_config(gpt_oss.gpt_oss_debugmodel())
