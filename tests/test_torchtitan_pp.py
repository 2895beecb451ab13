"""torchtitan's pipeline parallelism with flex_shard per stage: PP 2 x DP 2 on 4 CPU
ranks, torchtitan's Llama 3 debugmodel cut to 2 layers (SDPA attention), split by
torchtitan's own stage split and run by torch's 1F1B and Interleaved1F1B schedules;
against one process on the global batch and against torchtitan's own FSDP2 + PP on
the same model: losses, first-step grads, params after SGD steps."""

from __future__ import annotations

import copy
import functools
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as torchtitan_parallel_dims
from torchtitan.distributed import pipeline_parallel as titan_pp
from torchtitan.models.llama3 import config_registry as llama3_configs

import flexshard as fs
from flexshard.integrations.torchtitan import FlexShardConfig, parallelize_decoder
from flexshard.integrations.torchtitan.pipeline import pipeline_decoder
from flexshard.integrations.torchtitan.trainer import clip_grad_norm_over_parts_
from flexshard.runtime.state import get_state
from harness import run_world
from test_torchtitan import VOCAB, debugmodel_config

pytestmark = pytest.mark.world

PP, DP, STEPS, LR = 2, 2, 3, 0.5
LAYERS, ROWS, SEQ = 2, 4, 16  # ROWS per dp rank, microbatches of one row


def model_config():
    cfg = debugmodel_config()
    cfg.layers = cfg.layers[:LAYERS]
    return cfg


@functools.lru_cache(maxsize=1)
def _pristine() -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_config().build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def rows(dp_rank: int, step: int) -> torch.Tensor:
    """This dp rank's batch at `step`: ROWS token rows of SEQ + 1."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)


def loss_fn(pred, labels, global_valid_tokens):
    """torchtitan's loss contract: (summed cross-entropy / global token count, extra)."""
    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    return loss / global_valid_tokens, None


def reference() -> tuple:
    """One process on every dp rank's rows: (losses, step-0 grads, params)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = copy.deepcopy(_pristine())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, first = [], None
        for step in range(STEPS):
            batch = torch.cat([rows(d, step) for d in range(DP)])
            loss, _ = loss_fn(model(batch[:, :-1]), batch[:, 1:], batch[:, 1:].numel())
            loss.backward()
            if step == 0:
                first = {k: p.grad.clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, first, {k: p.detach().clone() for k, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _configs(schedule: str, reshard: str) -> tuple:
    training = TrainingConfig(local_batch_size=ROWS, mixed_precision_param="float32")
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=PP, data_parallel_shard_degree=DP,
        pipeline_parallel_schedule=schedule, pipeline_parallel_microbatch_size=1,
        fsdp_reshard_after_forward=reshard, spmd_backend="partial_dtensor")
    dims = ParallelDims(dp_replicate=1, dp_shard=DP, cp=1, tp=1, pp=PP, ep=1,
                        world_size=PP * DP, spmd_backend="partial_dtensor")
    return training, parallelism, dims


def _fsdp2_parallelize(model, **kwargs):
    """torchtitan's own Llama 3 parallelize (FSDP2); gloo has no PREMUL_SUM, so its
    divide factor of 1 runs as FSDP2's plain sum (the same gradients)."""
    from torch.distributed.fsdp import FSDPModule

    model = llama3_configs.llama3_debugmodel().model_spec.parallelize_fn(model, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model


def train_pipelined(schedule: str, reshard: str, flexshard: bool) -> dict:
    """Rank body: build torchtitan's PP stages (flexshard's or FSDP2's), train."""
    import torch.distributed as dist

    training, parallelism, dims = _configs(schedule, reshard)
    kwargs = dict(parallel_dims=dims, training=training, parallelism=parallelism,
                  compile_config=CompileConfig(), ac_config=None, dump_folder="",
                  device=torch.device("cpu"), model_config=model_config(), loss_fn=loss_fn)
    with mock.patch.object(torchtitan_parallel_dims, "device_type", "cpu"):  # CPU meshes
        if flexshard:
            out = pipeline_decoder(copy.deepcopy(_pristine()), **kwargs, parallelize_fn=(
                functools.partial(parallelize_decoder, flex_shard=FlexShardConfig())))
        else:
            out = titan_pp.pipeline_llm(copy.deepcopy(_pristine()),
                                        parallelize_fn=_fsdp2_parallelize, **kwargs)
    schedule_obj, parts, has_first, has_last = out
    dp_rank = dims.get_mesh("fsdp").get_local_rank()
    params = [p for m in parts for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses, first = [], None
    for step in range(STEPS):
        batch = rows(dp_rank, step)
        mb_losses = [] if has_last else None
        schedule_obj.step(batch[:, :-1] if has_first else None,
                          target=batch[:, 1:] if has_last else None, losses=mb_losses,
                          loss_kwargs={"global_valid_tokens": DP * ROWS * SEQ})
        if step == 0:
            first = _full(parts, grads=True, flexshard=flexshard)
            _reset_counters(parts, flexshard)  # after the stages' shape inference
            if flexshard:  # FlexShardTrainer's clip: the norm over every stage and dp rank
                norm = clip_grad_norm_over_parts_(parts, math.inf,
                                                  dims.get_mesh("pp").get_group()).item()
        opt.step()
        opt.zero_grad()
        total = torch.stack(mb_losses).sum() if has_last else torch.zeros(())
        dist.all_reduce(total)  # the last stages' dp ranks hold the pieces of the loss
        losses.append(total.item())
    counts = _counts(parts) if flexshard else None  # before the state dict's gathers
    return {"losses": losses, "first": first, "params": _full(parts, flexshard=flexshard),
            "stages": [type(s).__name__ for s in _stages(schedule_obj)], "counts": counts,
            "norm": norm if flexshard else None}


def _reset_counters(parts, flexshard: bool) -> None:
    for part in parts if flexshard else ():
        for bucket in get_state(part).buckets:
            bucket.counters.reset()


def _counts(parts) -> dict:
    """Per bucket: (gathers, reduce-scatters) since the counters were reset."""
    return {f"{i}/{b.name}": (b.counters.gathers, b.counters.reduces)
            for i, part in enumerate(parts) for b in get_state(part).buckets}


def _stages(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _full(parts, *, flexshard: bool, grads: bool = False) -> dict:
    """Every part's full params (or grads), by their names in the whole model."""
    out = {}
    for part in parts:
        saved = {id(p): p.detach().clone() for p in part.parameters()}
        if grads:
            with torch.no_grad():
                for p in part.parameters():
                    p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        if flexshard:
            out.update(fs.full_state_dict(part))
        else:
            out.update({k: p.full_tensor().detach().clone() for k, p in part.named_parameters()})
        if grads:
            with torch.no_grad():
                for p in part.parameters():
                    p.copy_(saved[id(p)])
    return out


def _merged(results) -> dict:
    """Losses (the same on every rank) and the params of every stage."""
    first, params = {}, {}
    for r in results:
        first.update(r["first"])
        params.update(r["params"])
    return {"losses": results[0]["losses"], "first": first, "params": params}


@pytest.mark.parametrize("schedule, reshard", [("1F1B", "default"), ("Interleaved1F1B", "always")])
def test_pipeline_matches_one_process_and_fsdp2(schedule, reshard):
    ref_losses, ref_first, ref_params = reference()
    ours = run_world(PP * DP, train_pipelined, schedule, reshard, True, timeout=300)
    theirs = _merged(run_world(PP * DP, train_pipelined, schedule, reshard, False, timeout=300))
    assert {s for r in ours for s in r["stages"]} == {"FlexShardStage"}
    got = _merged(ours)
    # the clip's norm: over every stage's full grads (checked against the reference below);
    # fs.clip_grad_norm_ sums each shard's squares in float32, lm_head's ~3e-5 off on CPU
    norm = torch.stack([g.double().norm() for g in got["first"].values()]).norm().item()
    assert [r["norm"] for r in ours] == [pytest.approx(norm, rel=1e-4)] * PP * DP
    microbatches, later_steps = ROWS, STEPS - 1
    for r in ours:
        for name, (gathers, reduces) in r["counts"].items():
            assert reduces == later_steps, name  # once per step: the last microbatch's backward
            if reshard == "default":  # kept unsharded from the first forward to the last backward
                assert gathers == later_steps, name
            else:  # gathered for each microbatch's forward
                assert gathers >= microbatches * later_steps, name
    for want in ({"losses": ref_losses, "first": ref_first, "params": ref_params}, theirs):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for field in ("first", "params"):
            assert got[field].keys() == want[field].keys()
            for k, v in want[field].items():
                torch.testing.assert_close(got[field][k], v, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, k=k: f"{field} {k}: {m}")


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_split_backward_schedules_are_refused(schedule):
    from flexshard.integrations.torchtitan.pipeline import check_schedule

    with pytest.raises(NotImplementedError, match=rf"schedule {schedule}: its backward runs as "
                       r"separate input and weight passes.*use one of 1F1B, GPipe"):
        check_schedule(ParallelismConfig(pipeline_parallel_schedule=schedule))


def test_csv_schedule_is_refused():
    from flexshard.integrations.torchtitan.pipeline import check_schedule

    with pytest.raises(NotImplementedError, match=r"pipeline_parallel_schedule_csv: a CSV"):
        check_schedule(ParallelismConfig(pipeline_parallel_schedule_csv="order.csv"))
