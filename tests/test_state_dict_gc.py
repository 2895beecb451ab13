"""flexshard finds the optimizers of wrapped models through one global
optimizer step pre-hook per process, which holds the models weakly.

Wrapping many models (a sweep, a notebook, a test suite) adds no hooks, and a
model collected while torch iterates its global pre-hooks (its hooks object
leaves the weak set mid-step) breaks nobody's optimizer.step().
"""

import gc

import torch
from torch.optim.optimizer import _global_optimizer_pre_hooks as global_optimizer_pre_hooks
from torch.optim.optimizer import register_optimizer_step_pre_hook

import flexshard as fs
from flexshard.checkpoint.pieces import ShardedPieces
from flexshard.runtime.state import get_state


def test_wrapping_ten_models_adds_at_most_one_global_hook():
    fs.flex_shard(torch.nn.Linear(3, 2))  # the process's hook exists from here on
    before = len(global_optimizer_pre_hooks)
    models = [fs.flex_shard(torch.nn.Linear(3, 2)) for _ in range(10)]
    assert len(global_optimizer_pre_hooks) == before
    del models
    gc.collect()
    assert len(global_optimizer_pre_hooks) == before


def test_the_one_hook_serves_every_live_model():
    models = [fs.flex_shard(torch.nn.Linear(3, 2)) for _ in range(3)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in models]
    for model, opt in zip(models, optimizers):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    for model, opt in zip(models, optimizers):
        hooks = get_state(model).state_dict_hooks.optimizers
        assert len(hooks.optimizer_handles) == 2  # state_dict post + load pre, on its optimizer only
        state = opt.state_dict()["state"][0]
        assert not isinstance(state["exp_avg"], ShardedPieces)  # world 1: the piece is the tensor
        torch.testing.assert_close(state["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_model_collected_during_an_optimizer_step():
    doomed: list = []

    def collect_the_doomed_model(optimizer, args, kwargs):
        doomed.clear()
        gc.collect()  # the doomed model's hooks leave the weak set inside torch's hook loop

    # Whether torch runs it before or after flexshard's hook, the collection must not
    # touch torch's hook dict.
    handle = register_optimizer_step_pre_hook(collect_the_doomed_model)
    try:
        doomed.append(fs.flex_shard(torch.nn.Linear(3, 2)))
        survivor = fs.flex_shard(torch.nn.Linear(3, 2))
        count = len(global_optimizer_pre_hooks)
        opt = torch.optim.SGD(survivor.parameters(), lr=0.1)
        survivor(torch.ones(1, 3)).sum().backward()
        before = survivor.weight.detach().clone()
        opt.step()
    finally:
        handle.remove()
    assert not doomed
    assert len(global_optimizer_pre_hooks) == count - 1  # only the test's own hook left
    torch.testing.assert_close(survivor.weight, before - 0.1 * survivor.weight.grad)
    opt.step()
