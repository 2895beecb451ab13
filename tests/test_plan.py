"""Automatic buckets (plan_buckets) and the plan report (describe)."""

from __future__ import annotations

import fnmatch

import pytest
import torch
import torch.nn as nn

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import make_model
from training_helpers import CountingComm, check_against_reference, train

STEPS = 3
SAMPLE = (torch.zeros(2, 11, dtype=torch.long),)


def _bytes(model, fqns) -> int:
    named = dict(model.named_parameters())
    return sum(named[f].numel() * named[f].element_size() for f in fqns)


def _members(model, specs) -> list:
    names = [f for f, _ in model.named_parameters()]
    return [[f for f in names if any(fnmatch.fnmatchcase(f, p) for p in s.patterns)] for s in specs]


@pytest.mark.parametrize("budget", [3000, 8000, 30000, 10 ** 9])
def test_plan_covers_every_param_once_within_budget(budget):
    model = make_model(layers=3)
    specs = fs.plan_buckets(model, budget, example_inputs=SAMPLE)
    members = _members(model, specs)
    flat = [f for m in members for f in m]
    assert sorted(flat) == sorted(f for f, _ in model.named_parameters())
    assert len(flat) == len(set(flat))
    for spec, fqns in zip(specs, members):
        owners = {f.rpartition(".")[0] for f in fqns}
        # Over budget only when the bucket is one module's own parameters.
        assert _bytes(model, fqns) <= budget or (len(owners) == 1 and spec.name in owners)
    assert len(specs) == len({s.name for s in specs})


def test_plan_groups_whole_blocks_when_they_fit():
    model = make_model(layers=3)
    block = _bytes(model, [f for f, _ in model.named_parameters() if f.startswith("layers.0.")])
    specs = fs.plan_buckets(model, block)
    assert [s.name for s in specs] == ["root", "layers.0", "layers.1", "layers.2"]
    assert fs.plan_buckets(model, 10 ** 9)[0].name == "root"


class Reordered(nn.Module):
    """Registers `late` before `early` but calls `early` first."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(8, 8)
        self.early = nn.Linear(8, 8)

    def forward(self, x):
        return self.late(self.early(x))


def test_traced_execution_order_beats_registration_order():
    model = Reordered()
    linear = 8 * 8 * 4 + 8 * 4
    assert [s.name for s in fs.plan_buckets(model, linear)] == ["late", "early"]
    traced = fs.plan_buckets(model, linear, example_inputs=(torch.zeros(1, 8),))
    assert [s.name for s in traced] == ["early", "late"]
    by_keyword = fs.plan_buckets(model, linear, example_inputs={"x": torch.zeros(1, 8)})
    assert by_keyword == traced  # as a Hugging Face model is called: input_ids=...


def test_plan_on_meta_device():
    with torch.device("meta"):
        model = make_model()
    sample = (torch.zeros(2, 11, dtype=torch.long, device="meta"),)
    assert fs.plan_buckets(model, 30000, example_inputs=sample) == fs.plan_buckets(make_model(), 30000)


def planned_training(budget: int) -> tuple:
    """Rank body: train with planned buckets; also the plan against measured counts."""
    comm = CountingComm()
    model = make_model(layers=3)
    specs = fs.plan_buckets(model, budget, example_inputs=SAMPLE)
    fs.flex_shard(model, buckets=specs, comm=comm)
    losses = train(model, STEPS)
    comm.reset()
    x, y = batch(0, torch.distributed.get_rank())
    loss_fn(model(x), y).backward()
    calls, plan = dict(comm.calls), fs.describe(model)
    return losses, fs.full_state_dict(model), calls, plan, str(plan)


@pytest.mark.parametrize("budget", [8000, 30000])
def test_planned_buckets_parity_and_report(budget):
    results = run_world(2, planned_training, budget)
    losses, full, calls, plan, text = results[0]
    check_against_reference(losses, full, 2, STEPS, model_kw={"layers": 3})
    for _, _, rank_calls, rank_plan, _ in results:
        assert rank_plan == plan
        assert rank_calls["all_gather"] == plan.gathers_per_step
        assert rank_calls["reduce_scatter"] == plan.reduces_per_step
    model = make_model(layers=3)
    named = dict(model.named_parameters())
    for b in plan.buckets:
        assert sum(b.local_bytes) == b.unsharded_bytes == _bytes(model, b.params)
        # fp32, no cast: the gather moves 2 segments, each at least the largest rank's
        # pieces (more where a piece starts on its 16-byte boundary); a rank's storage is
        # the segment, or its own pieces when padding would be over 1/16 of the segment.
        segment = max(b.storage_bytes)
        assert b.padding_bytes == 2 * segment - sum(b.local_bytes)
        for stored, local in zip(b.storage_bytes, b.local_bytes):
            assert local <= stored and (stored == segment or (segment - stored) * 16 > segment)
        assert b.shapes == tuple(tuple(named[f].shape) for f in b.params)
        assert b.placements == (fs.Shard(0),) * len(b.params)
        assert b.name in text and all(f in text for f in b.params)
    assert any(b.padding_bytes for b in plan.buckets)  # 37-row embedding over 2 ranks
    assert f"{plan.gathers_per_step} all-gathers and {plan.reduces_per_step} reduce-scatters" in text


def describe_facts() -> tuple:
    """Rank body: the report of the default buckets with and without reshard."""
    model = fs.flex_shard(make_model(), mp_policy=fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    plan = fs.describe(model)
    model.set_reshard_after_forward(False)
    return plan, fs.describe(model)


def test_describe_default_buckets():
    plan, no_reshard = run_world(2, describe_facts)[0]
    assert [(b.name, b.module, b.reshard_after_forward) for b in plan.buckets] == [
        ("layers.0", "layers.0", True), ("layers.1", "layers.1", True), ("root", "", False)]
    assert [b.gathers_per_step for b in plan.buckets] == [2, 2, 1]
    assert [b.gathers_per_step for b in no_reshard.buckets] == [1, 1, 1]
    assert all(set(b.gather_dtypes) == {torch.bfloat16} for b in plan.buckets)
    assert all(set(b.dtypes) == {torch.float32} for b in plan.buckets)
    assert all(b.unsharded_bytes * 2 == sum(b.local_bytes) for b in plan.buckets)  # bf16 wire


def test_plan_buckets_rejects_bad_input():
    model = make_model()
    with pytest.raises(ValueError, match="bucket_bytes must be positive, got 0"):
        fs.plan_buckets(model, 0)
    with pytest.raises(TypeError, match="bucket_bytes must be an int, got '1MB'"):
        fs.plan_buckets(model, "1MB")
    with pytest.raises(TypeError, match="example_inputs must be a tuple .* or a dict .* wrap a"):
        fs.plan_buckets(model, 1000, example_inputs=SAMPLE[0])
    with pytest.raises(TypeError, match="expects an nn.Module, got int"):
        fs.plan_buckets(3, 1000)
    with pytest.raises(ValueError, match="no parameters to bucket"):
        fs.plan_buckets(nn.ReLU(), 1000)
    fs.flex_shard(model)
    with pytest.raises(ValueError, match="already wrapped by flex_shard; plan first"):
        fs.plan_buckets(model, 1000)
    with pytest.raises(TypeError, match="not wrapped by flex_shard"):
        fs.describe(make_model())
