"""torchtitan's Trainer with flex_shard: a `--flex_shard.*` section, global-norm clipping."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.trainer import Trainer

import flexshard as fs

from .config import FlexShardConfig
from .parallelize import parallelize_llama


def check_trainer_config(config) -> None:
    """NotImplementedError for Trainer settings the flex_shard path cannot honour."""
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        raise NotImplementedError(
            "loss ChunkedLossWrapper calls lm_head outside the model's forward, where "
            "flex_shard's root bucket holds sharded parameters; use "
            "CrossEntropyLoss.Config (the flexshard_* configs do)")
    if config.model_spec is None:
        raise ValueError("FlexShardTrainer.Config.model_spec is None; build the config with "
                         "a flexshard_* function of flexshard.integrations.torchtitan."
                         "config_registry")


def clip_before_step(optimizer, models, max_norm: float):
    """Register a step pre-hook on `optimizer` that clips the gradients of every
    flex-sharded model in `models` to a global norm of `max_norm` (one all-reduce
    each). Returns the hook's handle."""
    def clip(*_) -> None:
        for model in models:
            fs.clip_grad_norm_(model, max_norm)
    return optimizer.register_step_pre_hook(clip)


class FlexShardTrainer(Trainer):
    """Trainer whose parallelize function is flexshard's, configured by `--flex_shard.*`.

    Gradient clipping: torchtitan's own clip sees only this rank's sharded
    gradients, so it is switched off (max_norm = inf; its logged grad_norm is this
    rank's) and `fs.clip_grad_norm_` clips by the global norm right before each
    optimizer step, with `--training.max_norm`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        flex_shard: FlexShardConfig = field(default_factory=FlexShardConfig)

    def __init__(self, config: Config) -> None:
        check_trainer_config(config)
        max_norm = float(config.training.max_norm)
        config.training.max_norm = math.inf
        config.model_spec = dataclasses.replace(
            config.model_spec,
            parallelize_fn=functools.partial(parallelize_llama, flex_shard=config.flex_shard))
        super().__init__(config)
        if 0 < max_norm < math.inf:  # the first optimizer steps first: clip before it
            clip_before_step(next(iter(self.optimizers)), list(self.model_parts), max_norm)
