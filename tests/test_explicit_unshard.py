"""Explicit control: module.unshard() / reshard() and set_reshard_after_forward."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import make_model
from training_helpers import CountingComm, check_against_reference, train

STEPS = 3


def unshard_step(async_op: bool):
    """A step function: unshard, forward + backward on the held params, reshard."""
    def step(model, i, x, y):
        handle = model.unshard(async_op=async_op)
        if async_op and i % 2 == 0:
            handle.wait()  # odd steps leave the wait to the forward pre-hook
        loss = loss_fn(model(x), y)
        loss.backward()
        model.reshard()
        return loss
    return step


def train_unsharded_explicitly(async_op: bool) -> tuple:
    """Rank body: train with explicit unshard/reshard around each step."""
    comm = CountingComm()
    model = fs.flex_shard(make_model(), comm=comm)
    comm.reset()  # flex_shard's check that the ranks agree is an all-reduce
    losses = train(model, STEPS, unshard_step(async_op))
    calls = dict(comm.calls)
    return losses, fs.full_state_dict(model), calls


@pytest.mark.parametrize("async_op", [False, True])
def test_explicit_unshard_parity_and_one_gather_per_bucket(async_op):
    results = run_world(2, train_unsharded_explicitly, async_op)
    losses, full, calls = results[0]
    check_against_reference(losses, full, 2, STEPS)
    # Held params: one gather per bucket per step (none in forward, none in backward).
    assert calls == {"all_gather": 3 * STEPS, "reduce_scatter": 3 * STEPS, "all_reduce": 0}


MAX_NORM = 0.05  # below TinyGPT's grad norms: every step clips


def clip_while_held(norms: list, same: list):
    """A step function: unshard, forward + backward, then torch's clip over
    model.parameters() while the params are still held (FSDP2's order), reshard."""
    def step(model, i, x, y):
        if hasattr(model, "unshard"):
            originals = dict(model.named_parameters())
            model.unshard()
            held = dict(model.named_parameters())
            same.append(held.keys() == originals.keys()
                        and all(held[k] is p for k, p in originals.items()))
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        if hasattr(model, "reshard"):
            model.reshard()
        return loss
    return step


def train_clipping_while_held() -> tuple:
    model = fs.flex_shard(make_model())
    norms, same = [], []
    losses = train(model, STEPS, clip_while_held(norms, same))
    return losses, fs.full_state_dict(model), norms, same


def test_torchs_clip_over_held_params_sees_the_sharded_grads():
    """While held, model.parameters() are the sharded params the optimizer steps
    (not the unsharded tensors the modules hold), so torch's clip sees their
    grads: before, it found no grad, returned 0 and clipped nothing."""
    results = run_world(2, train_clipping_while_held)
    ref_norms = []
    check_against_reference(results[0][0], results[0][1], 2, STEPS,
                            step_fn=clip_while_held(ref_norms, []))
    assert all(n > MAX_NORM for n in ref_norms)
    for _, _, norms, same in results:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        assert same == [True] * STEPS


def shapes_while_held() -> dict:
    """Rank body: what modules hold before, during and after an explicit unshard."""
    model = fs.flex_shard(make_model())
    up = model.layers[0].up
    before = tuple(up.weight.shape)
    handle = model.unshard(async_op=True)
    pending = tuple(up.weight.shape)
    handle.wait()
    held = tuple(up.weight.shape)
    x, y = batch(0, torch.distributed.get_rank())
    with torch.no_grad():
        model(x)
    after_forward = tuple(up.weight.shape)
    model.reshard()
    return {"before": before, "pending": pending, "held": held,
            "after_forward": after_forward, "resharded": tuple(up.weight.shape)}


def test_unshard_holds_full_params_until_reshard():
    full = tuple(make_model().layers[0].up.weight.shape)
    for facts in run_world(2, shapes_while_held):
        assert facts["before"] == facts["pending"] == facts["resharded"] != full
        assert facts["held"] == facts["after_forward"] == full


def forward_without_backward() -> tuple:
    """Rank body: a training forward never followed by backward, then reshard().
    layers.1 calls layers.0's `up`, so bucket layers.0 (run by the root) keeps
    its params on the modules for layers.1's recompute in a backward that never comes."""
    from test_frozen_tied import shared_block_model

    model = fs.flex_shard(shared_block_model())
    x, _ = batch(0, torch.distributed.get_rank())
    model(x)
    kept = tuple(model.layers[0].up.weight.shape), tuple(model.head.weight.shape)
    model.reshard()
    model.to("cpu")  # allowed again: every bucket is sharded
    return kept, tuple(model.layers[0].up.weight.shape)


def test_reshard_after_forward_without_backward():
    reference = make_model()
    up, head = tuple(reference.layers[0].up.weight.shape), tuple(reference.head.weight.shape)
    for (kept_up, kept_head), after in run_world(2, forward_without_backward):
        assert kept_up == up and after != up
        assert kept_head != head  # the root's own params reshard after forward as usual


def toggled_reshard() -> tuple:
    """Rank body: one step without, one with reshard-after-forward (root included)."""
    comm = CountingComm()
    model = fs.flex_shard(make_model(), comm=comm)
    calls = []
    for flag in (False, True):
        model.set_reshard_after_forward(flag)
        comm.reset()
        train(model, 1)
        calls.append(dict(comm.calls))
    return calls


def test_set_reshard_after_forward():
    for off, on in run_world(2, toggled_reshard):
        assert off["all_gather"] == 3  # each bucket once, kept for backward
        assert on["all_gather"] == 6  # every bucket (root too) regathers in backward
        assert off["reduce_scatter"] == on["reduce_scatter"] == 3


def toggled_parity() -> tuple:
    model = fs.flex_shard(make_model())

    def step(model, i, x, y):
        model.set_reshard_after_forward(i % 2 == 0)
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    return train(model, STEPS, step), fs.full_state_dict(model)


def test_toggling_reshard_keeps_parity():
    losses, full = run_world(2, toggled_parity)[0]
    check_against_reference(losses, full, 2, STEPS)


def step_while_held():
    model = fs.flex_shard(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.unshard()
    x, y = batch(0, torch.distributed.get_rank())
    loss_fn(model(x), y).backward()
    opt.step()
    model(x)


def bad_flag():
    fs.flex_shard(make_model()).set_reshard_after_forward("yes")


def bad_group():
    fs.flex_shard(make_model()).set_reshard_after_forward(3)


def bad_async():
    fs.flex_shard(make_model()).unshard(async_op="yes")


def state_dict_while_held():
    model = fs.flex_shard(make_model())
    model.unshard()
    fs.full_state_dict(model)


def test_misuse_raises_on_every_rank():
    expect_all_ranks_raise(2, state_dict_while_held, RuntimeError,
                           r"bucket '.*' is unsharded \(model.unshard\(\) holds it: call "
                           r"model.reshard\(\) first\)")
    expect_all_ranks_raise(2, step_while_held, RuntimeError,
                           r"bucket 'root': its sharded params changed .* module.reshard\(\)")
    expect_all_ranks_raise(2, bad_flag, TypeError,
                           r"set_reshard_after_forward: reshard_after_forward must be a bool or an int, got 'yes'")
    expect_all_ranks_raise(2, bad_group, ValueError,
                           r"bucket 'layers.0': reshard_after_forward=3 does not divide its shard group of 2")
    expect_all_ranks_raise(2, bad_async, TypeError, r"async_op to be a bool, got 'yes'")


# In-place writes to held params: the shards are the parameters, so reshard()
# drops such a write; it must say so (runtime/held.py), never silently.

WRITES = {
    "add_": lambda w: w.add_(1.0),  # any in-place op: the version counter
    "data_iadd": lambda w: w.data.__iadd__(1.0),  # PEFT merge_adapter(): w.data += delta
    "data_swap": lambda w: setattr(w, "data", w.data + 1.0),  # PEFT safe_merge: w.data = merged
    "one_element": lambda w: w[-1, -1].add_(1.0),  # rank 1's piece only: every rank still raises
}
DROPPED = (r"module.reshard\(\): parameter 'layers.0.up.weight' \(bucket 'layers.0'\) was written "
           r"in place while module.unshard\(\) held it unsharded, and that write was dropped.*"
           r"fs.load_full_state_dict\(model, sd\)")


def write_while_held(how: str, mp: bool = False):
    """Rank body: write one held param the same way on every rank, then reshard."""
    mp_policy = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else fs.MixedPrecisionPolicy()
    model = fs.flex_shard(make_model(), mp_policy=mp_policy)
    model.unshard()
    with torch.no_grad():
        WRITES[how](model.layers[0].up.weight)
    model.reshard()


@pytest.mark.parametrize("how", sorted(WRITES))
def test_write_to_held_param_raises_on_every_rank(how):
    # A write only in rank 1's piece: rank 0 cannot tell which of the params sharing
    # the gather output's version counter it was, so it names all of them.
    match = DROPPED if how != "one_element" else (
        DROPPED.replace("'layers.0.up.weight'", "'[^']+'").replace(r"\) was", r"\).* was"))
    expect_all_ranks_raise(2, write_while_held, RuntimeError, match, how)


def test_write_to_held_cast_param_raises():
    expect_all_ranks_raise(2, write_while_held, RuntimeError, DROPPED, "data_iadd", True)


def dropped_then_training() -> tuple:
    """Rank body: the refused write leaves the model sharded, its values unchanged,
    and training then matches the reference."""
    model = fs.flex_shard(make_model())
    before = fs.full_state_dict(model)
    model.unshard()
    with torch.no_grad():
        model.layers[0].up.weight.data += 1.0
    with pytest.raises(RuntimeError, match="was written in place"):
        model.reshard()
    after = fs.full_state_dict(model)
    same = all(torch.equal(before[k], after[k]) for k in before)
    return same, train(model, STEPS, unshard_step(False)), fs.full_state_dict(model)


def test_refused_write_leaves_the_model_sharded_and_training():
    for same, losses, full in run_world(2, dropped_then_training):
        assert same
        check_against_reference(losses, full, 2, STEPS)


def held_without_writes() -> int:
    """Rank body: unshard/reshard around bf16 and quantized-wire training steps,
    no-grad forwards and an optimizer step after reshard: nothing raises."""
    for mp in (fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
               fs.MixedPrecisionPolicy(gather_format=fs.QuantizedGather(torch.int8, min_numel=256))):
        model = fs.flex_shard(make_model(), mp_policy=mp, reshard_after_forward=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(2):
            x, y = batch(i, torch.distributed.get_rank())
            model.unshard()
            loss_fn(model(x), y).backward()
            with torch.no_grad():
                model(x)
            model.reshard()
            opt.step()
            opt.zero_grad()
            loss_fn(model(x), y).backward()  # a plain step between
            opt.step()
    return 0


def test_unshard_reshard_without_writes_never_raises():
    assert run_world(2, held_without_writes) == [0, 0]
