"""A profile of a training step reads like the design: every gather, copy-in,
copy-out, reduce-scatter and all-reduce runs under a `FlexShard::` label
(named as FSDP2's `FSDP::` ones)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

import flexshard as fs
from harness import run_world

STEP_LABELS = {"FlexShard::all_gather", "FlexShard::all_gather_copy_in",
               "FlexShard::all_gather_copy_out", "FlexShard::reduce_scatter_copy_in",
               "FlexShard::reduce_scatter", "FlexShard::reduce_scatter_copy_out",
               "FlexShard::clip_grad_norm_all_reduce"}


def labels_of_a_step(hsdp: bool) -> set:
    """Rank body: the FlexShard:: labels a profiled step records."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2) if hsdp else
                            (dist.get_world_size(),))
    model = fs.flex_shard(model, mesh, buckets=[fs.BucketSpec("0.*"), fs.BucketSpec("2.*")],
                          mp_policy=fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.randn(8, 16)).float().square().mean().backward()
        fs.clip_grad_norm_(model, 1.0)
    return {e.name for e in prof.events() if e.name.startswith("FlexShard::")}


def test_every_collective_and_copy_of_a_step_is_labelled():
    for labels in run_world(2, labels_of_a_step, False):
        assert STEP_LABELS <= labels, STEP_LABELS - labels


def test_the_replicas_all_reduce_is_labelled():
    for labels in run_world(4, labels_of_a_step, True):
        assert "FlexShard::all_reduce" in labels


ACTIVATION_LABELS = {"FlexShard::activation_size_check", "FlexShard::activation_all_gather",
                     "FlexShard::activation_reduce_scatter", "FlexShard::activation_all_reduce",
                     "FlexShard::activation_all_to_all", "FlexShard::halo_plan",
                     "FlexShard::halo_exchange"}


def labels_of_activation_collectives() -> set:
    """Rank body: the FlexShard:: labels of each activation collective, forward and backward."""
    C = fs.collectives
    world = dist.get_world_size()
    sizes = [2] * world
    x = torch.randn(2, 3, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        plan = C.HaloPlan.from_send_index([[0]] * world, sizes)
        whole = C.gather_tensor(x, sizes, 0, full_grad=C.FullGrad.PARTIAL)  # reduce-scatters back
        y = C.all_to_all(whole[:, :1], sizes, 0, [1] * world, 1)
        z = C.halo_exchange(x, plan, include_local=True)
        (C.reduce_scatter_tensor(whole, None).sum() + y.sum() + z.sum()).backward()
    return {e.name for e in prof.events() if e.name.startswith("FlexShard::")}


def test_every_activation_collective_is_labelled():
    for labels in run_world(2, labels_of_activation_collectives):
        assert ACTIVATION_LABELS <= labels, ACTIVATION_LABELS - labels
