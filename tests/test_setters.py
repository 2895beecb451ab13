"""No setter invalidates a wrap-time decision: each re-plans what depends on it,
or refuses with a clear error before anything changes.

The case that trained silently wrong: a Hugging Face Llama, one Owned bucket per
layer plus a root bucket, 4 gloo ranks, wrapped with reshard_after_forward=True
(its Owned buckets then gathered compact on gloo), then set_reshard_after_forward(2):
the int reshard kept equal-segment slices of a compact gather output. Compact
gathers are gone (they saved at most 1.7% of peak memory, design.md); the case
stays, run with the Comm flex_shard picks on gloo, the path users get.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from training_helpers import full_grads

WORLD, STEPS = 4, 5
LR = 0.1  # SGD: AdamW would turn rounding noise into full steps on near-zero grads


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))


def buckets() -> list:
    return [fs.BucketSpec(f"model.layers.{i}.*", placement=fs.Owned()) for i in range(2)] + [
        fs.BucketSpec(["model.embed_tokens.*", "model.norm.*", "lm_head.*"],
                      placement=fs.Owned())]


def ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(step * 10 + rank))


def reference() -> tuple:
    """One process on every rank's batch: (losses, first grads, final params)."""
    torch.set_num_threads(1)
    model = llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first = [], None
    for step in range(STEPS):
        batch = torch.cat([ids(step, r) for r in range(WORLD)])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        first = first or {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first, {k: p.detach().clone() for k, p in model.named_parameters()}


def owned_with_setter() -> tuple:
    """Rank body: wrap with reshard True, then set_reshard_after_forward(2), train."""
    from flexshard.runtime.state import get_state

    rank = dist.get_rank()
    model = fs.flex_shard(llama(), buckets=buckets(), reshard_after_forward=True)
    layers = get_state(model).buckets[:2]
    model.set_reshard_after_forward(2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, first = [], None
    for step in range(STEPS):
        batch = ids(step, rank)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        first = first or full_grads(model)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    kept = sum(b.counters.post_forward_gathers for b in layers)
    comm = type(get_state(model).comm).__name__
    return losses, first, fs.full_state_dict(model), comm, kept


def test_owned_buckets_given_an_int_reshard_by_the_setter_train_as_one_process():
    ref_losses, ref_first, ref_params = reference()
    for losses, first, params, comm, kept in run_world(WORLD, owned_with_setter):
        assert comm == "GlooComm", "the case runs the Comm gloo users get"
        assert kept > 0, "backward regathered from the post-forward groups"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        for k, want in ref_first.items():
            torch.testing.assert_close(first[k], want, rtol=1e-5, atol=1e-7, msg=k)
        for k, want in ref_params.items():
            torch.testing.assert_close(params[k], want, rtol=1e-5, atol=1e-6, msg=k)


def setter_while_unsharded() -> None:
    model = fs.flex_shard(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                          buckets=[fs.BucketSpec("0.*"), fs.BucketSpec("1.*")])
    model.unshard()
    model.set_reshard_after_forward(False)


def test_reshard_setter_refuses_while_params_are_unsharded():
    expect_all_ranks_raise(2, setter_while_unsharded, RuntimeError,
                           r"set_reshard_after_forward: bucket '0\.\*' is unsharded; call it "
                           r"between training steps \(after backward, or after module\.reshard\(\)\)")


def reshard_between_forward_and_backward(value, no_grad: bool) -> int:
    """A forward (under torch.no_grad(): an evaluation), then
    set_reshard_after_forward(value), then the forward's backward (a step)."""
    from models import batch, loss_fn
    from reference import make_model

    model = fs.flex_shard(make_model(), reshard_after_forward=True)
    x, y = batch(0, dist.get_rank())
    with torch.set_grad_enabled(not no_grad):
        loss = loss_fn(model(x), y)
    model.set_reshard_after_forward(value)
    if no_grad:
        loss = loss_fn(model(x), y)
    loss.backward()
    return 1


@pytest.mark.parametrize("value", [False, 2], ids=["False", "2"])
def test_reshard_setter_refuses_between_forward_and_backward(value):
    """Accepted before: the backward then refilled params the setter had re-planned
    ("setStorage ... out of bounds", or a device move it never saw) on every rank."""
    expect_all_ranks_raise(WORLD, reshard_between_forward_and_backward, RuntimeError,
                           r"set_reshard_after_forward: bucket 'layers\.0' has a forward whose "
                           r"backward has not run.* between training steps, after backward",
                           value, False)
    assert run_world(WORLD, reshard_between_forward_and_backward, value, True) == [1] * WORLD


def divide_factor_mid_accumulation() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fs.flex_shard(torch.nn.Linear(8, 8), mesh)
    model.set_requires_all_reduce(False)
    model(torch.randn(4, 8)).sum().backward()
    model.set_gradient_divide_factor(2.0)


def test_divide_factor_refuses_while_a_deferred_all_reduce_holds_grads():
    expect_all_ranks_raise(4, divide_factor_mid_accumulation, ValueError,
                           r"set_gradient_divide_factor: bucket\(s\) \[.*\] hold reduced "
                           r"gradients whose all-reduce set_requires_all_reduce\(False\) deferred")


def resize_after_wrap(tied: bool) -> tuple:
    """resize_token_embeddings on a wrapped Llama: refused on every rank before it
    changes anything; the values and the vocabulary size stay."""
    model = llama()
    model.config.tie_word_embeddings = tied
    if tied:
        model.tie_weights()
    fs.flex_shard(model)
    before = fs.full_state_dict(model)
    try:
        model.resize_token_embeddings(140)
        said = None
    except RuntimeError as e:
        said = str(e)
    after = fs.full_state_dict(model)
    return said, model.config.vocab_size, all(torch.equal(after[k], v) for k, v in before.items())


def test_resize_token_embeddings_after_the_wrap_is_refused():
    """It used to resize each rank's piece as a whole table (a tied head kept the old
    shape, fs.full_state_dict returned the old values), or, untied, fail halfway."""
    for tied in (True, False):
        for said, vocab, unchanged in run_world(2, resize_after_wrap, tied):
            assert said is not None and "resize_token_embeddings() on a flex_shard model" in said \
                and "Resize before flex_shard" in said, said
            assert vocab == 128 and unchanged


# Ranks that set a setter differently (a rank-dependent rule, or accumulation over an
# uneven split of the data): one rank's backward skips or reorders a collective the
# others wait in. It hung until the process group's timeout (gloo's "Timed out waiting
# ... for recv"), or paired collectives wrongly: now every rank raises at the forward,
# before any gather, naming the setter, the bucket and each rank's value.

def set_differently(setter: str):
    """Rank body: a step, then rank 1 sets `setter` to another value than the
    others (HSDP's on a (2, 2) mesh), then a step."""
    from models import batch, loss_fn
    from reference import make_model
    from test_hsdp import hsdp_mesh

    mesh = hsdp_mesh((2, 2)) if setter == "set_requires_all_reduce" else None
    model = fs.flex_shard(make_model(), mesh)
    other = dist.get_rank() == 1
    value = {"set_requires_gradient_sync": not other, "set_requires_all_reduce": not other,
             "set_gradient_divide_factor": 2.0 if other else 4.0,
             "set_reshard_after_forward": not other, "set_prefetch_depth": 2 if other else 1}
    for step in range(2):
        if step == 1:
            getattr(model, setter)(value[setter])
        x, y = batch(step, dist.get_rank())
        loss_fn(model(x), y).backward()


SETTERS = ["set_requires_gradient_sync", "set_requires_all_reduce", "set_gradient_divide_factor",
           "set_reshard_after_forward", "set_prefetch_depth"]


@pytest.mark.parametrize("setter", SETTERS)
def test_ranks_that_set_differently_raise_on_every_rank(setter):
    value = {"set_requires_gradient_sync": "True", "set_requires_all_reduce": "True",
             "set_gradient_divide_factor": "4.0", "set_reshard_after_forward": "True",
             "set_prefetch_depth": "1"}[setter]
    bucket = "" if setter == "set_prefetch_depth" else " for bucket '[^']+'"
    expect_all_ranks_raise(WORLD, set_differently, ValueError,
                           rf"the ranks disagree on {setter}{bucket}: rank 0 has {value}, "
                           r"rank 1 has \S+, .*Call each setter alike on every rank",
                           setter, timeout=60)


def accumulate_over_uneven_batches():
    """Rank body: gradient accumulation that syncs on each rank's own last micro-batch,
    rank 0 holding two micro-batches a step and the others three."""
    from models import batch, loss_fn
    from reference import make_model

    model = fs.flex_shard(make_model())
    rank = dist.get_rank()
    micro_batches = 2 if rank == 0 else 3
    for i in range(micro_batches):
        model.set_requires_gradient_sync(i == micro_batches - 1)
        x, y = batch(i, rank)
        loss_fn(model(x), y).backward()


def test_accumulation_over_an_uneven_split_raises_on_every_rank():
    expect_all_ranks_raise(WORLD, accumulate_over_uneven_batches, ValueError,
                           r"disagree on set_requires_gradient_sync .* rank 0 has True, rank 1 "
                           r"has False.* same number of batches", timeout=60)
