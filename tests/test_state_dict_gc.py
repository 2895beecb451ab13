"""A wrapped model collected while torch runs its global optimizer pre-hooks.

flexshard's state-dict hooks find optimizers through one global optimizer
step pre-hook per wrapped model. Collecting a model must not remove that hook
mid-iteration: an unrelated optimizer.step() would then raise
"OrderedDict mutated during iteration".
"""

import gc

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import flexshard as fs


def test_model_collected_during_an_optimizer_step():
    doomed: list = []

    def collect_the_doomed_model(optimizer, args, kwargs):
        doomed.clear()
        gc.collect()  # runs the collected model's finalizer inside torch's hook loop

    # Registered first, so torch's loop has the models' hooks still to visit after it.
    handle = register_optimizer_step_pre_hook(collect_the_doomed_model)
    try:
        doomed.append(fs.flex_shard(torch.nn.Linear(3, 2)))
        survivor = fs.flex_shard(torch.nn.Linear(3, 2))
        opt = torch.optim.SGD(survivor.parameters(), lr=0.1)
        survivor(torch.ones(1, 3)).sum().backward()
        before = survivor.weight.detach().clone()
        opt.step()
    finally:
        handle.remove()
    assert not doomed
    torch.testing.assert_close(survivor.weight, before - 0.1 * survivor.weight.grad)
    opt.step()  # the collected model's hook stays a harmless no-op
