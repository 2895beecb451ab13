"""torchtitan's pipeline parallelism with flex_shard on each stage.

`pipeline_decoder` is torchtitan's `pipeline_llm` (same signature, so it drops into a
`ModelSpec` as `pipelining_fn`) with one change: each stage is a `FlexShardStage`,
which makes the calls torch's schedules make on an FSDP2 stage, in flexshard's terms:

- FSDP2's `set_requires_gradient_sync(False)` on every microbatch's backward but the
  last: flexshard's own setter, so backward sums the unreduced grads and the last
  microbatch's backward reduce-scatters that sum once per step;
- FSDP2's `set_reshard_after_backward(False)` with parameters kept unsharded from
  the first forward to the last backward (torchtitan's PP default,
  `--parallelism.fsdp_reshard_after_forward default`): `module.unshard()` before the
  first microbatch's forward, `module.reshard()` after the last microbatch's
  backward: one gather per stage per step;
- FSDP2's `reshard()` after the stage's shape inference (a real forward and
  backward): flexshard's `reshard()`, and the grads it left are dropped.

Schedules that split backward into input and weight passes (zero bubble, DualPipeV)
need a reduction per weight pass; they are refused, as are CSV schedules.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import pipeline_parallel as titan_pp

import flexshard as fs

# The schedules whose every backward is a full one (torch's "full" backward type).
FULL_BACKWARD_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS")


class FlexShardStage(PipelineStage):
    """A pipeline stage whose submodule is flex-sharded over the data-parallel mesh
    (see the module docstring). `hold`: keep the stage's parameters unsharded from
    the first microbatch's forward to the last one's backward."""

    def __init__(self, *args, hold: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold = hold

    def _flex(self) -> Optional[fs.FlexShardModule]:
        return self.submod if isinstance(self.submod, fs.FlexShardModule) else None

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None,
                          save_forward_output: bool = True):
        model = self._flex()
        if model is not None and self.hold and fwd_chunk_id == 0 and self.has_backward:
            model.unshard()  # FSDP2 under PP: unsharded until the last backward
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict,
                                   last_backward: bool = False):
        model = self._flex()
        if model is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full":
            raise NotImplementedError(
                f"stage {self.stage_index}: a {backward_type!r} backward (a zero-bubble "
                "schedule) is not supported with flex_shard; use --parallelism."
                f"pipeline_parallel_schedule one of {', '.join(FULL_BACKWARD_SCHEDULES)}")
        # FSDP2's set_requires_gradient_sync: reduce-scatter once, in the last backward
        model.set_requires_gradient_sync(last_backward)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            if last_backward:
                model.set_requires_gradient_sync(True)
                if self.hold:
                    model.reshard()

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        model = self._flex()
        if model is not None:  # shape inference ran a real forward and backward
            model.reshard()
            for p in model.parameters():
                p.grad = None


def check_schedule(parallelism) -> None:
    """NotImplementedError for a pipeline schedule flex_shard's stages cannot run."""
    if parallelism.pipeline_parallel_schedule_csv:
        raise NotImplementedError(
            "--parallelism.pipeline_parallel_schedule_csv: a CSV schedule may split backward "
            "into input and weight passes; flex_shard runs "
            f"--parallelism.pipeline_parallel_schedule {' / '.join(FULL_BACKWARD_SCHEDULES)}")
    name = parallelism.pipeline_parallel_schedule
    schedule = get_schedule_class(name)
    if schedule.__name__ not in {get_schedule_class(n).__name__ for n in FULL_BACKWARD_SCHEDULES}:
        raise NotImplementedError(
            f"--parallelism.pipeline_parallel_schedule {name}: its backward runs as separate "
            "input and weight passes, which flex_shard's per-bucket reduction does not follow; "
            f"use one of {', '.join(FULL_BACKWARD_SCHEDULES)}")


def pipeline_decoder(model: nn.Module, *, parallel_dims: ParallelDims, training, parallelism,
                     compile_config, ac_config, dump_folder: str, device: torch.device,
                     model_config, parallelize_fn, loss_fn) -> tuple:
    """torchtitan's `pipeline_llm` with FlexShardStage stages: split `model` into
    torchtitan's stages, apply `parallelize_fn` (flexshard's) to each, build the
    schedule. Returns (schedule, model parts, has first stage, has last stage)."""
    check_schedule(parallelism)
    pp_mesh = parallel_dims.get_mesh("pp")
    n_stages, n_layers, first_weight, last_weight = titan_pp._get_pipeline_metadata(
        parallel_dims, parallelism, model_config)
    names = parallelism.module_fqns_per_model_part or titan_pp._generate_llm_fqn_per_model_part(
        n_stages, n_layers, first_weight, last_weight)
    indices = titan_pp._get_pp_rank_to_stage_indices_mapping(
        pp_mesh.get_local_rank(), pp_mesh.size(), parallelism.pipeline_parallel_schedule,
        len(names))
    hold = _keeps_unsharded(parallelism)
    stages, parts = [], []
    for index in indices:
        part = parallelize_fn(titan_pp._split_module(model, names[index]),
                              parallel_dims=parallel_dims, training=training,
                              parallelism=parallelism, compile_config=compile_config,
                              ac_config=ac_config, dump_folder=dump_folder)
        stages.append(FlexShardStage(part, index, len(names), device, hold=hold,
                                     group=pp_mesh.get_group("pp"),
                                     get_mesh=titan_pp._build_get_mesh_callback(parallel_dims)))
        parts.append(part)
    schedule = titan_pp._build_pipeline_schedule(
        parallelism=parallelism, local_batch_size=training.local_batch_size, stages=stages,
        loss_fn=loss_fn)
    return (schedule, parts, any(s.is_first for s in stages), any(s.is_last for s in stages))


def _keeps_unsharded(parallelism) -> bool:
    """torchtitan's reshard-after-forward policy under PP: "default" and "never" keep
    the parameters unsharded between microbatches (as its FSDP2 path)."""
    return parallelism.fsdp_reshard_after_forward != "always"
