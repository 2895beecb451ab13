"""torchtitan's Trainer with flex_shard: a `--flex_shard.*` section, global-norm clipping
and the global norm logged."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

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


def clip_grad_norm_over_parts_(models, max_norm: float, pp_group=None) -> torch.Tensor:
    """`fs.clip_grad_norm_` over several flex-sharded models (the pipeline stages
    on this rank) and, with `pp_group`, over every pipeline rank's stages: the
    gradients are scaled so their global 2-norm is at most `max_norm`; returns that
    norm (before clipping), the same on every rank, as torchtitan's clip under FSDP2."""
    models = list(models)
    if len(models) == 1 and pp_group is None:
        return fs.clip_grad_norm_(models[0], max_norm)
    # each part's norm over its data-parallel mesh (max_norm inf: nothing clipped yet)
    total = torch.stack([fs.clip_grad_norm_(m, math.inf) for m in models]).square().sum()
    if pp_group is not None:
        with record_function("FlexShard::clip_grad_norm_pp_all_reduce"):
            dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in (p.grad for m in models for p in m.parameters() if p.grad is not None):
        grad.mul_(coef.to(grad.device, grad.dtype))  # offloaded grads live in host memory
    return total


class GlobalGradNorm:
    """An optimizer step pre-hook: clip every model part's gradients to a global norm
    of `max_norm` (inf: measure only) and keep that norm (`last`) for the log."""

    def __init__(self, models, max_norm: float, pp_group=None) -> None:
        self.models, self.max_norm, self.pp_group = list(models), max_norm, pp_group
        self.last: Optional[float] = None

    def __call__(self, *_) -> None:
        self.last = clip_grad_norm_over_parts_(self.models, self.max_norm, self.pp_group).item()

    def log_with_global_norm(self, log):
        """MetricsProcessor.log, logging this global norm as grad_norm in place of
        the one torchtitan measured (each rank's own shards)."""
        def logged(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            norm = grad_norm if self.last is None else self.last
            return log(step, global_avg_loss, global_max_loss, norm, extra_metrics=extra_metrics)
        return logged


def clip_before_step(optimizer, models, max_norm: float, pp_group=None) -> GlobalGradNorm:
    """Register a step pre-hook on `optimizer` that clips the gradients of the
    flex-sharded `models` (over `pp_group`'s pipeline ranks too) to a global norm of
    `max_norm`; returns the hook, which keeps the last norm."""
    hook = GlobalGradNorm(models, max_norm, pp_group)
    optimizer.register_step_pre_hook(hook)
    return hook


def schedule_takes_microbatches(schedule) -> bool:
    """Whether `schedule.step` takes the per-microbatch lists torchtitan 0.3.0 passes
    (`arg_mbs=`, `kwarg_mbs=`, `target_mbs=`); torch 2.13's schedules take the whole
    batch (`step(*args, target=, **kwargs)`) and split it themselves."""
    return "arg_mbs" in inspect.signature(schedule.step).parameters


def pp_whole_batch_step(trainer, input_dict_mbs: list, label_mbs: list,
                        global_valid_tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's `pp_forward_backward_step` through a schedule that takes the whole
    batch: the microbatches are joined along dim 0 (post-processed once, so attention
    masks cover the whole batch) and the schedule splits them back into the same
    microbatches, masks included (its default chunk spec: dim 0, equal chunks).
    Returns the summed loss on the last stage's ranks, -1 elsewhere, as torchtitan."""
    if len({len(labels) for labels in label_mbs}) != 1:
        raise ValueError(f"pipeline microbatches of unequal sizes {[len(x) for x in label_mbs]}: "
                         "the installed torch's schedule splits the batch into equal chunks")
    untensored = sorted(k for k, v in input_dict_mbs[0].items() if not isinstance(v, torch.Tensor))
    if untensored:
        raise NotImplementedError(f"pipeline inputs {untensored} are not tensors: they cannot be "
                                  "joined into the whole batch the installed torch's schedule takes")
    joined = {k: torch.cat([mb[k] for mb in input_dict_mbs]) for k in input_dict_mbs[0]}
    inputs, labels, extra_kwargs = trainer.post_dataloading_process(joined, torch.cat(label_mbs))
    losses = [] if trainer.pp_has_last_stage else None
    with trainer.train_context():
        trainer.pp_schedule.step(
            *((inputs,) if trainer.pp_has_first_stage else ()),
            target=labels if trainer.pp_has_last_stage else None, losses=losses,
            loss_kwargs={"global_valid_tokens": global_valid_tokens}, return_outputs=False,
            **extra_kwargs)
    if trainer.pp_has_last_stage:
        return torch.sum(torch.stack(losses)).to(trainer.device)
    return torch.tensor([-1.0], device=trainer.device)


class FlexShardTrainer(Trainer):
    """Trainer whose parallelize and pipelining functions are flexshard's,
    configured by `--flex_shard.*`.

    Gradient clipping: torchtitan's own clip sees only this rank's sharded
    gradients, so it is switched off (max_norm = inf) and the global norm over
    every rank and pipeline stage clips right before each optimizer step, with
    `--training.max_norm`; that global norm is the grad_norm torchtitan logs.

    Pipeline parallelism: torchtitan 0.3.0 steps its schedule with per-microbatch
    lists, which torch 2.13's schedules do not take ("Expecting N arg_mbs but got 1");
    where the installed schedule does not, the step goes through `pp_whole_batch_step`.
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
        pp_mesh = self.parallel_dims.get_optional_mesh("pp")
        # the first optimizer steps first: clip before it
        self.grad_norm = clip_before_step(
            next(iter(self.optimizers)), self.model_parts, max_norm if max_norm > 0 else math.inf,
            None if pp_mesh is None else pp_mesh.get_group())
        self.metrics_processor.log = self.grad_norm.log_with_global_norm(self.metrics_processor.log)

    def pp_forward_backward_step(self, *, input_dict_mbs, label_mbs, global_valid_tokens):
        if schedule_takes_microbatches(self.pp_schedule):
            return super().pp_forward_backward_step(
                input_dict_mbs=input_dict_mbs, label_mbs=label_mbs,
                global_valid_tokens=global_valid_tokens)
        return pp_whole_batch_step(self, input_dict_mbs, label_mbs, global_valid_tokens)

