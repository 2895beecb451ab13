"""One training step, a DCP save of get_state_dict, and a DSD load into a fresh model.

`python dcp_roundtrip.py flexshard|fsdp2 DIR` under torchrun (no destroy_process_group)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

dist.init_process_group("gloo")
which, directory = sys.argv[1], sys.argv[2]


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    if which == "flexshard":
        import flexshard as fs
        model = fs.flex_shard(model, buckets=[fs.BucketSpec(f"{i}.*") for i in range(4)])
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


model, opt = build()
model(torch.randn(8, 64)).square().mean().backward()
opt.step()
msd, osd = get_state_dict(model, opt)
dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
model2, opt2 = build()
model2(torch.randn(8, 64)).square().mean().backward()
opt2.step()
msd2, osd2 = get_state_dict(model2, opt2)
dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=directory)
set_state_dict(model2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
print("loaded")
