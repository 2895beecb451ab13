"""The files a training step walks through: flexshard against FSDP2, in one process.

A newcomer follows a step by the files its calls cross. This counts them with
`sys.setprofile`: every Python call made inside a library's own package (flexshard/,
or torch/distributed/fsdp/ for FSDP2) during one forward, one backward and one
optimizer step, after a warm-up step. Per phase it reports the files entered, the
hops (a call from one of the library's files into another) and the hops back (a call
into a file that is already further down the call stack: a room the call came from).

The model is a fake world of 8 (torch's "fake" backend: the rank's own code runs,
collectives move nothing): two blocks of two linears plus an output layer, bf16
gathers and an fp32 reduce, resharding after forward, both libraries wrapped per
block plus root. Run it as `python -m benchmarks.step_walk` (`--calls` lists the
functions per file).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

PHASES = ("forward", "backward", "optimizer")


class Walk(NamedTuple):
    """What one phase crossed: calls per file, hops between files, hops back."""

    files: collections.Counter  # relative path -> calls made into it
    hops: collections.Counter  # (caller file, callee file) -> calls
    back: collections.Counter  # hops into a file already lower on the stack
    calls: collections.Counter  # (file, function) -> calls


class _Recorder:
    """A profile function recording the calls made into files under `root`."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.walk = Walk(*(collections.Counter() for _ in Walk._fields))

    def _rel(self, path: str):
        return path[len(self.root):] if path.startswith(self.root) else None

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        me = self._rel(frame.f_code.co_filename)
        if me is None:
            return
        self.walk.files[me] += 1
        self.walk.calls[(me, frame.f_code.co_name)] += 1
        below, f = [], frame.f_back
        while f is not None:
            rel = self._rel(f.f_code.co_filename)
            if rel is not None:
                below.append(rel)
            f = f.f_back
        if below and below[0] != me:
            self.walk.hops[(below[0], me)] += 1
            if me in below[1:]:
                self.walk.back[(below[0], me)] += 1


def _record(root: str, fn: Callable):
    recorder = _Recorder(root)
    sys.setprofile(recorder)
    threading.setprofile(recorder)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return recorder.walk, out


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Net(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(dim), _Block(dim)])
        self.out = nn.Linear(dim, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _flexshard(model: nn.Module):
    import flexshard as fs

    mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fs.flex_shard(model, mp_policy=mp), os.path.dirname(fs.__file__) + os.sep


def _fsdp2(model: nn.Module):
    import torch.distributed.fsdp as fsdp

    mp = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fsdp.fully_shard(layer, mp_policy=mp)
    return fsdp.fully_shard(model, mp_policy=mp), os.path.dirname(fsdp.__file__) + os.sep


LIBRARIES = {"flexshard": _flexshard, "fsdp2": _fsdp2}


def walk_step(library: str, world: int = 8) -> dict:
    """{phase: Walk} of one step of `library` (after a warm-up step), on one rank of a
    fake world of `world`. Starts and ends its own process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        torch.manual_seed(0)
        model, root = LIBRARIES[library](_Net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 64)
        for _ in range(2):  # the second step is the one kept
            walks = {}
            walks["forward"], loss = _record(root, lambda: model(x).float().square().mean())
            walks["backward"], _ = _record(root, loss.backward)
            walks["optimizer"], _ = _record(root, lambda: (opt.step(), opt.zero_grad()))
        return walks
    finally:
        dist.destroy_process_group()


def summary(walks: dict) -> dict:
    """Per phase and for the whole step: files, hops and hops back."""
    out = {phase: (len(w.files), sum(w.hops.values()), sum(w.back.values()))
           for phase, w in walks.items()}
    every = set().union(*(w.files for w in walks.values()))
    out["step"] = (len(every), sum(v[1] for v in out.values()), sum(v[2] for v in out.values()))
    return out


def _table(results: dict) -> str:
    rows = ["| phase | flexshard files | FSDP2 files | flexshard hops (back) | FSDP2 hops (back) |",
            "|---|---|---|---|---|"]
    for phase in PHASES + ("step",):
        fs_, f2 = results["flexshard"][phase], results["fsdp2"][phase]
        rows.append(f"| {phase} | {fs_[0]} | {f2[0]} | {fs_[1]} ({fs_[2]}) | {f2[1]} ({f2[2]}) |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8,
                        help="ranks of the fake world the one rank runs in (default 8)")
    parser.add_argument("--calls", action="store_true", help="list the calls per file")
    args = parser.parse_args(argv)
    results = {}
    for library in LIBRARIES:
        walks = walk_step(library, args.world)
        results[library] = summary(walks)
        print(f"## {library}")
        for phase, w in walks.items():
            print(f"{phase}: {', '.join(sorted(w.files))}")
            if args.calls:
                for (path, fn), n in sorted(w.calls.items()):
                    print(f"    {path} {fn} {n}")
    print(_table(results))


if __name__ == "__main__":
    main()
