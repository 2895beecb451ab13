"""Gather groups: a large Shard(0) param gets a collective of its own whose output is
the param (no copy-out), the rest of its bucket one packed group; the groups of a
bucket launch as one coalesced collective. Parity with the one-process reference
trained with SGD (a wrong gradient scale shows), at even and uneven worlds."""

from __future__ import annotations

import math

import pytest
import torch

import flexshard as fs
from flexshard.planning.layout import SOLO_MIN_BYTES, SlotPlan, plan_layout
from reference import check_parity, make_model

# TinyGPT with every block matrix at least SOLO_MIN_BYTES in fp32 (proj: exactly 64 KiB)
BIG = {"dim": 128, "hidden": 512, "heads": 4}
SGD_LR = 0.05


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=SGD_LR)


def _slot(fqn: str, shape: tuple, world: int, placement=None, dtype=torch.float32) -> SlotPlan:
    placement = (placement or fs.Shard(0)).bind(torch.Size(shape), dtype.itemsize, world,
                                                (0,) * world)
    shapes = tuple(placement.local_shape(torch.Size(shape), r, world) for r in range(world))
    return SlotPlan(fqn, torch.Size(shape), dtype, placement, shapes)


def _layout(slots, world):
    return plan_layout(slots, [s.dtype for s in slots], world)


def test_a_large_shard0_param_is_its_own_group_and_a_view_of_its_block():
    world = 3
    slots = [_slot("norm", (128,), world), _slot("w", (301, 128), world),  # 101, 101, 99 rows
             _slot("v", (256, 128), world), _slot("b", (7,), world)]  # 86, 86, 84 rows
    layout = _layout(slots, world)
    assert len(layout.spans) == 3  # w, v alone; norm and b packed
    assert [reg.group for reg in layout.regions] == [2, 0, 1, 2]
    for j in (1, 2):
        start, stop = layout.block(layout.regions[j].group)
        span = layout.gathered_range(j)
        assert span == (start, start + math.prod(slots[j].shape) * 4)  # the block's front
        rows = slots[j].shape[0]
        assert stop - span[1] == (-(-rows // world) * world - rows) * 128 * 4  # padding: its end
    assert layout.gathered_range(0) is None and layout.gathered_range(3) is None
    # the groups tile the segment, and every gap of the gathered buffer is padding
    assert layout.spans[0][0] == 0 and layout.spans[-1][1] == layout.segment_bytes
    assert all(a[1] == b[0] for a, b in zip(layout.spans, layout.spans[1:]))
    gaps = sum(b - a for a, b in layout.gaps())
    assert gaps == layout.wire_bytes - layout.ideal_bytes


def test_small_params_and_other_placements_stay_packed():
    world = 2
    small = math.isqrt(SOLO_MIN_BYTES // 4) - 1
    slots = [_slot("small", (small, small), world), _slot("owned", (256, 128), world, fs.Owned()),
             _slot("cols", (128, 256), world, fs.Shard(1))]
    layout = _layout(slots, world)
    assert layout.groups == () and len(layout.spans) == 1  # one collective, as before
    assert _layout(slots, 1).groups == ()  # world 1: every param is a view already


@pytest.mark.parametrize("world", [2, 3])
def test_fp32_trains_as_one_process(world):
    results = check_parity(world, {}, make_opt=sgd, model_kw=BIG)
    _assert_solo_params_were_not_copied(results, torch.float32)


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_gathers_fp32_reduce_train_as_one_process(world):
    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results = check_parity(world, {"mp_policy": mp}, make_opt=sgd, model_kw=BIG,
                           param_dtype=torch.bfloat16)
    _assert_solo_params_were_not_copied(results, torch.bfloat16)


def test_kept_params_train_as_one_process():
    check_parity(3, {"reshard_after_forward": False}, make_opt=sgd, model_kw=BIG)


def test_int_reshard_regathers_each_group_within_its_post_forward_group():
    results = check_parity(4, {"reshard_after_forward": 2}, make_opt=sgd, model_kw=BIG)
    blocks = [b for b in results[0][3]["buckets"] if b[0].startswith("layers")]
    assert all(counters["post_forward_gathers"] > 0 for _, _, counters, _, _ in blocks)


def mixed(fqn, param):
    """Shard(0) for the large matrices, Owned for the mlp's down, Shard(1) for qkv."""
    if fqn.endswith("qkv.weight"):
        return fs.Shard(1)
    if fqn.endswith("down.weight"):
        return fs.Owned()
    return fs.Shard(0)


def test_a_mixed_bucket_trains_as_one_process_at_an_uneven_world():
    results = check_parity(3, {"placement": mixed}, make_opt=sgd, model_kw=BIG)
    layout = next(b[3] for b in results[0][3]["buckets"] if b[0].startswith("layers"))
    assert 1 < len(layout.spans) < len(layout.regions)


def test_offloaded_storage_trains_as_one_process():
    check_parity(2, {"offload_policy": fs.OffloadPolicy()}, make_opt=sgd, model_kw=BIG)


def _assert_solo_params_were_not_copied(results, dtype) -> None:
    """Each block bucket has solo groups, and each of its gathers copied out exactly
    the params that are no view of the gather output (those of its packed group):
    the solo ones cost no copy."""
    for name, _, counters, layout, _ in results[0][3]["buckets"]:
        if not name.startswith("layers"):
            continue
        assert {reg.dtype for reg in layout.regions} == {dtype}
        solo = [j for j, reg in enumerate(layout.regions)
                if sum(r.group == reg.group for r in layout.regions) == 1
                and len(layout.spans) > 1]
        large = [j for j, reg in enumerate(layout.regions) if sum(reg.nbytes) >= SOLO_MIN_BYTES]
        assert solo == large and len(solo) >= 3, f"{name}: solo regions {solo}, large {large}"
        assert all(layout.gathered_range(j) is not None for j in solo)
        # the packed params are columns of the packed group, padded to rank 0's piece
        copied = sum(reg.nbytes[0] * layout.world_size for j, reg in enumerate(layout.regions)
                     if layout.gathered_range(j) is None)
        assert counters["gathers"] > 0
        assert counters["copy_out_bytes"] == copied * counters["gathers"], name


def test_the_dry_run_shows_each_buckets_collectives_and_copy_out():
    plan = fs.describe(make_model(**BIG), mesh_shape=(1, 4))
    block = plan.buckets[0]
    assert block.name == "layers.0" and block.gather_groups == 1 + sum(block.solo)
    matrices = [fqn for fqn, shape in zip(block.params, block.shapes) if len(shape) == 2]
    assert [fqn for fqn, alone in zip(block.params, block.solo) if alone] == matrices
    sizes = dict(make_model(**BIG).named_parameters())
    assert block.copy_out_bytes == sum(sizes[f].numel() * 4 for f, alone
                                       in zip(block.params, block.solo) if not alone)
    text = str(plan)
    assert f"layers.0: {block.gather_groups} collective(s) per gather, copy-out" in text
    assert text.count("gathered alone (a view)") == sum(sum(b.solo) for b in plan.buckets)


def _train_save_load(root: str, save_grouped: bool, load_world_grouped: bool) -> dict:
    """Train one step and save with gather groups on or off (off: the one-group
    layout every checkpoint before them was written from), then load into a fresh
    model with the other setting: the loaded params and AdamW state equal the saved."""
    import torch.distributed as dist

    from flexshard.planning import layout

    from reference import adamw
    from models import batch, loss_fn

    default = layout.SOLO_MIN_BYTES
    try:
        layout.SOLO_MIN_BYTES = default if save_grouped else 1 << 62
        model = fs.flex_shard(make_model(**BIG))
        opt = adamw(model)
        x, y = batch(0, dist.get_rank())
        loss_fn(model(x), y).backward()
        opt.step()
        fs.save_checkpoint(root, model, opt, step=1)
        saved = fs.full_state_dict(model)
        layout.SOLO_MIN_BYTES = default if load_world_grouped else 1 << 62
        fresh = fs.flex_shard(make_model(seed=1, **BIG))
        fresh_opt = adamw(fresh)
        loss_fn(fresh(x), y).backward()
        fresh_opt.step()  # AdamW state to load into
        fresh_opt.zero_grad()
        assert fs.load_checkpoint(root, fresh, fresh_opt) == 1
        loaded = fs.full_state_dict(fresh)
        groups = [len(b.gather.layout.spans) for b in fs_buckets(fresh)]
        state = all(torch.equal(opt.state[a][k], fresh_opt.state[b][k])
                    for a, b in zip(model.parameters(), fresh.parameters()) if a.numel()
                    for k in ("exp_avg", "exp_avg_sq"))
        return {"equal": all(torch.equal(saved[k], loaded[k]) for k in saved),
                "state": state, "groups": groups}
    finally:
        layout.SOLO_MIN_BYTES = default


def fs_buckets(model):
    from flexshard.runtime.state import get_state

    return get_state(model).buckets


@pytest.mark.parametrize("save_grouped", [False, True])
def test_checkpoints_load_across_the_one_group_and_grouped_layouts(tmp_path, save_grouped):
    from harness import run_world

    results = run_world(2, _train_save_load, str(tmp_path), save_grouped, not save_grouped,
                        timeout=180)
    for r in results:
        assert r["equal"] and r["state"]
        assert max(r["groups"]) > 1 if save_grouped is False else max(r["groups"]) == 1
