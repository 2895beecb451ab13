"""Experiment configs: torchtitan's Llama 3 configs, sharded by flex_shard.

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
from torchtitan.models.llama3 import config_registry as llama3
from torchtitan.trainer import Trainer

from .parallelize import parallelize_llama
from .trainer import FlexShardTrainer


def flexshard_config(config: Trainer.Config) -> FlexShardTrainer.Config:
    """A torchtitan Llama 3 Trainer.Config turned into a FlexShardTrainer.Config."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
    out = FlexShardTrainer.Config(**values)
    spec = out.model_spec
    out.model_spec = dataclasses.replace(spec, name=f"flexshard/{spec.name}",
                                         parallelize_fn=parallelize_llama, pipelining_fn=None)
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
