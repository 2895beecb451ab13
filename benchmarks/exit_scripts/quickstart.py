"""The README quickstart as written (no destroy_process_group), sharded by argv[1]
("flexshard": one flex_shard call; "fsdp2": fully_shard per layer plus the root;
"flexshard-pause50": flexshard with the exit handler's first version, a fixed 50 ms
pause instead of waiting for gloo's threads to sleep); argv[2]: all-reduces right
before exit (default 0); argv[3] "destroy": end with dist.destroy_process_group(), as a
careful script does (examples/train.py); "destroy-sleep": then a 0.1 s sleep, what
docs/troubleshooting.md advises scripts without flexshard."""
import os
import sys

import torch
import torch.distributed as dist

if "RANK" in os.environ:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
if sys.argv[1].startswith("flexshard"):
    import time

    import flexshard as fs
    from flexshard.wrap import teardown

    if sys.argv[1] == "flexshard-pause50":
        teardown.settle_threads = lambda: time.sleep(0.05)

    model = fs.flex_shard(model, buckets=[fs.BucketSpec(f"{i}.*") for i in range(4)])
else:
    from torch.distributed.fsdp import fully_shard

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
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 0):  # collectives right before exit
    dist.all_reduce(torch.ones(1000))
if sys.argv[3:4] in (["destroy"], ["destroy-sleep"]):
    dist.destroy_process_group()
if sys.argv[3:4] == ["destroy-sleep"]:
    import time

    time.sleep(0.1)
