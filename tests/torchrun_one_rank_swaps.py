"""Run under torchrun by tests/test_training_mistakes.py: rank 1 alone swaps the
tensor under a sharded param after a step; its next forward raises, and the job
must end (rank 0, waiting in the gather, must not hang)."""

import torch.distributed as dist

import flexshard as fs
from models import batch, loss_fn
from reference import make_model

model = fs.flex_shard(make_model())
rank = dist.get_rank()
x, y = batch(0, rank)
loss_fn(model(x), y).backward()
if rank == 1:
    model.head.weight.data = model.head.weight.data.clone()
model(x)
