"""Ranks that load a full source (fs.load_pretrained, fs.load_full_state_dict,
model.load_state_dict of full tensors) from sources that disagree raise on every rank, naming the tensors, before
anything is written; ranks with equal sources load as one process would."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import transformers
from safetensors.torch import save_file

import flexshard as fs
from flexshard.checkpoint import agreement
from flexshard.checkpoint.pretrained import _SafetensorsReader
from harness import run_world
from reference import assert_rel_close, make_model
from test_meta_buffers import built_normally, llama_config, meta_wrapped

DIFFER = r"the ranks' sources hold different values for "
FIX = r"Every rank must load the same source: .* torch\.manual_seed\(0\)"


def source(seed: int, changed: str = "") -> dict:
    """TinyGPT's weights with `seed`; `changed` names one tensor made different."""
    sd = {k: v.clone() for k, v in make_model(seed).state_dict().items()}
    if changed:
        sd[changed][0] += 1.0
    return sd


def _load(loader: str, model: nn.Module, sd: dict, directory: str = "", strict: bool = True):
    """Load `sd` into `model` the way `loader` says; returns the keys it reports."""
    if loader == "safetensors":
        path = f"{directory}/rank{dist.get_rank()}.safetensors"  # a file per rank ("per node")
        save_file(sd, path)
        return fs.load_pretrained(model, path, strict=strict)
    if loader == "pretrained":
        return fs.load_pretrained(model, sd, strict=strict)
    if loader == "state_dict":
        return model.load_state_dict(sd)
    return fs.load_full_state_dict(model, sd)


def _load_catching(loader: str, sd: dict, directory: str = "", strict: bool = True):
    """(the error's type and message, whether TinyGPT(seed 5) kept its values) on this rank."""
    model = fs.flex_shard(make_model(5))
    before = fs.full_state_dict(model)
    try:
        _load(loader, model, sd, directory, strict)
        kind, message = None, ""
    except (ValueError, KeyError) as e:
        kind, message = type(e).__name__, str(e)
    after = fs.full_state_dict(model)
    return kind, message, all(torch.equal(after[k], v) for k, v in before.items())


def _per_rank(loader: str, directory: str, case: str):
    rank = dist.get_rank()
    if case == "seeds":  # each rank builds its "pretrained" model unseeded: other weights
        sd = source(rank)
    elif case == "one":
        sd = source(0, "layers.1.down.bias" if rank == 1 else "")
    else:  # "lacks": rank 1's source has no layers.1.down.bias
        sd = source(0)
        if rank == 1:
            del sd["layers.1.down.bias"]
    if case == "lacks" and loader == "pretrained-lenient":
        return _load_catching("pretrained", sd, directory, strict=False)
    return _load_catching(loader, sd, directory)


LOADERS = ["pretrained", "full", "safetensors", "state_dict"]
WHAT = {"full": "load_full_state_dict", "state_dict": "load_state_dict"}


@pytest.mark.parametrize("loader", LOADERS)
def test_rank_dependent_sources_raise_on_every_rank(tmp_path, loader):
    what = WHAT.get(loader, "load_pretrained")
    results = run_world(2, _per_rank, loader, str(tmp_path), "seeds")
    for kind, message, kept in results:
        assert (kind, message, kept) == ("ValueError", results[0][1], True)  # same everywhere
    # the LayerNorms' ones and zeros agree; every random init differs
    assert re.match(what + ": " + DIFFER + r"\['pos', 'tok\.weight', 'layers\.0\.qkv\.weight'\] "
                    r"and 14 more \(for 'pos': rank\(s\) \[0\] vs rank\(s\) \[1\]\), .*"
                    r"nothing was loaded\. " + FIX, results[0][1])


@pytest.mark.parametrize("loader", LOADERS)
def test_one_differing_tensor_is_named_and_nothing_is_written(tmp_path, loader):
    results = run_world(2, _per_rank, loader, str(tmp_path), "one")
    for kind, message, kept in results:
        assert (kind, kept) == ("ValueError", True)
        assert ("the ranks' sources hold different values for ['layers.1.down.bias'] (for "
                "'layers.1.down.bias': rank(s) [0] vs rank(s) [1])") in message


def test_a_rank_whose_source_lacks_a_key_does_not_hang(tmp_path):
    (kind0, message0, _), (kind1, message1, _) = run_world(2, _per_rank, "pretrained",
                                                          str(tmp_path), "lacks")
    assert kind1 == "ValueError"
    assert "the source has no tensor for ['layers.1.down.bias']" in message1
    assert kind0 == "ValueError" and message0.startswith(
        "load_pretrained: rank(s) [1] could not load the source (their own error says why)")
    (_, lenient0, _), (_, lenient1, _) = run_world(2, _per_rank, "pretrained-lenient",
                                                   str(tmp_path), "lacks")
    assert lenient0 == lenient1
    assert ("['layers.1.down.bias'] (for 'layers.1.down.bias': rank(s) [0] vs rank(s) [1] "
            "(not in their source))") in lenient0
    (_, full0, _), (_, full1, _) = run_world(2, _per_rank, "full", str(tmp_path), "lacks")
    assert "missing keys ['layers.1.down.bias']" in full1
    assert full0.startswith("load_full_state_dict: rank(s) [1] could not load the source")


# Equal sources: loaded as one process loads them.


def _load_equal(loader: str, directory: str):
    model = fs.flex_shard(make_model(5))
    keys = _load(loader, model, source(0), directory)
    ids = torch.randint(0, 37, (2, 11), generator=torch.Generator().manual_seed(3))
    return keys, fs.full_state_dict(model), model(ids)


@pytest.mark.parametrize("loader", LOADERS)
def test_equal_sources_load_as_one_process(tmp_path, loader):
    reference = make_model(0)
    ids = torch.randint(0, 37, (2, 11), generator=torch.Generator().manual_seed(3))
    expected = reference(ids)
    for keys, full, out in run_world(2, _load_equal, loader, str(tmp_path)):
        assert keys == (None if loader == "full" else ([], []))  # missing, unexpected
        for k, v in reference.state_dict().items():
            assert torch.equal(full[k], v), k
        torch.testing.assert_close(out, expected)


# A tensor past the sample size: evenly spaced rows, the same for every kind of source.


def test_checksum_samples_rows_alike_for_every_source(tmp_path):
    torch.manual_seed(0)
    big = torch.randn(600, 600)  # 360,000 elements: past the 2^18 sampled
    assert agreement.sample_slices((600, 600)) == (slice(0, 600, 2), slice(0, 600))
    assert agreement.sample_slices((3, 600_000)) == (slice(0, 1), slice(0, 600_000, 3))
    save_file({"w": big}, str(tmp_path / "w.safetensors"))
    with contextlib.ExitStack() as stack:
        reader = _SafetensorsReader([str(tmp_path / "w.safetensors")], stack)
        from_file = agreement.checksum(lambda s: reader.read("w", s), big.shape)
    from_dict = agreement.checksum(lambda s: big if s is None else big[s], big.shape)
    assert from_file == from_dict
    changed = big.clone()
    changed[300, 7] += 1e-3  # a sampled row (an even one)
    assert agreement.checksum(lambda s: changed[s], big.shape) != from_dict
    half = torch.arange(7, dtype=torch.bfloat16)[1:]  # an odd start: not int32-aligned
    assert agreement.checksum(lambda s: half, half.shape) == agreement.checksum(
        lambda s: half.clone(), half.shape)


# The Hugging Face recipe of docs/meta-device.md, on the user's path.


def _hf_recipe(seeded: bool):
    # unseeded processes under torchrun build different models (the page's old recipe)
    torch.manual_seed(0 if seeded else 100 + dist.get_rank())
    pretrained = transformers.LlamaForCausalLM(llama_config()).state_dict()
    model = meta_wrapped()
    model.init_parameters(model._init_weights)
    try:
        fs.load_full_state_dict(model, pretrained)
    except ValueError as e:
        return str(e), None
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    return "", model(input_ids=ids, labels=ids).loss.detach()


def test_hugging_face_recipe_with_unseeded_weights_raises_on_every_rank():
    (message0, loss0), (message1, loss1) = run_world(2, _hf_recipe, False)
    assert message0 == message1 and loss0 is None and loss1 is None
    assert re.match(r"load_full_state_dict: " + DIFFER + r"\['model\.embed_tokens\.weight', ",
                    message0)


def test_hugging_face_recipe_with_seeded_weights_matches_the_model_built_normally():
    reference = built_normally()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = reference(input_ids=ids, labels=ids).loss.detach()
    for message, loss in run_world(2, _hf_recipe, True):
        assert message == ""
        torch.testing.assert_close(loss, expected)


# Buffers are not sharded: each rank's own (BatchNorm's running stats on its own batches,
# as under DDP without SyncBatchNorm). Only their presence is compared, and a round trip
# through the full state dict keeps each rank's.

BN_STEPS = (2, 2)  # steps before and after the round trip
BN_LR = 0.1


def _bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 3))


def _bn_loss(model, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)
    return (model(x) - y).square().mean()


def _bn_train(model, steps) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=BN_LR)
    for step in steps:
        _bn_loss(model, step, dist.get_rank()).backward()
        opt.step()
        opt.zero_grad()


def _bn_round_trip(loader: str) -> dict:
    """Rank body: train, round-trip the full state dict through `loader` (into the
    model itself, or into a fresh one), train on; the full state dict."""
    model = fs.flex_shard(_bn_model())
    _bn_train(model, range(BN_STEPS[0]))
    full = fs.full_state_dict(model)
    if loader != "self":
        model = fs.flex_shard(_bn_model(seed=1))
    _load("full" if loader == "self" else loader, model, full)
    _bn_train(model, range(BN_STEPS[0], sum(BN_STEPS)))
    return fs.full_state_dict(model)


def _bn_reference(world: int) -> list:
    """Single process: a copy of the model per rank (its own running stats), each
    step's gradients averaged over the copies; every copy's state dict."""
    models = [_bn_model() for _ in range(world)]
    params = [list(m.parameters()) for m in models]
    for step in range(sum(BN_STEPS)):
        grads = [torch.autograd.grad(_bn_loss(m, step, r), params[r])
                 for r, m in enumerate(models)]
        with torch.no_grad():
            for i in range(len(params[0])):
                mean = sum(g[i] for g in grads) / world
                for p in params:
                    p[i].add_(mean, alpha=-BN_LR)
    return [m.state_dict() for m in models]


@pytest.mark.parametrize("loader", ["self", "full", "pretrained", "state_dict"])
def test_per_rank_buffers_round_trip_and_train_as_before(loader):
    reference = _bn_reference(2)
    results = run_world(2, _bn_round_trip, loader)
    assert not torch.equal(results[0]["1.running_mean"], results[1]["1.running_mean"])
    for full, ref in zip(results, reference):  # rank r: the params, and copy r's buffers
        assert full.keys() == ref.keys()
        for k, v in ref.items():
            assert_rel_close(full[k], v, 1e-5, k)
