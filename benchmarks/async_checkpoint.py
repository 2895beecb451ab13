"""How long an asynchronous checkpoint blocks the training loop: flexshard's
`fs.save_checkpoint(..., async_=True)` against FSDP2 + DCP's `async_save` of
DSD's state dicts (torchtitan's "async" mode: a gloo group of its own).

Both train the benchmark Llama (benchmarks/harness/model.py, hidden 384) from the
same weights on the same batches with AdamW, their steps alternating. Every
`--every` steps each saves; the blocked time is the wall time of the save call
(flexshard: its checks, barriers and the copy to CPU; FSDP2: get_state_dict and
async_save's copy). The write runs meanwhile; each library waits for its
previous write before its next save (that wait is reported apart).

    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 2 -m benchmarks.async_checkpoint

Rank 0 prints the medians and the ratio flexshard / FSDP2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

import flexshard as fs

from .harness.model import SHAPES, batch, build_model, loss_fn


def _flexshard(name: str):
    model = fs.flex_shard(build_model(name))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _fsdp2(name: str):
    model = build_model(name)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


class Saver:
    """One library's async saves: the blocked times and the waits."""

    def __init__(self, save) -> None:
        self.save, self.pending = save, None
        self.blocked, self.waited = [], []

    def __call__(self, step: int) -> None:
        start = time.perf_counter()
        if self.pending is not None:
            self.pending.result()
        waited = time.perf_counter()
        self.pending = self.save(step)
        done = time.perf_counter()
        self.waited.append(waited - start)
        self.blocked.append(done - waited)

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.result()


def _train_step(model, opt, name: str, step: int, rank: int) -> None:
    x, y = batch(name, step, rank, "cpu")
    loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama", choices=sorted(SHAPES),
                        help="model shape from benchmarks/harness/model.py (default llama)")
    parser.add_argument("--steps", type=int, default=12,
                        help="training steps to time (default 12)")
    parser.add_argument("--every", type=int, default=2,
                        help="save a checkpoint every N steps (default 2)")
    args = parser.parse_args(argv)
    owns_group = not dist.is_initialized()  # a caller's group (the tests') is used as it is
    if owns_group:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    # one directory for every rank: rank 0 makes it and removes it at the end
    root = [tempfile.mkdtemp(prefix="async-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    flex, flex_opt = _flexshard(args.model)
    fsdp, fsdp_opt = _fsdp2(args.model)
    group = dist.new_group(backend="gloo")  # FSDP2's writer collectives, as torchtitan's

    def fsdp_save(step):
        model_sd, optim_sd = get_state_dict(fsdp, fsdp_opt)
        return dcp.async_save({"model": model_sd, "optim": optim_sd}, process_group=group,
                              checkpoint_id=f"{root[0]}/fsdp2/step-{step}")

    savers = {"flexshard": Saver(lambda step: fs.save_checkpoint(
                  f"{root[0]}/flexshard", flex, flex_opt, step, keep=2, async_=True)),
              "fsdp2": Saver(fsdp_save)}
    pairs = {"flexshard": (flex, flex_opt), "fsdp2": (fsdp, fsdp_opt)}
    for step in range(1, args.steps + 1):
        for lib, (model, opt) in pairs.items():
            _train_step(model, opt, args.model, step, rank)
            if step % args.every == 0:
                savers[lib](step)
    for saver in savers.values():
        saver.finish()
    out = {lib: (statistics.median(s.blocked[1:] or s.blocked), statistics.median(s.waited))
           for lib, s in savers.items()}  # the first save makes groups and caches: left out
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root[0], ignore_errors=True)
        mb = sum(p.numel() * p.element_size() * 3 for p in build_model(args.model).parameters())
        print(f"{args.model}, {dist.get_world_size()} ranks, {len(savers['fsdp2'].blocked)} "
              f"saves each, params + AdamW state {mb / 2**20:.1f} MiB in all")
        for lib, (blocked, waited) in out.items():
            print(f"{lib:<10} blocked {blocked * 1e3:7.1f} ms (median)   waited for the "
                  f"previous write {waited * 1e3:7.1f} ms")
        print(f"blocked time flexshard / FSDP2: {out['flexshard'][0] / out['fsdp2'][0]:.2f}")
    if owns_group:
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
