"""PEFT's LoRA on a flex_shard model: it trains as the one-process PeftModel (SGD,
first-step grads too), generate() keeps the ranks in step (wrap/generation.py), and
the adapter merges, which cannot run on pieces, are refused on every rank alike
before any work (wrap/refused_methods.py); at one rank they run as PEFT's."""

import copy

import pytest
import torch
import torch.distributed as dist
import transformers
from peft import LoraConfig, get_peft_model

import flexshard as fs
from harness import expect_all_ranks_raise, run_world

WORLD, LR = 2, 0.5
PLACEMENTS = {"shard": fs.Shard(0), "owned": fs.Owned()}


def lora_llama():
    """A tiny Llama with LoRA on q and v (B not zero: the adapter changes the output);
    odd sizes, which 2 ranks split unevenly."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=42, intermediate_size=71, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, attn_implementation="sdpa"))
    return get_peft_model(base, LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"],
                                           lora_dropout=0.0, init_lora_weights=False))


def tokens(step: int) -> torch.Tensor:
    """Every rank's sequences of one step: rank r trains on row r."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 97, (WORLD, 10), generator=g)


def train_lora(placement: str) -> tuple:
    """Two SGD steps of the wrapped PeftModel and of its one-process twin on all
    rows: losses, first-step grads and final params of the adapters."""
    rank = dist.get_rank()
    model = lora_llama()
    ref = copy.deepcopy(model)
    fs.flex_shard(model, placement=PLACEMENTS[placement])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], None
    for step in range(2):
        batch = tokens(step)
        local = batch[rank:rank + 1]
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        ref_loss = ref(input_ids=batch, labels=batch).loss
        ref_loss.backward()
        if step == 0:
            grads = (fs.full_grads(model),
                     {k: p.grad.clone() for k, p in ref.named_parameters() if p.grad is not None})
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean.item() / WORLD, ref_loss.item()))
    return losses, grads, fs.full_state_dict(model), ref.state_dict()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_lora_trains_as_the_one_process_peft_model(placement):
    for losses, (grads, ref_grads), full, ref_full in run_world(WORLD, train_lora, placement,
                                                                timeout=300):
        for got, want in losses:
            assert got == pytest.approx(want, rel=1e-5)
        assert ref_grads and set(ref_grads) <= set(grads)
        assert all("lora_" in k for k in ref_grads)  # the base weights are frozen
        for k, want in ref_grads.items():
            torch.testing.assert_close(grads[k], want, rtol=1e-4, atol=1e-6, msg=k)
        for k, want in ref_full.items():
            torch.testing.assert_close(full[k], want, rtol=1e-4, atol=1e-6, msg=k)


def merge_on_pieces(placement: str, name: str) -> None:
    model = fs.flex_shard(lora_llama(), placement=PLACEMENTS[placement])
    getattr(model, name)()


@pytest.mark.parametrize("name", ["merge_adapter", "merge_and_unload", "unmerge_adapter"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_merge_on_several_ranks_is_refused_on_every_rank(placement, name):
    """Before the refusal, under Owned PEFT's matmul failed on rank 1 alone and rank 0
    went on to its next collective."""
    expect_all_ranks_raise(WORLD, merge_on_pieces, RuntimeError,
                           rf"{name}\(\) on a flex_shard model sharded over several ranks.*"
                           r"fs\.full_state_dict", placement, name)


def merge_then_after() -> tuple:
    """At one rank: wrapped and plain PeftModel, merged in place, then unmerged:
    the logits of each stage."""
    model, ref = lora_llama(), lora_llama()
    fs.flex_shard(model)
    x = tokens(0)
    out = []
    with torch.no_grad():
        for stage in ("merge_adapter", "unmerge_adapter"):
            before = ref(input_ids=x).logits
            getattr(model, stage)()
            getattr(ref, stage)()
            with model.disable_adapter(), ref.disable_adapter():  # the base weights alone
                out.append((model(input_ids=x).logits, ref(input_ids=x).logits, before))
    return out


def test_at_one_rank_a_merge_runs_as_peft_s():
    for got, want, before in run_world(1, merge_then_after, timeout=300)[0]:
        assert not torch.equal(want, before)  # the merge (and unmerge) moved the base weights
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def generate_uneven() -> tuple:
    """The wrapped PeftModel's generate where rank 0's sequence ends 5 tokens early,
    against the plain PeftModel's."""
    rank = dist.get_rank()
    model = lora_llama()
    ref = copy.deepcopy(model)
    prompt = torch.tensor([[5, 9, 13, 2]]) + rank
    with torch.no_grad():
        free = ref.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0,
                  eos_token_id=int(free[0, 6]) if rank == 0 else None)
        want = ref.generate(input_ids=prompt, **kw)
    fs.flex_shard(model)
    return model.generate(input_ids=prompt, **kw), want


def test_peft_generate_keeps_the_ranks_in_step():
    results = run_world(WORLD, generate_uneven, timeout=300)
    assert results[0][0].shape[1] < results[1][0].shape[1]  # the ranks did end apart
    for got, want in results:
        assert torch.equal(got, want)
