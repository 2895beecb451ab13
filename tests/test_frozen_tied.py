"""Frozen parameters mixed into buckets, tied and shared parameters."""

from __future__ import annotations

import warnings

import pytest
import torch

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import make_model
from training_helpers import check_against_reference, train

STEPS = 3
FROZEN = ("tok.weight", "layers.0.norm1.weight", "layers.0.norm1.bias", "layers.1.qkv.weight")


def frozen_model():
    """Some frozen params in the root and block buckets, and a fully frozen block."""
    model = make_model(layers=3)
    for fqn, p in model.named_parameters():
        if fqn in FROZEN or fqn.startswith("layers.2."):
            p.requires_grad_(False)
    return model


def train_frozen() -> tuple:
    """Rank body: (bytes the last step reduced, trainable bytes, reduce-scatters per
    bucket in that step, whether frozen params got no grad)."""
    from flexshard.runtime.state import get_state

    model = frozen_model()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    fs.flex_shard(model)
    buckets = get_state(model).buckets
    train(model, STEPS - 1)
    before = {b.name: (b.counters.reduce_ideal_bytes, b.counters.reduces) for b in buckets}
    train(model, 1)
    reduced = sum(b.counters.reduce_ideal_bytes - before[b.name][0] for b in buckets)
    reduces = {b.name: b.counters.reduces - before[b.name][1] for b in buckets}
    x, y = batch(0, torch.distributed.get_rank())
    loss_fn(model(x), y).backward()
    no_frozen_grads = all(p.grad is None for p in model.parameters() if not p.requires_grad)
    return reduced, trainable, reduces, no_frozen_grads


def frozen_parity_body() -> tuple:
    model = fs.flex_shard(frozen_model())
    return train(model, STEPS), fs.full_state_dict(model)


def test_frozen_params_parity():
    losses, full = run_world(2, frozen_parity_body)[0]
    check_against_reference(losses, full, 2, STEPS, model=frozen_model())


def test_frozen_params_are_gathered_never_reduced():
    for reduced, trainable, reduces, no_frozen_grads in run_world(2, train_frozen):
        assert reduced == trainable, "reduce-scatters move exactly the trainable bytes"
        assert reduces == {"layers.0": 1, "layers.1": 1, "layers.2": 0, "root": 1}
        assert no_frozen_grads


def tied_body(buckets) -> tuple:
    """Rank body: train a TinyGPT whose head shares the embedding's weight."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fs.flex_shard(make_model(tied=True), buckets=buckets)
    messages = [str(w.message) for w in caught]
    return train(model, STEPS), fs.full_state_dict(model), messages


SPLIT_TIED = [fs.BucketSpec("layers.*", name="blocks"), fs.BucketSpec("tok.*", name="embed"),
              fs.BucketSpec(["pos", "norm.*", "head.*"], name="head")]


@pytest.mark.parametrize("split", [False, True])
def test_tied_embedding_parity(split):
    losses, full, messages = run_world(2, tied_body, SPLIT_TIED if split else None)[0]
    check_against_reference(losses, full, 2, STEPS, model_kw={"tied": True})
    assert full["head.weight"] is full["tok.weight"]  # one tensor under both names, as unwrapped
    if split:
        # 'head.*' claims head.weight, the embedding's second name: said, and still correct.
        assert len(messages) == 1
        assert "'tok.weight' (bucket 'embed') is also registered as 'head.weight'" in messages[0]
        assert "bucket 'head' matches" in messages[0] and "module 'root'" in messages[0]
    else:
        assert messages == []


def shared_block_model():
    """layers.1 calls the same `up` Linear as layers.0 (a module shared across buckets)."""
    model = make_model()
    model.layers[1].up = model.layers[0].up
    return model


def shared_body() -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fs.flex_shard(shared_block_model())
    return train(model, STEPS), fs.full_state_dict(model), [str(w.message) for w in caught]


def test_module_shared_across_buckets_trains_correctly():
    losses, full, messages = run_world(2, shared_body)[0]
    check_against_reference(losses, full, 2, STEPS, model=shared_block_model())
    assert len(messages) == 2  # up.weight and up.bias, each naming both FQNs
    assert "'layers.0.up.weight' (bucket 'layers.0') is also registered as " \
           "'layers.1.up.weight', which bucket 'layers.1' matches" in messages[0]


def unfreeze_after_wrap():
    model = make_model()
    model.layers[0].up.weight.requires_grad_(False)
    fs.flex_shard(model)
    model.layers[0].up.weight.requires_grad_(True)
    x, _ = batch(0, torch.distributed.get_rank())
    model(x)


def test_unfreezing_after_wrap_raises():
    # freezing after the wrap trains right: tests/test_training_mistakes.py
    expect_all_ranks_raise(2, unfreeze_after_wrap, ValueError,
                           r"'layers.0.up.weight' \(bucket 'layers.0'\) changed requires_grad "
                           r"to True after flex_shard; it was frozen when wrapped")
