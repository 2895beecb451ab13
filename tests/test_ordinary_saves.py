"""Saving a wrapped model the ordinary ways: torch.save(model.state_dict())
refuses clearly (it would write one rank's pieces), Hugging Face's
save_pretrained raises instead of hanging, and the documented export (full
state dict on every rank, save_pretrained(state_dict=...) on rank 0) gives a
model that from_pretrained loads, tied weights included."""

from __future__ import annotations

import io
import pickle
import re

import torch

import flexshard as fs
from ckpt_util import wrapped
from harness import expect_all_ranks_raise, run_world

STEPS = 2
VOCAB = 101


def _torch_save(placement_name, what):
    import torch.distributed as dist

    model, opt = wrapped(placement_name)
    model(torch.zeros(2, 5, dtype=torch.long)).sum().backward()
    opt.step()
    state_dict = model.state_dict() if what == "model" else opt.state_dict()
    copy = next(v for v in model.state_dict().values() if isinstance(v, fs.ShardedPieces) or
                dist.get_world_size() == 1).to("cpu", copy=True) if placement_name == "uneven" else None
    if copy is not None:  # a copy (DCP's stager, DSD's offload) pickles as its pieces
        again = pickle.loads(pickle.dumps(copy))
        assert type(again) is fs.ShardedPieces and torch.equal(again.local, copy.local)
        assert again.boxes == copy.boxes
    torch.save(state_dict, io.BytesIO())


def test_torch_save_of_the_state_dict_refuses():
    for placement in ("shard0", "uneven"):  # DTensor values, ShardedPieces values
        for what in ("model", "optimizer"):
            expect_all_ranks_raise(2, _torch_save, TypeError,
                                   r"cannot pickle a value of a flex_shard state dict, the "
                                   r"model's or its optimizer's.*"
                                   r"full = fs\.full_state_dict\(model\) on every rank and "
                                   r"torch\.save\(full, path\) on rank 0 \(an optimizer's: "
                                   r"fs\.full_optimizer_state_dict\(model, optimizer\)\).*fs\.save_checkpoint",
                                   placement, what)


def _read_storages(placement_name):
    """What safetensors (PEFT's save_pretrained) reads of each state-dict value
    before its bytes: the messages of untyped_storage() and storage() on a
    model value and an optimizer value, and the model value's data_ptr()."""
    model, opt = wrapped(placement_name)
    model(torch.zeros(2, 5, dtype=torch.long)).sum().backward()
    opt.step()
    value = model.state_dict()["tok.weight"]
    index = next(i for i, (k, _) in enumerate(model.named_parameters()) if k == "tok.weight")
    state = opt.state_dict()["state"][index]["exp_avg"]
    messages = []
    for read in (value.untyped_storage, value.storage, state.untyped_storage):
        try:
            read()
        except TypeError as err:
            messages.append(str(err))
    return messages, value.data_ptr()


def test_reading_a_state_dict_values_storage_names_the_key_and_the_fix():
    fix = (r" of a flex_shard state dict \(a model's or its optimizer's\) has no storage to "
           r"read: it is this rank's pieces of a \(37, 30\) tensor, not the tensor, so a "
           r"serializer reading its bytes \(safetensors, PEFT's save_pretrained\) cannot write "
           r"it\. Call full = fs\.full_state_dict\(model\) on every rank and save that on rank "
           r"0: save_pretrained\(path, state_dict=full\) \(docs/checkpoints\.md; an "
           r"optimizer's: fs\.full_optimizer_state_dict\(model, optimizer\)\); for a "
           r"resharding checkpoint, fs\.save_checkpoint\(directory, model, optimizer, step\)$")
    for messages, data_ptr in run_world(2, _read_storages, "shard0"):  # DTensor values
        assert len(messages) == 3, messages
        for message, key in zip(messages, ("tok.weight", "tok.weight", "tok.weight.exp_avg")):
            assert re.match(repr(key).replace(".", r"\.") + fix, message), message
        assert data_ptr == 0  # DCP's stager and DSD's offload read this as "no storage"


# Hugging Face: a tiny GPT-2 whose lm_head shares the embedding's weight.


def _gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()  # no dropout: one process and two ranks agree


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 * step + rank))


def _train(model, batches) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # SGD: a wrong gradient scale shows
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _export(directory):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = fs.flex_shard(_gpt2())
    _train(model, [_tokens(step, rank) for step in range(STEPS)])
    full = fs.full_state_dict(model)  # collective: every rank
    if rank == 0:
        plain = _gpt2(seed=1)
        plain.load_state_dict(full, strict=True)  # tied keys and buffers included
        model.save_pretrained(directory, state_dict=dict(full))  # it empties the dict it gets
    dist.barrier()
    return full if rank == 0 else None


def test_export_to_hugging_face_matches_one_process(tmp_path):
    from transformers import GPT2LMHeadModel

    full = run_world(2, _export, str(tmp_path))[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = _gpt2()
        _train(reference, [torch.cat([_tokens(s, 0), _tokens(s, 1)]) for s in range(STEPS)])
    finally:
        torch.set_num_threads(threads)
    expected = reference.state_dict()
    assert full.keys() == expected.keys()
    assert full["lm_head.weight"] is full["transformer.wte.weight"]
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-5, atol=1e-6, msg=k)
    ids = _tokens(9, 0)
    torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)


def _save_pretrained_unconverted(directory):
    fs.flex_shard(_gpt2()).save_pretrained(directory)  # reads model.state_dict()


def test_save_pretrained_of_the_sharded_model_raises_not_hangs(tmp_path):
    expect_all_ranks_raise(2, _save_pretrained_unconverted, NotImplementedError,
                           r"value of a flex_shard model's state_dict\(\).*call "
                           r"fs\.full_state_dict\(model\) on every rank.*"
                           r"save_pretrained\(\.\.\., state_dict=full\) on rank 0",
                           str(tmp_path), timeout=60)
