"""flex_shard's contract with the user: same module, local shards, autograd grads,
gradient accumulation without sync, full state dicts, mixed-precision dtypes."""

from __future__ import annotations

import torch

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import assert_rel_close, make_model, reference_run


def wrap_facts() -> dict:
    """Rank body: what wrapping does to the module."""
    import torch.distributed as dist
    from flexshard.runtime.state import get_state

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    full_shapes = {k: p.shape for k, p in model.named_parameters()}
    same = fs.flex_shard(model) is model
    local = {k: tuple(p.shape) for k, p in model.named_parameters()}
    expected = {k: tuple(torch.empty(s).chunk(world)[rank].shape) if len(torch.empty(s).chunk(world)) > rank
                else (0, *s[1:]) for k, s in full_shapes.items()}
    runners = sorted(type(h.module).__name__ for h in get_state(model).hooks)
    return {"same": same, "isinstance": isinstance(model, fs.FlexShardModule),
            "local_ok": local == expected, "runners": runners,
            "names": [b.name for b in get_state(model).buckets]}


def test_wrap_returns_same_module_with_local_shards():
    for facts in run_world(3, wrap_facts):
        assert facts["same"] and facts["isinstance"] and facts["local_ok"]
        # The smallest modules that run each bucket: the two blocks and the root.
        assert facts["runners"] == ["Block", "Block", "FlexShardTinyGPT"]
        assert facts["names"] == ["layers.0", "layers.1", "root"]


def hooks_fire() -> list:
    """Rank body: post-accumulate-grad hooks on sharded params see reduced grads."""
    import torch.distributed as dist

    model = fs.flex_shard(make_model())
    seen = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, n=name: seen.append((n, q.grad is not None)))
    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    return sorted(seen)


def test_post_accumulate_grad_hooks_fire():
    names = sorted(k for k, _ in make_model().named_parameters())
    for seen in run_world(2, hooks_fire):
        assert [n for n, _ in seen] == names
        assert all(ok for _, ok in seen)


def accumulate(microbatches: int) -> dict:
    """Rank body: one optimizer-free step of `microbatches` accumulated micro-batches,
    only the last one synced; returns full grads assembled on rank 0."""
    import torch.distributed as dist
    from reference import sharded_grads

    model = fs.flex_shard(make_model())
    for micro in range(microbatches):
        model.set_requires_gradient_sync(micro == microbatches - 1)
        x, y = batch(micro, dist.get_rank())
        loss_fn(model(x), y).backward()
    return sharded_grads(model)


def test_no_sync_accumulates_the_sum():
    from reference import assemble_grads

    results = run_world(2, accumulate, 2)
    grads = assemble_grads([(None, None, r) for r in results])
    model = make_model()
    for micro in range(2):
        xs, ys = zip(*(batch(micro, r) for r in range(2)))
        loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-5, atol=1e-7)


def state_dict_round_trip() -> bool:
    """Rank body: full_state_dict then load_full_state_dict into a fresh wrap."""
    trained = fs.flex_shard(make_model(seed=1))
    full = fs.full_state_dict(trained)
    fresh = fs.flex_shard(make_model(seed=2))
    fs.load_full_state_dict(fresh, full)
    again = fs.full_state_dict(fresh)
    ref = dict(make_model(seed=1).named_parameters())
    return all(torch.equal(again[k], full[k]) and torch.equal(full[k], ref[k]) for k in ref)


def test_full_state_dict_round_trip():
    assert run_world(3, state_dict_round_trip) == [True] * 3


def mixed_precision_dtypes() -> dict:
    """Rank body: dtypes seen inside and outside forward under a bf16 policy."""
    import torch.distributed as dist

    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    root_mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    buckets = [fs.BucketSpec("layers.0.*"), fs.BucketSpec("layers.1.*"),
               fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], mp_policy=root_mp)]
    model = fs.flex_shard(make_model(), mp_policy=mp, buckets=buckets)
    inside = []
    model.layers[0].up.register_forward_pre_hook(lambda m, a: inside.append(m.weight.dtype))
    x, y = batch(0, dist.get_rank())
    out = model(x)
    loss_fn(out, y).backward()
    return {"inside": inside, "out": out.dtype,
            "params": {p.dtype for p in model.parameters()},
            "grads": {p.grad.dtype for p in model.parameters()}}


def test_mixed_precision_dtypes():
    for facts in run_world(2, mixed_precision_dtypes):
        assert set(facts["inside"]) == {torch.bfloat16}  # forward, then the recompute
        assert facts["out"] == torch.float32
        assert facts["params"] == facts["grads"] == {torch.float32}


def test_single_process_without_process_group():
    """No process group at all: world size 1, plain parity with the reference."""
    model = fs.flex_shard(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x, y = batch(step, 0)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ref_losses, ref_params, _ = reference_run(1, 3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for k, p in model.named_parameters():
        assert_rel_close(p.detach(), ref_params[k], 1e-5, k)


def test_one_wrapped_class_per_original_class():
    a, b = fs.flex_shard(torch.nn.Linear(3, 2)), fs.flex_shard(torch.nn.Linear(4, 2))
    c = fs.flex_shard(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    assert type(a) is type(b)  # cached, as FSDP2 does: not one new class per call
    assert type(a).__name__ == "FlexShardLinear" and type(a).__mro__[1:3] == (fs.FlexShardModule,
                                                                               torch.nn.Linear)
    assert type(c) is not type(a) and isinstance(c, torch.nn.Sequential)
