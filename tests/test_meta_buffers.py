"""Meta-device models and their buffers: a buffer to_empty() left uninitialised
never reaches a forward; the Hugging Face recipe trains as the model built normally.

A Hugging Face Llama keeps its rotary frequencies in non-persistent buffers
(`inv_freq`, `original_inv_freq`): no state dict holds them, so after
`to_empty()` only an init function can set them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers  # the `hf` extra, installed by the README's set-up command

import flexshard as fs
from harness import expect_all_ranks_raise, run_world

STEPS = 3
LR = 0.1
UNSET = (r"buffer\(s\) model\.rotary_emb\.inv_freq, model\.rotary_emb\.original_inv_freq were "
         r"on the meta device .* model\.init_parameters\(model\._init_weights\)")


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=10000.0, attn_implementation="sdpa")


def built_normally() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config())


def meta_wrapped() -> nn.Module:
    """Built on the meta device, flex-sharded (one bucket per layer plus a root), to_empty."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config())
    model = fs.flex_shard(model)
    model.to_empty(device="cpu")
    return model


def batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, 24), generator=g) for _ in range(STEPS)]


def train(model: nn.Module) -> tuple:
    """STEPS SGD steps on every rank's same batches: (losses, full params after each
    step). With SGD from equal params, the params after step 1 pin the first grads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers: same kernels, same rounding
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, params = [], []
        for ids in batches():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            params.append(_full_params(model))
    finally:
        torch.set_num_threads(threads)
    return losses, params


def _full_params(model) -> dict:
    from flexshard.runtime.state import find_state

    if find_state(model) is None:
        return {k: p.detach().clone() for k, p in model.named_parameters()}
    return fs.full_state_dict(model)


def load_without_buffers() -> None:
    """Rank body: the issue's case, meta -> wrap -> to_empty -> load params -> forward."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = meta_wrapped()
    fs.load_full_state_dict(model, built_normally().state_dict())
    with CommDebugMode() as comms:
        try:
            model(input_ids=batches()[0])
        finally:
            assert comms.get_total_counts() == 0, "a collective ran before the check"


@pytest.mark.parametrize("world", [1, 2])
def test_a_buffer_nothing_initialised_is_refused_at_the_first_forward(world):
    if world == 1:
        with pytest.raises(ValueError, match=UNSET):
            load_without_buffers()
    else:
        expect_all_ranks_raise(world, load_without_buffers, ValueError, UNSET)


def test_the_error_names_only_the_buffers_still_unset():
    model = meta_wrapped()
    fs.load_full_state_dict(model, built_normally().state_dict())
    model.model.rotary_emb.inv_freq.copy_(built_normally().model.rotary_emb.inv_freq)
    with pytest.raises(ValueError, match=r"buffer\(s\) model\.rotary_emb\.original_inv_freq were"):
        model(input_ids=batches()[0])


def hf_recipe() -> tuple:
    """Rank body: the documented recipe, then training (docs/meta-device.md)."""
    model = meta_wrapped()
    model.init_parameters(model._init_weights)  # every module's params and buffers
    fs.load_full_state_dict(model, built_normally().state_dict())
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    return (buffers, *train(model))


def test_the_hugging_face_recipe_trains_as_the_model_built_normally():
    reference = built_normally()
    ref_buffers = {k: b.clone() for k, b in reference.named_buffers()}
    ref_losses, ref_params = train(reference)
    for buffers, losses, params in run_world(2, hf_recipe):
        assert buffers.keys() == ref_buffers.keys()
        for k, b in buffers.items():
            torch.testing.assert_close(b, ref_buffers[k], rtol=0, atol=0, msg=k)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-6, atol=0)
        for step, (got, want) in enumerate(zip(params, ref_params)):
            assert got.keys() == want.keys()
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=0,
                                           msg=f"step {step}: {k}")


def test_persistent_buffers_load_from_the_full_state_dict():
    def bn_model():
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))

    torch.manual_seed(0)
    source = bn_model()
    source.train()
    source(torch.randn(16, 8))  # running stats away from their init
    with torch.device("meta"):
        model = fs.flex_shard(bn_model())
    model.to_empty(device="cpu")
    fs.load_full_state_dict(model, source.state_dict())
    for k, b in source.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[k], b, rtol=0, atol=0)
    model(torch.randn(4, 8))  # every buffer written: the check passes


def _hf_model(kind: str):
    """(class, config) of small models whose init reaches past one module: GPT-2 scales
    its blocks' output projections from the attention and MLP modules' init, T5 sets
    q, k, v, o from its attention module's; tied embeddings keep their padding row."""
    if kind.startswith("gpt2"):
        return transformers.GPT2LMHeadModel, transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=64,
            tie_word_embeddings=kind == "gpt2-tied")
    if kind == "t5":
        return transformers.T5ForConditionalGeneration, transformers.T5Config(
            vocab_size=101, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
            decoder_start_token_id=0)
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0)


def hf_init_on_meta(kind: str) -> dict:
    """Rank body: the documented recipe (meta, flex_shard, to_empty, init_parameters)."""
    cls, config = _hf_model(kind)
    with torch.device("meta"):
        model = cls(config)
    fs.flex_shard(model).to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_parameters(model._init_weights)
    return fs.full_state_dict(model)


@pytest.mark.parametrize("kind", ["gpt2", "gpt2-tied", "t5", "llama-tied-padding"])
def test_the_hugging_face_recipe_initialises_as_hugging_face(kind):
    """Bit for bit HF's own init of the same model (initialize_weights: each module's
    _init_weights, children first; then the tie). The recipe ran each module's init in
    modules() order on its own params only: GPT-2's scaled output projections came out
    2x too wide, T5's attention weights 32x, and a tied embedding's padding row nonzero
    (the LM head's init overwrote the embeddings')."""
    cls, config = _hf_model(kind)
    with torch.device("meta"):
        ref = cls(config)
    ref.to_empty(device="cpu")
    torch.manual_seed(0)
    ref.initialize_weights()
    ref.tie_weights()
    want = ref.state_dict()
    for got in run_world(2, hf_init_on_meta, kind):
        assert got.keys() == want.keys()
        for k, v in got.items():
            assert torch.equal(v, want[k]), k
