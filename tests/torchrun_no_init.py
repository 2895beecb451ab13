"""Run under torchrun by tests/test_training_mistakes.py: flex_shard with no
dist.init_process_group call, then SGD steps; rank 0 saves what it saw."""

import os
import sys

import torch
import torch.distributed as dist

import flexshard as fs
from models import batch, loss_fn
from reference import make_model

model = make_model()
rows = model.head.weight.shape[0]
fs.flex_shard(model)  # no process group yet: torchrun's environment gives one
rank, world = dist.get_rank(), dist.get_world_size()
opt = torch.optim.SGD(model.parameters(), lr=float(sys.argv[2]))
losses = []
for step in range(int(sys.argv[3])):
    x, y = batch(step, rank)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(mean.item() / world)
full = fs.full_state_dict(model)
if rank == 0:
    torch.save({"world": world, "backend": dist.get_backend(), "losses": losses, "full": full,
                "rows": (model.head.weight.shape[0], rows)}, sys.argv[1])
dist.barrier()
dist.destroy_process_group()
# This test checks the process group flex_shard set up; a finished run's exit under
# load (gloo's teardown) is issue 35's other part, stress-tested on its own.
os._exit(0)
