"""docs/checkpoints.md's round trip as a user writes it: train a step, fs.save_checkpoint,
fs.load_checkpoint into a fresh wrapped model (no destroy_process_group).

`python fs_checkpoint.py DIR` under torchrun."""
import sys

import torch
import torch.distributed as dist

import flexshard as fs

dist.init_process_group("gloo")
directory = sys.argv[1]


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    model = fs.flex_shard(model, buckets=[fs.BucketSpec(f"{i}.*") for i in range(4)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


model, opt = build()
model(torch.randn(8, 64)).square().mean().backward()
opt.step()
fs.save_checkpoint(directory, model, opt, step=1)
resumed, resumed_opt = build()
print("resumed at step", fs.load_checkpoint(directory, resumed, resumed_opt))
