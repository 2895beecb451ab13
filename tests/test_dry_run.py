"""describe(module, mesh_shape=(R, S), ...): the plan of a mesh one does not have.

Its predictions are checked against real wraps at 2 and 4 ranks (bytes the
buckets hold and count after training steps must match exactly), against
closed forms on Llama-3 shapes built on the meta device, and, for R > 1,
against the (1, S) plan it extends."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs
from flexshard.planning.layout import ALIGN
from flexshard.runtime.state import get_state
from harness import run_world
from models import batch, loss_fn
from reference import make_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import plan_cluster  # noqa: E402

BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def mixed(fqn, param):
    """All four kinds in one model: Owned vectors, Shard(1) (not rank-major),
    RaggedShard in the first block, Shard(0) elsewhere."""
    if param.dim() == 1:
        return fs.Owned()
    if fqn.endswith("up.weight"):
        return fs.Shard(1)
    if fqn.startswith("layers.0."):
        return fs.RaggedShard()
    return fs.Shard(0)


PLACEMENTS = {"shard": fs.Shard(0), "owned": fs.Owned(), "ragged": fs.RaggedShard(), "mixed": mixed}


class Case(NamedTuple):
    placement: str
    reshard: object  # bool, or int N: backward regathers within groups of N ranks
    bf16: bool = False
    frozen: bool = False  # `pos` frozen, in a bucket of its own
    tied: bool = False  # the LM head shares the embedding's weight
    int8: bool = False  # the block matrices gathered as int8 (fs.QuantizedGather), in bf16

    def options(self) -> dict:
        out = {"placement": PLACEMENTS[self.placement], "reshard_after_forward": self.reshard}
        if self.bf16:
            out["mp_policy"] = BF16
        if self.int8:
            out["mp_policy"] = fs.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                gather_format=fs.QuantizedGather(min_numel=64))
        if self.frozen:
            out["buckets"] = [fs.BucketSpec("pos", name="pos"), fs.BucketSpec("layers.*", name="blocks"),
                              fs.BucketSpec(["tok.*", "norm.*", "head.*"], name="root")]
        return out

    def model(self) -> nn.Module:
        model = make_model(tied=self.tied)
        if self.frozen:
            model.pos.requires_grad_(False)
        return model


CASES = ([Case(p, r) for p in PLACEMENTS for r in (True, False)]
         + [Case("mixed", True, bf16=True), Case("shard", True, frozen=True),
            Case("ragged", True, tied=True), Case("shard", 2), Case("mixed", 2),
            Case("shard", True, int8=True), Case("owned", False, int8=True)])


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _step_counts(model, buckets, opt, step: int) -> dict:
    """One training step; per bucket what it moved and the grads and AdamW state it holds."""
    for b in buckets:
        b.counters.reset()
    x, y = batch(step, dist.get_rank())
    loss_fn(model(x), y).backward()
    grads = {b.name: _bytes(p.grad for p in b.params) for b in buckets}
    opt.step()
    adamw = {b.name: _bytes(opt.state[p][k] for p in b.params if p in opt.state
                            for k in ("exp_avg", "exp_avg_sq")) for b in buckets}
    opt.zero_grad()
    return {b.name: (b.counters.gather_wire_bytes, b.counters.reduce_wire_bytes,
                     b.counters.discarded_prefetches, grads[b.name], adamw[b.name],
                     b.counters.copy_out_bytes / max(b.counters.gathers, 1)) for b in buckets}


def predicted_and_measured(case: Case) -> tuple:
    """Rank body: the dry run of the unwrapped model, then the real wrap's
    plan, storage, local bytes and two training steps' counts."""
    model = case.model()
    dry = fs.describe(model, mesh_shape=(1, dist.get_world_size()), **case.options())
    fs.flex_shard(model, **case.options())
    buckets = get_state(model).buckets
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = [_step_counts(model, buckets, opt, step) for step in range(2)]
    storage = {b.name: b.storage.buffer.numel() for b in buckets}
    local = {b.name: _bytes(b.params) for b in buckets}
    return dry, fs.describe(model), storage, local, steps


@pytest.mark.world
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[
    f"{c.placement}-reshard{c.reshard}" + "".join(f"-{k}" for k in ("bf16", "frozen", "tied", "int8")
                                                  if getattr(c, k)) for c in CASES])
def test_dry_run_matches_a_real_wrap(world, case):
    results = run_world(world, predicted_and_measured, case)
    dry = results[0][0]
    assert dry.mesh_shape == (1, world) and dry.world_size == world
    for rank, (rank_dry, wrapped, storage, local, steps) in enumerate(results):
        assert rank_dry == dry
        assert wrapped == dry  # every field of every bucket, as flex_shard built it
        for b in dry.buckets:
            assert storage[b.name] == b.storage_bytes[rank]
            assert local[b.name] == b.local_bytes[rank]
            for counts in steps:  # the first step (no prefetch) and the second (prefetched)
                assert counts[b.name][:5] == (b.gather_wire_bytes, b.reduce_wire_bytes, 0,
                                              b.grad_bytes[rank], 2 * b.grad_bytes[rank])
                # copied out per gather: the plan's, and at most the gather's padding more
                # (a fused copy-out writes a padded column whole)
                copied = counts[b.name][5]
                assert b.copy_out_bytes <= copied <= b.copy_out_bytes + b.padding_bytes, \
                    (b.name, copied, b.copy_out_bytes, b.padding_bytes)
    assert dry.gathers_per_step == sum(1 + (case.reshard and b.module != "") for b in dry.buckets
                                       if b.module is not None)
    assert dry.all_reduces_per_step == 0 and dry.replicate_wire_bytes == 0
    per_rank = [sum(b.grad_bytes[r] for b in dry.buckets) for r in range(world)]
    assert dry.grad_bytes == (min(per_rank), max(per_rank)) and max(per_rank) > 0
    assert dry.adamw_bytes == (2 * min(per_rank), 2 * max(per_rank))
    per_rank = [sum(r[2].values()) for r in results]
    assert dry.param_bytes == (min(per_rank), max(per_rank))


@pytest.mark.parametrize("shards", [1, 2, 4])
@pytest.mark.parametrize("case", [Case("shard", True), Case("mixed", False, bf16=True),
                                  Case("owned", True, frozen=True)])
def test_replicas_keep_the_shard_dim_and_all_reduce_the_reduce_segment(shards, case):
    model = case.model()
    flat = fs.describe(model, mesh_shape=(1, shards), **case.options())
    named = dict(model.named_parameters())
    trainable = {f for f, p in named.items() if p.requires_grad}
    for replicas in (2, 16):
        hsdp = fs.describe(model, mesh_shape=(replicas, shards), **case.options())
        assert hsdp.mesh_shape == (replicas, shards) and hsdp.world_size == replicas * shards
        for b, f in zip(hsdp.buckets, flat.buckets):
            # (1, 1) without a cast needs no hooks; (R, 1) does, for the all-reduce
            assert b._replace(all_reduces_per_step=0, all_reduce_bytes=0,
                              all_reduce_rank_bytes=(0,) * shards) == f._replace(
                module=b.module if shards == 1 else f.module)
            assert b.all_reduce_bytes == max(b.all_reduce_rank_bytes)
            grads = any(p in trainable for p in b.params)
            assert b.all_reduces_per_step == int(grads)
            if shards > 1:  # the reduce-scatter's input is S reduce segments; whole tensors
                # (Owned) reduce with no padding, each rank's output its own range
                held = b.all_reduce_bytes * shards * b.reduces_per_step
                if all(isinstance(pl, fs.Owned) for pl in b.placements):
                    assert held >= b.reduce_wire_bytes
                else:
                    assert held == b.reduce_wire_bytes
            # The segment holds the largest rank's trainable fp32 pieces, each
            # starting on a multiple of ALIGN (16) bytes: at most ALIGN - 1 gap each;
            # a Shard param's uneven pieces may each take rank 0's (largest) bytes.
            def segment(padded: bool) -> int:
                return max(sum(4 * math.prod(pl.local_shape(
                    named[f].shape, 0 if padded and isinstance(pl, fs.Shard) else r, shards))
                    for f, pl in zip(b.params, b.placements) if f in trainable)
                    for r in range(shards))

            expected, most = segment(False), segment(True)
            pieces = sum(f in trainable for f in b.params)
            if grads:
                assert expected <= b.all_reduce_bytes <= most + (ALIGN - 1) * pieces
            else:
                assert b.all_reduce_bytes == 0
        # the rank that all-reduces most: its own buckets' bytes summed, no more (Owned's
        # heaviest rank differs from bucket to bucket)
        per_rank = [sum(b.all_reduce_rank_bytes[r] for b in hsdp.buckets) for r in range(shards)]
        assert hsdp.replicate_wire_bytes == max(per_rank) > 0
        assert max(per_rank) <= sum(b.all_reduce_bytes for b in hsdp.buckets)


def test_a_world_of_one_shard_group_is_plain_data_parallelism():
    model = make_model()
    plan = fs.describe(model, mesh_shape=(8, 1))
    assert plan.gathers_per_step == plan.reduces_per_step == plan.shard_wire_bytes == 0
    assert plan.all_reduces_per_step == len(plan.buckets)
    full = sum(p.numel() * 4 for p in model.parameters())
    assert plan.grad_bytes == (full, full)
    # Storage and the all-reduced segment: every param whole, each starting on ALIGN bytes.
    n = len(list(model.parameters()))
    assert plan.replicate_wire_bytes == plan.param_bytes[0]
    assert full <= plan.param_bytes[0] <= full + (ALIGN - 1) * n
    # One rank, no cast: flex_shard installs no hooks, nothing moves.
    alone = fs.describe(model, mesh_shape=(1, 1))
    assert all(b.module is None for b in alone.buckets) and alone.replicate_wire_bytes == 0


def test_llama3_8b_on_the_meta_device_matches_closed_forms():
    model = plan_cluster.meta_llama("8B")
    numel = sum(p.numel() for p in model.parameters())
    assert numel == 8_030_261_248  # Llama-3 8B
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    for mesh_shape in plan_cluster.MESHES:
        plan = plan_cluster.plan(model, mesh_shape, fs.Shard(0))
        shards = mesh_shape[1]  # every dim of Llama-3 8B divides by 8: no padding
        assert plan.param_bytes == plan.grad_bytes == (numel * 4 // shards,) * 2
        assert plan.adamw_bytes == (numel * 8 // shards,) * 2
        # bf16 gathers, twice for the blocks (reshard after forward); fp32 reduce-scatters
        gathers = (2 * blocks + (numel - blocks)) * 2
        assert plan.shard_wire_bytes == gathers + numel * 4
        assert plan.replicate_wire_bytes == numel * 4 // shards
        assert (plan.gathers_per_step, plan.reduces_per_step, plan.all_reduces_per_step) == (65, 33, 33)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated, nothing wrapped
    assert not isinstance(model, fs.FlexShardModule)


def test_llama3_70b_plans_every_placement():
    model = plan_cluster.meta_llama("70B")
    assert sum(p.numel() for p in model.parameters()) == 70_553_706_496  # Llama-3 70B
    plans = {name: plan_cluster.plan(model, (128, 8), pl) for name, pl in plan_cluster.PLACEMENTS.items()}
    assert plans["Shard(0)"].param_bytes == plans["RaggedShard"].param_bytes
    # Owned keeps whole matrices: ranks hold unequal bytes, but each rank's storage is
    # its own pieces (as its grads are), not its bucket's largest owner's segment.
    owned, shard = plans["Owned"], plans["Shard(0)"]
    assert owned.param_bytes == owned.grad_bytes
    assert owned.param_bytes[0] < shard.param_bytes[0] < owned.param_bytes[1]
    assert len(plans["Owned"].buckets) == 81


def test_the_llama_example_runs_a_forward():
    shape = plan_cluster.LlamaShape(dim=32, layers=2, heads=4, kv_heads=2, hidden=48, vocab=50)
    torch.manual_seed(0)
    logits = plan_cluster.Llama(shape)(torch.randint(0, 50, (2, 7)))
    assert logits.shape == (2, 7, 50) and torch.isfinite(logits).all()


def test_the_docs_table_is_the_examples_output():
    page = (Path(__file__).resolve().parent.parent / "docs" / "dry-run.md").read_text()
    assert plan_cluster.markdown_table() in page


def test_print_shows_a_table_and_the_totals():
    text = str(fs.describe(make_model(), mesh_shape=(2, 3), placement=fs.RaggedShard()))
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["bucket", "module", "params"]
    assert "shard wire" in lines[0] and "replicate wire" in lines[0]
    assert [line.split()[0] for line in lines[2:5]] == ["layers.0", "layers.1", "root"]
    assert "world size 6 as mesh (replicate 2, shard 3): 5 all-gathers and 3 reduce-scatters" in text
    assert "per rank: params " in text and "AdamW state" in text and "replicate dim" in text


def test_byte_columns_name_their_unit():
    plan = fs.describe(make_model(), mesh_shape=(2, 3), placement=fs.RaggedShard())
    header, _, first = str(plan).splitlines()[:3]
    columns = re.split(r"\s{2,}", header)
    cells = dict(zip(columns, re.split(r"\s{2,}", first)))
    bucket = plan.buckets[0]
    assert cells["unsharded (B)"] == f"{bucket.unsharded_bytes:,}"
    assert cells["padding (B)"] == f"{bucket.padding_bytes:,}"
    assert cells["shard wire (B/step)"] == f"{bucket.gather_wire_bytes + bucket.reduce_wire_bytes:,}"
    assert cells["replicate wire (B/step)"] == f"{bucket.all_reduce_bytes:,}"
    byte_columns = [c for c, v in cells.items() if re.fullmatch(r"[\d,]+(\.\.[\d,]+)?", v)
                    and c not in ("params", "gathers", "reduces", "all-reduces")]
    assert len(byte_columns) == 6 and all(c.endswith(("(B)", "(B/step)")) for c in byte_columns)


def test_the_short_table_leaves_out_the_parameters_only():
    plan = fs.describe(make_model(), mesh_shape=(1, 3), placement=fs.RaggedShard())
    full, short = str(plan).splitlines(), plan.table(per_param=False).splitlines()
    listing = full[len(short) - 3:-3]  # str(): each bucket's name, then its parameters
    assert [line.split(":")[0] for line in listing if not line.startswith("  ")] == [
        b.name for b in plan.buckets]
    assert [line.split()[0] for line in listing if line.startswith("  ")] == [
        fqn for b in plan.buckets for fqn in b.params]
    assert full[:len(short) - 3] + full[-3:] == short  # the rest, in order
    assert short[-3:] == plan.summary().splitlines()


def test_describe_keeps_reading_a_wrapped_module_at_world_size_one():
    model = fs.flex_shard(make_model(), mp_policy=BF16)
    plan = fs.describe(model)
    assert plan == fs.describe(make_model(), mesh_shape=(1, 1), mp_policy=BF16)
    assert plan.mesh_shape == (1, 1) and all(b.module is not None for b in plan.buckets)


@pytest.mark.parametrize("mesh_shape, exc, match", [
    ((2,), ValueError, r"mesh_shape must have two entries \(replicate, shard\), got \(2,\)"),
    ((1, 2, 2), ValueError, r"mesh_shape must have two entries"),
    ((0, 4), ValueError, r"mesh_shape's replicate size must be >= 1, got 0; pass mesh_shape=\(R, S\)"),
    ((2, -1), ValueError, r"mesh_shape's shard size must be >= 1, got -1"),
    ((2, 2.0), TypeError, r"mesh_shape's shard size must be an int, got 2.0"),
    ((True, 2), TypeError, r"mesh_shape's replicate size must be an int, got True"),
    (8, TypeError, r"mesh_shape must be a tuple of two ints, got 8"),
    ("1x8", TypeError, r"mesh_shape must be a tuple of two ints, got '1x8'"),
])
def test_bad_mesh_shapes(mesh_shape, exc, match):
    with pytest.raises(exc, match=match):
        fs.describe(make_model(), mesh_shape=mesh_shape)


def test_bad_options_raise_clear_errors():
    model = make_model()
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['comm'\]; a dry run "
                                        "takes mesh_shape and flex_shard's buckets, placement"):
        fs.describe(model, mesh_shape=(1, 2), comm=fs.Comm())
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['placements'\]"):
        fs.describe(model, mesh_shape=(1, 2), placements=fs.Shard(0))
    with pytest.raises(ValueError, match="got both mesh= and mesh_shape=; .* drop mesh="):
        fs.describe(model, mesh_shape=(1, 2), mesh=object())
    with pytest.raises(ValueError,
                       match=r"takes mesh_shape=\(R, S\), not mesh=.*mesh_shape=\(1, n\) for a 1-D mesh"):
        fs.describe(model, mesh=object())
    with pytest.raises(ValueError, match=r"flex_shard options \['placement'\] without mesh_shape"):
        fs.describe(model, placement=fs.Owned())
    with pytest.raises(TypeError, match="not wrapped by flex_shard; .* or pass mesh_shape"):
        fs.describe(model)
    with pytest.raises(TypeError, match="describe expects an nn.Module, got str"):
        fs.describe("model", mesh_shape=(1, 2))
    # as flex_shard's on a (2, 2) mesh: the placements split over the shard group
    with pytest.raises(ValueError, match=r"Owned\(rank=3\) is outside the world of 2 rank\(s\).* "
                                         r"\(under HSDP placements split over the shard group, dim 1 "
                                         r"of the \(2, 2\) mesh: 2 rank\(s\)\)"):
        fs.describe(model, mesh_shape=(2, 2), placement=fs.Owned(rank=3))


def test_bad_flex_shard_options_raise_as_flex_shard_does():
    model = make_model()
    with pytest.raises(TypeError, match="placement 'shard' is not a Placement or a callable"):
        fs.describe(model, mesh_shape=(1, 2), placement="shard")
    with pytest.raises(TypeError, match="reshard_after_forward must be a bool or an int, got 2.0"):
        fs.describe(model, mesh_shape=(1, 2), reshard_after_forward=2.0)
    with pytest.raises(ValueError, match=r"bucket 'layers.0': reshard_after_forward=3 does not "
                                         r"divide its shard group of 4 rank\(s\); pass a divisor of 4"):
        fs.describe(model, mesh_shape=(2, 4), reshard_after_forward=3)
    with pytest.raises(TypeError, match="mp_policy must be a fs.MixedPrecisionPolicy"):
        fs.describe(model, mesh_shape=(1, 2), mp_policy=torch.bfloat16)
    with pytest.raises(ValueError, match="buckets is empty"):
        fs.describe(model, mesh_shape=(1, 2), buckets=[])
    with pytest.raises(ValueError, match="parameter 'pos' matches no BucketSpec"):
        fs.describe(model, mesh_shape=(1, 2), buckets=[fs.BucketSpec("layers.*")])
    with pytest.raises(ValueError, match=r"parameter 'layers.0.norm1.weight' in bucket 'layers.0': "
                                         r"Shard\(dim=1\) is out of range"):
        fs.describe(model, mesh_shape=(1, 2), placement=fs.Shard(1))
    with pytest.raises(ValueError, match="no parameters to shard"):
        fs.describe(nn.ReLU(), mesh_shape=(1, 2))


def test_a_wrapped_module_is_not_dry_run():
    model = fs.flex_shard(make_model())
    with pytest.raises(ValueError, match="'<root>' is already wrapped by flex_shard .* dry-run a fresh copy"):
        fs.describe(model, mesh_shape=(1, 2))
    outer = nn.Sequential(model)
    with pytest.raises(ValueError, match="'0' is already wrapped by flex_shard"):
        fs.describe(outer, mesh_shape=(1, 2))
