"""Python-side cost of one bucket's data path per step, against the world size.

One process, no process group: a bucket of rank 0 in a simulated world of W
ranks, whose Comm only copies its own segment (LocalComm), so what is timed
is flexshard's own work per step: the gather (launch, copy-in), building the
unsharded params (copy-out), packing the grads, the reduce-scatter launch and
the sharded grads (divide, cast). It must not grow with W.

    PYTHONPATH=. python -m benchmarks.hot_path [--worlds 2 8 64 256 1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import flexshard as fs
from flexshard.runtime.bucket import Bucket
from flexshard.planning.layout import SlotPlan, bind_placements

WORLDS = (2, 8, 64, 256, 1024)
HIDDEN = 64  # small tensors: the time is the Python side, not the bytes


class LocalComm(fs.Comm):
    """Rank `rank` of a simulated world: collectives copy this rank's own
    segment and nothing else (one op each, whatever the world size)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def all_gather(self, output, input, group, async_op=False):
        n = input.numel()
        output[self.rank * n:(self.rank + 1) * n].copy_(input)

    def reduce_scatter(self, output, input, group, async_op=False, op=None):
        output.copy_(input.view(-1, output.numel())[self.rank])

    def all_gather_groups(self, outputs, inputs, group, async_op=False):
        """A bucket's gather groups: one copy each (a coalesced launch's stand-in)."""
        for output, input in zip(outputs, inputs):
            self.all_gather(output, input, group)

    def reduce_scatter_groups(self, outputs, inputs, group, async_op=False, op=None,
                              uneven=None):
        """Uneven groups (whole tensors on unequal ranks): this rank's piece, one copy."""
        for k, (output, input) in enumerate(zip(outputs, inputs)):
            sizes = None if uneven is None else uneven[k]
            if sizes is not None:
                output[:sizes[self.rank]].copy_(input.split(sizes)[self.rank])
            else:
                self.reduce_scatter(output, input, group, **({} if op is None else {"op": op}))


def block_shapes(hidden: int = HIDDEN) -> list:
    """A transformer block: attention and MLP matrices, norms, a bias."""
    h = hidden
    return [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h), (h,), (h,), (4 * h,)]


def make_bucket(world: int, placement, shapes=None, mp=None, comm=None) -> Bucket:
    """Rank 0's bucket of `shapes` (fp32) in a simulated world of `world` ranks."""
    shapes = [torch.Size(s) for s in (shapes or block_shapes())]
    entries = [(s, 4, placement) for s in shapes]
    bound = bind_placements(entries, world)
    slots = [SlotPlan(f"p{i}", s, torch.float32, pl,
                      tuple(pl.local_shape(s, r, world) for r in range(world)))
             for i, (s, pl) in enumerate(zip(shapes, bound))]
    return Bucket("block", slots, [True] * len(slots), mp or fs.MixedPrecisionPolicy(),
                  False, None, 0, world, comm or LocalComm(), torch.device("cpu"))


def step(bucket: Bucket, grads: list) -> list:
    """One step of the data path: gather, unsharded params, reduce, sharded grads."""
    outs = bucket.gather.gather()
    return outs, bucket.grads.finish(bucket.grads.start(grads))


def time_world(world: int, placement, steps: int, mp=None, hidden: int = HIDDEN) -> float:
    """Median microseconds per step (process CPU time, after a warm-up)."""
    bucket = make_bucket(world, placement, block_shapes(hidden), mp=mp)
    grads = [torch.ones(s.shape) for s in bucket.slots]
    for _ in range(5):
        step(bucket, grads)
    times = []
    for _ in range(steps):
        start = time.process_time()
        step(bucket, grads)
        times.append(time.process_time() - start)
    times.sort()
    return times[len(times) // 2] * 1e6


PLACEMENTS = {
    "Shard(0)": fs.Shard(0),
    "RaggedShard()": fs.RaggedShard(),
    "Shard(1)": fs.Shard(1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS),
                        help="world sizes to time, each a fake world in this process "
                             "(default 2 8 64 256 1024)")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps timed per world size (default 200)")
    parser.add_argument("--hidden", type=int, default=HIDDEN,
                        help="model width: small, so the time is the Python side (default 64)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    casts = {"fp32": None, "bf16 cast": fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    print(f"hidden {args.hidden}, {sum(math.prod(s) for s in block_shapes(args.hidden))} "
          "params per bucket; "
          "median CPU microseconds per step")
    print("| placement | dtype | " + " | ".join(f"W={w}" for w in args.worlds) + " |")
    print("|---|---|" + "---|" * len(args.worlds))
    for name, placement in PLACEMENTS.items():
        for cast, mp in casts.items():
            cells = [f"{time_world(w, placement, args.steps, mp, args.hidden):.0f}"
                     for w in args.worlds]
            print(f"| {name} | {cast} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
