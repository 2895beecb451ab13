"""Hugging Face generate() on a flex_shard model at 2 ranks whose sequences end at
different lengths: every rank keeps calling forward until all have finished (the
wrapped class defaults transformers' synced_gpus to True, wrap/generation.py), so each
rank gets the one-process model's tokens and the ranks stay in step for training."""

import copy

import torch
import torch.distributed as dist
import transformers

import flexshard as fs
from harness import run_world

WORLD, NEW = 2, 8


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))


def prompt(rank: int) -> torch.Tensor:
    return torch.tensor([[5, 9, 13, 2]]) + rank


def generate_then_train() -> tuple:
    rank = dist.get_rank()
    model = llama()
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


def test_generate_runs_every_rank_until_all_finish_then_training_goes_on():
    results = run_world(WORLD, generate_then_train, timeout=300)
    assert results[0][0].shape[1] < results[1][0].shape[1]  # the ranks did end apart
    for got, want, grads, ref_grads in results:
        assert torch.equal(got, want)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)
