"""Hugging Face generate() on a flex_shard model at 2 ranks whose sequences end at
different lengths: every rank keeps calling forward until all have finished (the
wrapped class defaults transformers' synced_gpus to True, wrap/generation.py), so each
rank gets the one-process model's tokens and the ranks stay in step for training.
The default holds for a class whose own generate passes **kwargs on (a user's
subclass; BLIP-2, Kosmos-2, SeamlessM4T, ... in transformers) as for the mixin's."""

import copy

import pytest
import torch
import torch.distributed as dist
import transformers

import flexshard as fs
from flexshard.wrap.generation import synced_generate
from harness import run_world

WORLD, NEW = 2, 8


class OverridingLlama(transformers.LlamaForCausalLM):
    """A generate override as users and remote-code models write it: no `synced_gpus`
    of its own, the rest passed on to GenerationMixin.generate."""

    def generate(self, input_ids=None, **kwargs):
        return super().generate(input_ids, **kwargs)


def llama(cls=transformers.LlamaForCausalLM) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return cls(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))


def prompt(rank: int) -> torch.Tensor:
    return torch.tensor([[5, 9, 13, 2]]) + rank


def generate_then_train(override: bool = False) -> tuple:
    rank = dist.get_rank()
    model = llama(OverridingLlama if override else transformers.LlamaForCausalLM)
    ref = copy.deepcopy(model)
    with torch.no_grad():  # rank 0's eos: its third new token, so it ends 5 tokens early
        free = ref.generate(prompt(rank), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0,
              eos_token_id=int(free[0, 6]) if rank == 0 else None)
    with torch.no_grad():
        want = ref.generate(prompt(rank), **kw)
    fs.flex_shard(model)
    got = model.generate(prompt(rank), **kw)  # generate's own no_grad, as users call it
    # then a training step on every rank: the gathers and reduces pair up again
    batch = torch.arange(24).view(2, 12) % 96
    local = batch[rank:rank + 1]
    model(input_ids=local, labels=local).loss.backward()
    grads = fs.full_grads(model)
    ref(input_ids=batch, labels=batch).loss.backward()
    return got, want, grads, {k: p.grad for k, p in ref.named_parameters()}


@pytest.mark.parametrize("override", [False, True], ids=["mixin", "kwargs_override"])
def test_generate_runs_every_rank_until_all_finish_then_training_goes_on(override):
    results = run_world(WORLD, generate_then_train, override, timeout=300)
    assert results[0][0].shape[1] < results[1][0].shape[1]  # the ranks did end apart
    for got, want, grads, ref_grads in results:
        assert torch.equal(got, want)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)


class Mixin:  # GenerationMixin.generate's shape: synced_gpus the 6th argument
    def generate(self, inputs=None, config=None, processor=None, criteria=None,
                 prefix_fn=None, synced_gpus=None, **kwargs):
        return synced_gpus


class KwargsOverride(Mixin):
    def generate(self, input_ids=None, **kwargs):
        return super().generate(input_ids, **kwargs)


class KwargsOnly:  # passes **kwargs to nothing that names synced_gpus
    def generate(self, input_ids=None, **kwargs):
        return kwargs


class NoKwargs:
    def generate(self, input_ids=None, max_new_tokens=8):
        return max_new_tokens


def wrapped_generate(cls, spans: bool):
    return synced_generate(cls, lambda module: spans)["generate"]


@pytest.mark.parametrize("cls", [Mixin, KwargsOverride])
def test_synced_gpus_defaults_to_true_on_several_ranks_and_keeps_a_passed_value(cls):
    generate = wrapped_generate(cls, spans=True)
    assert generate(cls(), "ids") is True
    assert generate(cls(), "ids", synced_gpus=None) is True  # None: unset, as in transformers
    assert generate(cls(), "ids", synced_gpus=False) is False
    assert wrapped_generate(cls, spans=False)(cls(), "ids") is None  # one rank: left unset


def test_a_synced_gpus_passed_by_position_is_kept():
    assert wrapped_generate(Mixin, spans=True)(Mixin(), "ids", None, None, None, None, False) is False


@pytest.mark.parametrize("cls", [KwargsOnly, NoKwargs])
def test_a_generate_that_cannot_reach_synced_gpus_is_left_alone(cls):
    assert synced_generate(cls, lambda module: True) == {}


def counts() -> tuple:
    """(num_parameters() of the wrapped model, this rank's pieces' elements, the full
    state dict's elements) under Owned."""
    model = fs.flex_shard(llama(), placement=fs.Owned())
    full = fs.full_state_dict(model)
    return (model.num_parameters(), sum(p.numel() for p in model.parameters()),
            sum(v.numel() for k, v in full.items() if "rotary" not in k))


def test_hugging_face_counters_count_this_ranks_pieces():
    """troubleshooting.md's row: num_parameters() is this rank's share; the full
    state dict counts the model."""
    whole = llama().num_parameters()
    results = run_world(2, counts)
    for mine, pieces, full in results:
        assert mine == pieces < whole and full == whole
    assert sum(mine for mine, _, _ in results) == whole
