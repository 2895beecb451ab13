"""Loading the state dict of an unwrapped model with tied weights.

A Hugging Face causal LM with tie_word_embeddings=True lists its embedding
twice in model.state_dict(): `model.embed_tokens.weight` and `lm_head.weight`.
fs.load_full_state_dict and fs.load_pretrained accept every name of a tied
parameter, as nn.Module.load_state_dict does, when the tensors are equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import flexshard as fs
from harness import expect_all_ranks_raise, run_world

VOCAB, DIM = 13, 6  # 13 rows: uneven over 2 ranks


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.norm(h)


class TiedLM(nn.Module):
    """Llama's names and tying, in miniature: lm_head.weight is the embedding."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = Decoder()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens):
        return self.lm_head(self.model(tokens))


TOKENS = torch.arange(10).remainder(VOCAB).reshape(2, 5)


def source_dict() -> dict:
    """model.state_dict() of the unwrapped pretrained model: both tied names."""
    sd = {k: v.clone() for k, v in TiedLM(0).state_dict().items()}
    assert "model.embed_tokens.weight" in sd and "lm_head.weight" in sd
    return sd


def load_and_run(how: str, path: str = "") -> tuple:
    """Rank body: wrap a differently seeded model, load the pretrained weights,
    return (what load_pretrained reported, logits, full params)."""
    model = fs.flex_shard(TiedLM(1))
    keys = None
    if how == "full":
        fs.load_full_state_dict(model, source_dict())
    elif how == "pretrained":
        keys = fs.load_pretrained(model, source_dict())
    else:
        keys = fs.load_pretrained(model, path)
    with torch.no_grad():
        logits = model(TOKENS)
    return keys, logits, fs.full_state_dict(model)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how", ["full", "pretrained", "safetensors"])
def test_tied_state_dict_of_the_unwrapped_model_loads(tmp_path, world, how):
    path = str(tmp_path / "model.safetensors")
    if how == "safetensors":
        # safetensors refuses shared storage: save both names as separate equal tensors
        save_file({k: v.contiguous().clone() for k, v in source_dict().items()}, path)
    reference = TiedLM(0)
    with torch.no_grad():
        want = reference(TOKENS)
    for keys, logits, full in run_world(world, load_and_run, how, path):
        if how != "full":
            assert keys == fs.PretrainedKeys([], [])  # both tied names used, none left over
        torch.testing.assert_close(logits, want, rtol=0, atol=0)
        assert torch.equal(full["model.embed_tokens.weight"], reference.lm_head.weight)


def load_mismatched(how: str) -> None:
    """Rank body: the two tied names hold different tensors."""
    sd = source_dict()
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    model = fs.flex_shard(TiedLM(1))
    if how == "full":
        fs.load_full_state_dict(model, sd)
    else:
        fs.load_pretrained(model, sd)


@pytest.mark.parametrize("how", ["full", "pretrained"])
def test_tied_names_with_different_values_raise_on_every_rank(how):
    what = "load_full_state_dict" if how == "full" else "load_pretrained"
    expect_all_ranks_raise(2, load_mismatched, ValueError,
                           rf"{what}: 'model.embed_tokens.weight' and 'lm_head.weight' name one "
                           r"tied parameter but hold different values", how)


def test_one_tied_name_is_enough_and_unknown_keys_are_refused():
    model = fs.flex_shard(TiedLM(1))
    sd = source_dict()
    del sd["model.embed_tokens.weight"]
    fs.load_full_state_dict(model, sd)  # lm_head.weight alone loads the tied pair
    assert torch.equal(fs.full_state_dict(model)["model.embed_tokens.weight"], sd["lm_head.weight"])
    del sd["lm_head.weight"]
    sd["lm_head.bias"] = torch.zeros(VOCAB)
    with pytest.raises(KeyError, match=r"missing keys \['model.embed_tokens.weight'\], unexpected "
                                       r"keys \['lm_head.bias'\]; .*\(a tied parameter under one"):
        fs.load_full_state_dict(model, sd)


def test_a_tied_name_of_the_wrong_shape_is_named():
    model = fs.flex_shard(TiedLM(1))
    sd = source_dict()
    sd["lm_head.weight"] = torch.zeros(VOCAB + 1, DIM)
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(14, 6\) but the "
                                         r"parameter is \(13, 6\)"):
        fs.load_full_state_dict(model, sd)
