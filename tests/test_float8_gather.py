"""torchao float8 training with fp8 all-gathers (FSDP2's tensor-subclass
extension, `Float8LinearConfig(enable_fsdp_float8_all_gather=True)`) through
flexshard's one collective per bucket: the same losses, first-step grads and
params as FSDP2 + torchao on the same model and data (fp32 and a bf16 param
dtype), the same all-gathered bytes, high-precision weights in the state dict,
and a clear error where the subclass cannot gather (an empty piece)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from test_fused_copies import CopyCount

STEPS, LR = 3, 0.1


class Blocks(nn.Module):
    """Two residual MLP blocks and a head; widths multiples of 16 (fp8 matmuls)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)) for _ in range(2))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(self.norm(x))


def float8_model(fp8_gather: bool = True) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Blocks()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_gather)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_to_float8_training(model, config=config)


def data(step: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g)


def _wrap(kind: str, model: nn.Module, param_dtype, offload: bool = False) -> nn.Module:
    if kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype)
        for layer in model.layers:
            fully_shard(layer, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)
    buckets = [fs.BucketSpec("layers.0.*"), fs.BucketSpec("layers.1.*"),
               fs.BucketSpec(["norm.*", "head.*"], name="root")]
    return fs.flex_shard(model, buckets=buckets,
                         mp_policy=fs.MixedPrecisionPolicy(param_dtype=param_dtype),
                         offload_policy=fs.OffloadPolicy() if offload else None)


def _gathered_bytes(meter) -> int:
    return sum(n for kind, n in meter.events if "gather" in kind or "broadcast" in kind)


def _train(kind: str, param_dtype, fp8_gather: bool = True, offload: bool = False) -> tuple:
    """Rank body: SGD steps; (losses, full first-step grads, full params, gathered bytes per step)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict)

    from benchmarks.harness.meters import TrafficMeter

    rank = dist.get_rank()
    model = _wrap(kind, float8_model(fp8_gather), param_dtype, offload)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, gathered = [], None, []
    full = StateDictOptions(full_state_dict=True)
    for step in range(STEPS):
        x, y = data(step, rank)
        with TrafficMeter() as meter:
            loss = (model(x).float() - y).square().mean()
            loss.backward()
        gathered.append(_gathered_bytes(meter))
        if step == 0:
            grads = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                     for k, v in _grads(model).items()}
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    params = {k: v.float() for k, v in get_model_state_dict(model, options=full).items()}
    return losses, grads, params, gathered


def _grads(model) -> dict:
    """Full first-step grads, FQN -> tensor, for either library."""
    import torch.distributed as dist

    from flexshard import compat
    from flexshard.runtime.state import find_state

    state = find_state(model)
    if state is None:
        return {k: p.grad for k, p in model.named_parameters()}
    out = {}
    for bucket in state.buckets:
        for slot, p in zip(bucket.slots, bucket.params):
            pieces = [torch.empty(s, dtype=p.grad.dtype) for s in slot.local_shapes]
            flat = [t.reshape(-1) for t in pieces]
            sizes = [t.numel() for t in flat]
            buf = torch.zeros(max(sizes) * len(sizes), dtype=p.grad.dtype)
            compat.all_gather_single(buf, torch.nn.functional.pad(  # 2.11 and 2.13's name
                p.grad.reshape(-1), (0, max(sizes) - p.grad.numel())))
            pieces = [buf[r * max(sizes):r * max(sizes) + n].view(s)
                      for r, (n, s) in enumerate(zip(sizes, slot.local_shapes))]
            out[slot.fqn] = slot.placement.unshard(pieces, slot.shape)
    return out


def _both(param_dtype, offload: bool = False) -> dict:
    return {kind: _train(kind, param_dtype, offload=offload and kind == "flexshard")
            for kind in ("fsdp2", "flexshard")}


@pytest.mark.parametrize("param_dtype,offload", [(None, False), (torch.bfloat16, False),
                                                 (None, True)],
                         ids=["fp32", "bf16", "fp32-offload"])
def test_matches_fsdp2_with_torchao_and_gathers_as_many_bytes(param_dtype, offload):
    # offloaded, each gather casts the shards' staged copy (FSDP2 runs without offload)
    results = run_world(2, _both, param_dtype, offload)[0]
    ref, got = results["fsdp2"], results["flexshard"]
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-6, atol=1e-6)
    for k, g in ref[1].items():
        torch.testing.assert_close(got[1][k], g, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert got[2].keys() == ref[2].keys()
    for k, v in ref[2].items():
        torch.testing.assert_close(got[2][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert got[3] == ref[3]  # the same all-gathered bytes in every step


def _plain_vs_fp8() -> tuple:
    return _train("flexshard", None, fp8_gather=False)[3], _train("flexshard", None)[3]


def test_the_fp8_gather_moves_fewer_bytes_than_the_fp32_one():
    plain, fp8 = run_world(2, _plain_vs_fp8)[0]
    assert all(f < 0.45 * p for f, p in zip(fp8, plain))  # fp8 matrices, fp32 biases and norm


def _owned():
    return fs.flex_shard(float8_model(), placement=fs.Owned())


def test_an_owned_float8_weight_is_refused_on_every_rank():
    expect_all_ranks_raise(2, _owned, ValueError,
                           r"WeightWithDynamicFloat8CastTensor.*empty piece.*"
                           r"fs\.Shard\(0\) or fs\.RaggedShard\(\)")


class _NoDtype(torch.Tensor):
    """A subclass with FSDP2's gather hooks whose context names no wire dtype."""

    def __tensor_flatten__(self):
        return ["_inner"], {}

    def fsdp_pre_all_gather(self, mesh):
        raise AssertionError("never called: refused at wrap")


def test_a_subclass_without_a_readable_wire_dtype_is_refused_at_wrap():
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(torch.Tensor._make_subclass(_NoDtype, model.weight.detach()))
    with pytest.raises(NotImplementedError, match="parameter 'weight' is a _NoDtype.*"
                                                  "unwrap it to a plain tensor"):
        fs.flex_shard(model)


class _NoOut(torch.Tensor):
    """A subclass with FSDP2's gather hooks whose post-all-gather takes no `out`."""

    def __tensor_flatten__(self):
        return ["_inner"], {"dtype": torch.float8_e4m3fn}

    def fsdp_pre_all_gather(self, mesh):
        raise AssertionError("never called: refused at wrap")

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype):
        raise AssertionError("never called: refused at wrap")


def test_a_subclass_whose_post_all_gather_takes_no_out_is_refused_at_wrap():
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(torch.Tensor._make_subclass(_NoOut, model.weight.detach()))
    with pytest.raises(NotImplementedError, match=r"parameter 'weight' is a _NoOut whose "
                                                  r"fsdp_post_all_gather takes no `out`.*"
                                                  r"\*, out=None\)"):
        fs.flex_shard(model)


class _TwoInputs:
    """Stands for a subclass whose pre-all-gather hands back two tensors."""

    @classmethod
    def __tensor_unflatten__(cls, inners, ctx, size, stride):
        return cls()

    def fsdp_pre_all_gather(self, mesh):
        return (torch.zeros(2, 4), torch.zeros(2)), None


def test_a_pre_all_gather_of_another_shape_is_refused():
    from flexshard.placements.subclass import SubclassGather

    fmt = SubclassGather(_TwoInputs, "_data", {}, torch.float8_e4m3fn, torch.float32)
    out = torch.empty(2, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match=r"_TwoInputs.fsdp_pre_all_gather returned "
                                                  r"\[\(2, 4\), \(2,\)\]; flexshard gathers one"):
        fmt.encode(torch.zeros(2, 4), [out], None)


def _save_load(directory: str) -> tuple:
    """Rank body: train 2 steps, save, keep training 1 step; a new model loads
    the checkpoint and trains the same step: (both losses, max param difference)."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def step(model, opt, i):
        x, y = data(i, rank)
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model = _wrap("flexshard", float8_model(), None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):
        step(model, opt, i)
    fs.save_checkpoint(directory, model, opt, step=2)
    saved = {k: v.clone() for k, v in fs.full_state_dict(model).items()}
    first = step(model, opt, 2)
    fresh = _wrap("flexshard", float8_model(), None)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert fs.load_checkpoint(directory, fresh, fresh_opt) == 2
    loaded = fs.full_state_dict(fresh)
    diff = max((loaded[k].float() - v.float()).abs().max().item() for k, v in saved.items())
    dtypes = {str(v.dtype) for v in loaded.values()}
    return first, step(fresh, fresh_opt, 2), diff, dtypes


def test_checkpoints_hold_the_high_precision_weights(tmp_path):
    for first, again, diff, dtypes in run_world(2, _save_load, str(tmp_path)):
        assert dtypes == {"torch.float32"} and diff == 0.0
        assert again == first  # the optimizer state came back too


def _compiled_vs_eager() -> tuple:
    """Rank body: the same SGD steps with each block compiled (block.compile(), the
    gather staying in flexshard's hooks) and eager: (losses, params, compiled graphs
    each step ran) of each."""
    from compile_check import compiled_graph_calls

    # a fresh dynamo cache: a block class another test's world body compiled (with
    # other shapes) would recompile with dynamic shapes, in more graphs per block
    torch._dynamo.reset()
    out = []
    for compiled in (False, True):
        model = _wrap("flexshard", float8_model(), None)
        if compiled:
            for layer in model.layers:
                layer.compile()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, graph_calls = [], []
        for step in range(2):
            x, y = data(step, torch.distributed.get_rank())
            loss = (model(x) - y).square().mean()
            graph_calls.append(compiled_graph_calls(loss))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.append((losses, fs.full_state_dict(model), graph_calls,
                    len(model.layers) if compiled else 0))
    return out


def test_compiled_blocks_with_fp8_gathers_match_eager():
    for eager_run, comp_run in run_world(2, _compiled_vs_eager, timeout=300):
        (eager_losses, eager), (comp_losses, comp) = eager_run[:2], comp_run[:2]
        for _, _, graph_calls, blocks in (eager_run, comp_run):  # each block's graph ran
            assert graph_calls == [blocks] * 2, graph_calls
        torch.testing.assert_close(torch.tensor(comp_losses), torch.tensor(eager_losses),
                                   rtol=1e-5, atol=1e-6)
        for k, v in eager.items():
            torch.testing.assert_close(comp[k], v, rtol=1e-5, atol=1e-6, msg=k)


# A bucket's float8 weights are cast together (placements/float8.py): one amax
# all-reduce and one cast per bucket, bit for bit torchao's cast weight by weight.


class _OpCount(TorchDispatchMode):
    """Ops dispatched, and collectives among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.collectives = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += func.namespace != "profiler"
        self.collectives += "all_reduce" in func.__name__ or "allreduce" in func.__name__
        return func(*args, **(kwargs or {}))


def _linears(n: int, bias: bool = False, same: bool = False) -> nn.Module:
    """`n` float8 Linears (fp8 gathers) of varied shapes (or one) in one bucket."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(1)
    sizes = [32 if same else 32 + 16 * (i % 3) for i in range(n)]
    model = nn.Sequential(*[nn.Linear(size, size, bias=bias) for size in sizes])
    for i, layer in enumerate(model):  # amaxes far apart, and one all-zero weight
        layer.weight.data.mul_(10.0 ** (i - 2))
    model[0].weight.data.zero_()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_to_float8_training(model, config=config)


def _encode_both(n: int, bias: bool, param_dtype, same: bool = False) -> tuple:
    """Rank body: the bucket's gather input written by the batch and by each
    weight's own fsdp_pre_all_gather: (bytes equal, scales equal, ops and
    collectives of each)."""
    model = fs.flex_shard(_linears(n, bias, same), mp_policy=fs.MixedPrecisionPolicy(
        param_dtype=param_dtype))
    from flexshard.runtime.state import find_state

    bucket = find_state(model).buckets[0]
    wires = bucket.gather.plans_for(bucket.gather.layout).wires
    assert len(wires.batches) == 1 and len(wires.batches[0].members) == n
    mesh = bucket.gather.shard_mesh(torch.device("cpu"))
    views = bucket.storage.views
    fused = torch.zeros(bucket.gather.layout.segment_bytes, dtype=torch.uint8)
    alone = fused.clone()
    wires.encode(fused, views, mesh)  # the first one puts its index tensor on the device
    with _OpCount() as batched:
        wires.encode(fused, views, mesh)
    fused_scales = [w.meta[1][0].clone() for w in wires if not w.cast]
    with _OpCount() as each:
        for wire, view in zip(wires, views):
            wire.encode(alone, view, mesh)
    alone_scales = [w.meta[1][0] for w in wires if not w.cast]
    same_scales = all(torch.equal(a, b) and a.shape == b.shape
                      for a, b in zip(fused_scales, alone_scales))
    return (torch.equal(fused, alone), same_scales, (batched.ops, batched.collectives),
            (each.ops, each.collectives))


def _encode_cases() -> dict:
    """Rank body: _encode_both for buckets of 1, 2, 4 and 8 fp32 weights of one
    shape and of varied shapes, and of 5 weights with biases gathered in bf16."""
    cases = {n: _encode_both(n, False, None, same=True) for n in (1, 2, 4, 8)}
    cases.update({f"varied-{n}": _encode_both(n, False, None) for n in (2, 4, 8)})
    cases["bias-bf16"] = _encode_both(5, True, torch.bfloat16)
    return cases


def test_a_bucket_casts_bit_for_bit_in_ops_that_do_not_grow_with_its_weights():
    # weights of one shape are cast as one chunk (placements/batch.py); weights of
    # varied shapes a chunk per run of one size, each bit for bit the per-weight path
    for cases in run_world(2, _encode_cases):
        assert all(same_bytes and same_scales for same_bytes, same_scales, _, _ in cases.values())
    counts = {n: c[2:] for n, c in cases.items() if isinstance(n, int)}
    ops = {n: c[0][0] for n, c in counts.items()}
    # within 1 op: pieces in their layout's order are written by one copy, else by
    # a split and a split_with_sizes_copy
    assert max(ops.values()) - min(ops.values()) <= 1, ops
    assert all(c[0][1] == 1 for c in counts.values())  # one amax all-reduce per bucket
    each = {n: c[1] for n, c in counts.items()}  # the per-weight path, for the record
    assert each[8] == (8 * each[1][0], 8) and each[1][0] > 10, each


def _amax_all_reduces() -> tuple:
    """Rank body: all-reduces in each of two training steps, and the float8 buckets."""
    from flexshard.runtime.state import find_state

    model = _wrap("flexshard", float8_model(), None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    counts = []
    for step in range(2):
        x, y = data(step, torch.distributed.get_rank())
        with _OpCount() as mode:
            (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
        counts.append(mode.collectives)
    buckets = sum(any(not w.cast for w in b.gather.plans_for(b.gather.layout).wires)
                  for b in find_state(model).buckets)
    return counts, buckets


def test_backward_regathers_with_the_scales_forward_computed():
    # the layers reshard after forward and regather in backward: one amax
    # all-reduce per float8 bucket and step, as FSDP2 + torchao's precompute
    # makes one per step (parity with it: the tests above); and one more a step, the
    # ranks' agreement on what trains (RankAgreement)
    for counts, buckets in run_world(2, _amax_all_reduces):
        assert buckets == 3 and counts == [buckets + 1, buckets + 1]


# A bucket's fp8 weights come out of the gather as the bf16 params do (planning/fused.py):
# their fp8 data is a column of one split_with_sizes_copy per bucket, not a copy each.

def _copy_out_ops(n: int) -> tuple:
    """Rank body: (copy-outs, copy ops by name) of one forward + backward (after a
    warm-up one) of `n` float8 Linears with fp8 gathers, one bucket, bf16 params."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(n)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = convert_to_float8_training(
            model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    fs.flex_shard(model, mp_policy=fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    model(x).float().sum().backward()
    with CopyCount() as mode:  # tests/test_fused_copies.py's counter, by copy label
        model(x).float().sum().backward()
    return len(mode.counts["out"]), dict(mode.names["out"])


def _copy_out_cases() -> dict:
    return {n: _copy_out_ops(n) for n in (2, 8)}


def test_fp8_weights_are_copied_out_in_one_op_per_bucket():
    # 4 ranks: each weight spans every rank, so none is chained into a view across a
    # rank boundary (planning/layout.py) and every weight is a column of the gathered
    # buffer. (At 2 ranks the largest is chained, a view, and the others copy one by one.)
    for cases in run_world(4, _copy_out_cases):
        for n, (copy_outs, names) in cases.items():
            # one gather (the root bucket keeps its params until backward): one split-copy
            # for all n weights
            assert copy_outs == 1 and names == {"split_with_sizes_copy": 1}, (n, names)


def _made_once() -> list:
    """Rank body: two SGD steps; per resharding bucket that gathers fp8 weights:
    (its params made once, the unsharded float8 weight is the same object in both
    steps' forwards)."""
    import torch.distributed as dist

    from flexshard.runtime.state import find_state

    model = _wrap("flexshard", float8_model(), None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    buckets = [b for b in find_state(model).buckets if b.gather.reshard_after_forward is True
               and any(not w.cast for w in b.gather.plans_for(b.gather.layout).wires)]
    seen = []
    for step in range(2):
        x, y = data(step, dist.get_rank())
        (model(x).float() - y).square().mean().backward()
        seen.append([id(b.gather.unsharded.params[0]) if b.gather.unsharded else None
                     for b in buckets])
        opt.step()
        opt.zero_grad()
    return [(b.gather.unsharded is not None, seen[0][i] == seen[1][i])
            for i, b in enumerate(buckets)]


def test_fp8_weights_are_renewed_in_params_made_once():
    # torchao's fsdp_post_all_gather(out=): the first gather makes the float8 weight
    # over the gather output, each later one renews its scale (parity: the FSDP2 test above)
    for flags in run_world(2, _made_once):
        assert len(flags) == 2 and all(made and same for made, same in flags), flags


# A weight placed Shard(1), or split unevenly by RaggedShard, is no view of the gather
# output: its fp8 data comes out through its copy plan, into a buffer made once that the
# float8 weight holds, so each refill's new scale meets the new bytes.

def _matrices_shard1(fqn: str, param: torch.Tensor):
    return fs.Shard(1) if param.dim() > 1 else fs.Shard(0)


_RESHARDING_PLACEMENTS = {"Shard(1)": _matrices_shard1,
                          "RaggedShard(units=(1, 3))": fs.RaggedShard(units=(1, 3))}


def _one_process_steps(steps: int, world: int) -> tuple:
    """The reference: the same float8 model in one process, each rank's batch in turn,
    the grads averaged; (mean loss per step, params after the last step)."""
    model = float8_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        total = 0.0
        for rank in range(world):
            x, y = data(step, rank)
            loss = (model(x) - y).square().mean() / world
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _placed_steps(placement, steps: int) -> tuple:
    """Rank body's part: SGD steps with both blocks' buckets (which reshard after forward)
    in `placement`; (mean loss per step, full params)."""
    import torch.distributed as dist

    buckets = [fs.BucketSpec("layers.0.*", placement=placement),
               fs.BucketSpec("layers.1.*", placement=placement),
               fs.BucketSpec(["norm.*", "head.*"], name="root")]
    model = fs.flex_shard(float8_model(), buckets=buckets)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = data(step, dist.get_rank())
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses, fs.full_state_dict(model)


def _placed_vs_one_process(steps: int) -> dict:
    """Rank body: {placement name or "reference": (losses, params)}."""
    out = {name: _placed_steps(p, steps) for name, p in _RESHARDING_PLACEMENTS.items()}
    out["reference"] = _one_process_steps(steps, torch.distributed.get_world_size())
    return out


def test_fp8_weights_that_view_no_gather_output_train_as_one_process():
    # 4 steps: from step 1 on a stale refill would pair step 0's fp8 bytes with the new scale
    for results in run_world(2, _placed_vs_one_process, 4):
        ref_losses, ref_params = results.pop("reference")
        for name, (losses, params) in results.items():
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                       rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
            assert params.keys() == ref_params.keys()
            for k, v in ref_params.items():
                torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, k=k: f"{n} {k}: {m}")
