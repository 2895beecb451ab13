"""fs.full_grads and fs.grad_norms: each parameter's full gradient (and its
norm) by FQN on every rank, equal to the one-process gradient, for every
placement and a bucket mixing them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import make_model, reference_run

WORLD = 2


def shard1(fqn, param):
    return fs.Shard(1) if param.dim() == 2 else fs.Shard(0)


def mixed(fqn, param):
    if fqn.endswith(("qkv.weight", "up.weight", "tok.weight")):
        return fs.Owned()
    if fqn.endswith(("down.weight", "proj.weight")):
        return fs.Shard(0)
    return fs.RaggedShard(units=(1, 2))


PLACEMENTS = {"shard0": fs.Shard(0), "shard1": shard1, "owned": fs.Owned(),
              "ragged": fs.RaggedShard(units=(3, 1)), "mixed": mixed}


def grads_body(name: str, norm_type: float):
    model = fs.flex_shard(make_model(bf16_pos=name == "mixed"), placement=PLACEMENTS[name])
    model.layers[1].up.weight.requires_grad_(False)  # no grad: None by FQN
    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    # FSDP2's spelling, one collective per grad (every rank, the same order)
    spelled = {fqn: p.grad.full_tensor() for fqn, p in model.named_parameters()
               if p.grad is not None}
    return fs.full_grads(model), fs.grad_norms(model, norm_type), spelled


@pytest.mark.parametrize("name,norm_type", [("shard0", 2.0), ("shard1", 1.0),
                                            ("owned", math.inf), ("ragged", 2.0),
                                            ("mixed", 2.0)])
def test_full_grads_match_one_process(name, norm_type):
    results = run_world(WORLD, grads_body, name, norm_type)
    _, _, ref = reference_run(WORLD, 1, model_kw={"bf16_pos": name == "mixed"})
    ref["layers.1.up.weight"] = None
    for grads, norms, spelled in results:
        assert grads.keys() == ref.keys() == norms.keys()
        assert spelled.keys() == {k for k, v in ref.items() if v is not None}
        for fqn, full in spelled.items():  # p.grad.full_tensor() is fs.full_grads' tensor
            assert full.shape == ref[fqn].shape and torch.equal(full, grads[fqn]), fqn
        for fqn, want in ref.items():
            if want is None:
                assert grads[fqn] is None and norms[fqn] is None, fqn
                continue
            torch.testing.assert_close(grads[fqn], want, rtol=1e-5, atol=1e-7, msg=fqn)
            torch.testing.assert_close(
                norms[fqn], torch.linalg.vector_norm(want.float(), norm_type),
                rtol=1e-5, atol=1e-7, msg=fqn)
        assert torch.equal(torch.stack([n for n in norms.values() if n is not None]),
                           torch.stack([n for n in results[0][1].values() if n is not None]))


def half_zeroed():
    model = fs.flex_shard(make_model())
    loss_fn(model(batch(0, dist.get_rank())[0]), batch(0, 0)[1]).backward()
    if dist.get_rank() == 1:
        model.head.weight.grad = None
    fs.full_grads(model)


def test_grads_on_some_ranks_only_raise():
    expect_all_ranks_raise(WORLD, half_zeroed, ValueError,
                           r"fs.full_grads: parameter 'head.weight' \(bucket '.*'\) has a grad "
                           r"on 1 of its 2 ranks; call it on every rank after the same backward")
    with pytest.raises(ValueError, match=r"grad_norms: norm_type must be a nonzero number"):
        fs.grad_norms(fs.flex_shard(make_model()), 0)


def test_world_size_one():
    model = fs.flex_shard(make_model())
    plain = make_model()
    for m in (model, plain):
        x, y = batch(0, 0)
        loss_fn(m(x), y).backward()
    grads, norms = fs.full_grads(model), fs.grad_norms(model)
    for fqn, p in plain.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(norms[fqn], p.grad.norm(), rtol=1e-6, atol=0)
