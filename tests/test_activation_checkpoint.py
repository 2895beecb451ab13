"""The user's own activation checkpointing composes with reshard-after-forward:
correct gradients, each block recomputed once, the gather redone inside it."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

import flexshard as fs
from harness import run_world
from models import TinyGPT, batch, loss_fn
from reference import LR, assert_rel_close, reference_run
from training_helpers import (CountingComm, MatmulLog, UnshardedTracker,
                              check_against_reference, settled, train)

STEPS = 3


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose forward checkpoints each block itself."""

    def __init__(self, use_reentrant: bool, **kw) -> None:
        super().__init__(**kw)
        self.use_reentrant = use_reentrant

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=self.use_reentrant)
        return self.head(self.norm(x))


def ac_model(kind: str):
    """kind: 'none', 'reentrant', 'non_reentrant' (checkpoint() in forward) or
    'wrapper' (checkpoint_wrapper around each block)."""
    torch.manual_seed(0)
    if kind in ("reentrant", "non_reentrant"):
        return CheckpointedGPT(use_reentrant=kind == "reentrant")
    model = TinyGPT()
    if kind == "wrapper":
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    return model


def ac_training(kind: str) -> tuple:
    """Rank body: train, then count one step's backward matmuls and collectives."""
    comm = CountingComm()
    model = fs.flex_shard(ac_model(kind), comm=comm)
    losses = train(model, STEPS)
    comm.reset()
    tracker = UnshardedTracker(model)
    x, y = batch(0, torch.distributed.get_rank())
    loss = loss_fn(model(x), y)
    live_after_forward = settled(lambda: sorted(tracker.live_bytes()), ["root"])
    with MatmulLog() as log:
        loss.backward()
    calls, plan = dict(comm.calls), fs.describe(model)
    return losses, fs.full_state_dict(model), log.count, calls, live_after_forward, plan


def reference_backward_matmuls(kind: str) -> int:
    model = ac_model(kind)
    x, y = batch(0, 0)
    loss = loss_fn(model(x), y)
    with MatmulLog() as log:
        loss.backward()
    return log.count


@pytest.mark.parametrize("kind", ["non_reentrant", "reentrant", "wrapper"])
def test_user_checkpointing_composes(kind):
    results = run_world(2, ac_training, kind)
    losses, full, matmuls, calls, live, plan = results[0]
    check_against_reference(losses, full, 2, STEPS, model=ac_model(kind))
    # Each block's forward is recomputed once in backward (by the user's checkpoint),
    # never twice: as many backward matmuls as the unsharded checkpointed model.
    recomputing = reference_backward_matmuls(kind)
    assert recomputing > reference_backward_matmuls("none")
    for _, _, rank_matmuls, rank_calls, rank_live, _ in results:
        assert rank_matmuls == recomputing
        # The recompute regathers each block bucket once: the plan's count holds.
        assert rank_calls["all_gather"] == plan.gathers_per_step
        assert rank_calls["reduce_scatter"] == plan.reduces_per_step
        # Between forward and backward only the root bucket's params are unsharded.
        assert rank_live == ["root"]


# A checkpoint of part of a block (its MLP's linears) or of a module of the root's
# bucket (the head) recomputes that module in backward without any hooks of its own:
# it must read the params its forward used, as under FSDP2's pre-backward unshard.


class HeadCheckpointedGPT(TinyGPT):
    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return checkpoint(self.head, self.norm(x), use_reentrant=False)


def parts_model(kind: str):
    """kind 'wrapper': checkpoint_wrapper around each block's up/down and the head;
    'fn': checkpoint(self.head, ...) in forward and a wrapper around each block's up."""
    torch.manual_seed(0)
    model = TinyGPT() if kind == "wrapper" else HeadCheckpointedGPT()
    for layer in model.layers:
        layer.up = checkpoint_wrapper(layer.up)
        if kind == "wrapper":
            layer.down = checkpoint_wrapper(layer.down)
    if kind == "wrapper":
        model.head = checkpoint_wrapper(model.head)
    return model


def parts_training(kind: str) -> tuple:
    model = fs.flex_shard(parts_model(kind))
    return train(model, STEPS), fs.full_state_dict(model)


@pytest.mark.parametrize("kind", ["wrapper", "fn"])
def test_checkpointing_part_of_a_block_or_a_root_module_trains(kind):
    for losses, full in run_world(2, parts_training, kind):
        check_against_reference(losses, full, 2, STEPS, model=parts_model(kind))


# transformers' gradient checkpointing checkpoints each layer's forward inside its call,
# so backward recomputes it without the module's hooks, with the params the modules hold.

HF_STEPS, HF_LR = 3, 0.5


def hf_llama(use_reentrant: bool):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    # the name since transformers 5.2x; gradient_checkpointing_enable before
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable({"use_reentrant": use_reentrant})
    return model.train()


def hf_ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(10 * step + rank))


def hf_train(model, ids_of) -> tuple:
    """SGD steps on `ids_of(step)`: (losses, first step's grads, params, MLP forwards a step)."""
    opt = torch.optim.SGD(model.parameters(), lr=HF_LR)
    calls = []
    # a pre-hook: a non-reentrant recompute stops once it has what backward needs
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    losses, first = [], None
    for step in range(HF_STEPS):
        ids = ids_of(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if first is None:
            first = fs.full_grads(model) if hasattr(model, "unshard") else \
                {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, first, len(calls) / HF_STEPS


def hf_sharded(use_reentrant: bool, reshard: bool) -> tuple:
    """Rank body: the layers checkpointed by transformers, then flex_shard."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = fs.flex_shard(hf_llama(use_reentrant), reshard_after_forward=reshard)
    losses, first, calls = hf_train(model, lambda step: hf_ids(step, rank))
    mean = [loss.clone() for loss in losses]
    for loss in mean:
        dist.all_reduce(loss)
    return [float(m) / world for m in mean], first, fs.full_state_dict(model), calls


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_transformers_gradient_checkpointing_trains_as_one_process(use_reentrant, reshard):
    ref = hf_llama(use_reentrant)
    losses, first, calls = hf_train(ref, lambda step: torch.cat([hf_ids(step, r) for r in (0, 1)]))
    assert calls == 2  # each layer recomputed in backward: checkpointing is on
    for got_losses, got_first, full, got_calls in run_world(2, hf_sharded, use_reentrant, reshard):
        assert got_calls == 2
        torch.testing.assert_close(torch.tensor(got_losses), torch.stack(losses), rtol=1e-5, atol=0)
        for name, grad in first.items():
            torch.testing.assert_close(got_first[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        for name, param in ref.state_dict().items():
            torch.testing.assert_close(full[name], param, rtol=1e-5, atol=1e-6, msg=name)


# Names: checkpoint_wrapper's `_checkpoint_wrapped_module.` is not in the state dict's keys.

WRAPPED = "_checkpoint_wrapped_module."


def _sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


def _wrapped_full_state():
    """Rank body: SGD steps of the checkpoint_wrapper-ed model; its full state
    dict and step-0 full grads, then that state dict loaded into a plain TinyGPT
    and into fresh wrapped models (each full-tensor loader, and the old prefixed
    keys), read back."""
    model = fs.flex_shard(ac_model("wrapper"))
    opt = _sgd(model)
    for step in range(STEPS):
        x, y = batch(step, torch.distributed.get_rank())
        loss_fn(model(x), y).backward()
        grads = fs.full_grads(model) if step == 0 else grads
        opt.step()
        opt.zero_grad()
    full = fs.full_state_dict(model)
    plain = TinyGPT()
    plain.load_state_dict(full)  # strict: exactly the plain model's keys
    prefixed = {k: full[k.replace(WRAPPED, "")] for k, _ in
                ac_model("wrapper").named_parameters(remove_duplicate=False)}
    loaded = {}
    for how, source in (("full", full), ("prefixed", prefixed), ("pretrained", full),
                        ("load_state_dict", full)):
        fresh = fs.flex_shard(ac_model("wrapper"))
        if how == "pretrained":
            assert fs.load_pretrained(fresh, source) == ([], [])
        elif how == "load_state_dict":
            fresh.load_state_dict(source)
        else:
            fs.load_full_state_dict(fresh, source)
        loaded[how] = fs.full_state_dict(fresh)
    return full, grads, plain.state_dict(), loaded


def test_full_state_dict_of_wrapped_blocks_has_the_plain_models_keys():
    ref_losses, ref_params, ref_grads = reference_run(
        2, STEPS, lr=LR, make_opt=_sgd, model_kw={})
    plain_keys = list(TinyGPT().state_dict())
    assert not any(WRAPPED in k for k in plain_keys)
    for full, grads, plain, loaded in run_world(2, _wrapped_full_state):
        assert list(full) == plain_keys and grads.keys() == ref_grads.keys()
        for k, ref in ref_params.items():
            assert_rel_close(full[k], ref, 1e-5, k)
        for k, ref in ref_grads.items():
            assert_rel_close(grads[k], ref, 1e-5, f"grad of {k}")
        for k in plain_keys:
            assert torch.equal(plain[k], full[k]), k
            for how, values in loaded.items():
                assert torch.equal(values[k], full[k]), f"{how}: {k}"
