"""plan_wrap: the one plan flex_shard builds a model's runtime from, made
without a process group (every rank computes the same plan)."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from flexshard.planning.assign import default_buckets
from flexshard.planning.plan import plan_wrap
from reference import make_model


def _plan(model, world: int, specs=None, reshard: bool = True,
          mp: fs.MixedPrecisionPolicy = fs.MixedPrecisionPolicy()):
    specs = default_buckets(model) if specs is None else specs
    return plan_wrap(model, dict(model.named_parameters()), specs, fs.Shard(0), mp,
                     reshard, world)


def test_one_record_per_bucket_with_runner_and_flags():
    model = make_model()
    plan = _plan(model, world=2)
    assert [b.spec.label for b in plan.buckets] == ["layers.0", "layers.1", "root"]
    assert [b.runner for b in plan.buckets] == [model.layers[0], model.layers[1], model]
    # The root's bucket keeps its params after forward unless its spec says otherwise.
    assert [b.reshard_after_forward for b in plan.buckets] == [True, True, False]
    assert all(b.needs_hooks and not b.used_in_nested_runner for b in plan.buckets)
    named = dict(model.named_parameters())
    for b in plan.buckets:
        assert len(b.slots) == len(b.aliases) == len(b.trainable)
        for slot, aliases in zip(b.slots, b.aliases):
            assert aliases and all(m._parameters[attr] is named[slot.fqn] for m, attr in aliases)
            assert slot.local_shapes == tuple(slot.placement.local_shape(slot.shape, r, 2)
                                              for r in range(2))


def test_tied_param_has_every_alias_and_a_spec_flag_wins():
    model = make_model(tied=True)
    specs = [fs.BucketSpec("layers.*", name="blocks", reshard_after_forward=False),
             fs.BucketSpec(["tok.*", "pos", "norm.*"], name="rest", reshard_after_forward=True)]
    plan = _plan(model, world=2, specs=specs)
    blocks, rest = plan.buckets
    assert blocks.runner is model and not blocks.reshard_after_forward  # past the ModuleList
    assert rest.runner is model and rest.reshard_after_forward
    tok = [s.fqn for s in rest.slots].index("tok.weight")
    assert set(rest.aliases[tok]) == {(model.tok, "weight"), (model.head, "weight")}


def test_world_one_needs_hooks_only_to_cast():
    model = make_model()
    assert not any(b.needs_hooks for b in _plan(model, world=1).buckets)
    cast = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert all(b.needs_hooks for b in _plan(model, world=1, mp=cast).buckets)


def test_module_shared_across_buckets_is_flagged():
    model = make_model()
    model.layers[1].up = model.layers[0].up  # layers.1 calls layers.0's Linear too
    with pytest.warns(UserWarning, match=r"also registered as 'layers\.1\.up\.(weight|bias)'"):
        plan = _plan(model, world=2)
    # layers.0's bucket covers both uses, so it runs on the root; its params are
    # used inside layers.1, another bucket's running module, nested in the root.
    assert [b.runner for b in plan.buckets] == [model, model.layers[1], model]
    assert [b.used_in_nested_runner for b in plan.buckets] == [True, False, False]
