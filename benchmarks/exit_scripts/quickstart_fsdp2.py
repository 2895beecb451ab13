"""The README quickstart with FSDP2's fully_shard per layer plus root (no destroy_process_group); argv[1]: all-reduces at the end."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

if "RANK" in os.environ:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    loss = model(torch.randn(8, 64)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"loss {loss.item():.4f}")
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 0):  # collectives right before exit
    dist.all_reduce(torch.ones(1000))
