"""Overlap benchmark: step time with a slow injected network, prefetch on and off.

Every collective takes at least DELAY seconds (a Comm wrapper: the real gloo
collective runs, its wait() returns no earlier than DELAY after launch). With
prefetch the next bucket's gather and the reduce-scatters fly while blocks
compute, so a step costs less than the sum of its collectives' delays.

    PYTHONPATH=. python benchmarks/prefetch_overlap.py [--delay 0.02] [--steps 8] [--layers 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flexshard as fs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from models import TinyGPT, loss_fn  # noqa: E402  (the test model, for comparability)


class _Delayed:
    def __init__(self, work, delay):
        self.work, self.done_at = work, time.monotonic() + delay

    def wait(self, timeout=None):
        self.work.wait()
        time.sleep(max(0.0, self.done_at - time.monotonic()))
        return True


class SlowComm(fs.GlooComm):
    """Collectives that take at least `delay` seconds each."""

    def __init__(self, delay: float):
        self.delay = delay

    def all_gather(self, output, input, group, async_op=False):
        work = _Delayed(super().all_gather(output, input, group, True), self.delay)
        return work if async_op else work.wait() and None

    def reduce_scatter(self, output, input, group, async_op=False):
        work = _Delayed(super().reduce_scatter(output, input, group, True), self.delay)
        return work if async_op else work.wait() and None


def _model(layers: int):
    torch.manual_seed(0)
    return TinyGPT(dim=96, heads=4, hidden=384, layers=layers, seq=64, vocab=512)


def _steps(rank, depth, args) -> list:
    model = fs.flex_shard(_model(args.layers), comm=SlowComm(args.delay))
    model.set_prefetch_depth(depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps + 2):
        data = torch.randint(0, 512, (8, 65), generator=g)
        dist.barrier()
        start = time.perf_counter()
        loss_fn(model(data[:, :-1]), data[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return times[2:]  # the first step records the execution order


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {depth: _steps(rank, depth, args) for depth in (0, 1, 2)}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=0.02,
                        help="seconds every collective is held back, to stand for a slow network "
                             "(default 0.02)")
    parser.add_argument("--steps", type=int, default=8,
                        help="training steps timed (default 8)")
    parser.add_argument("--layers", type=int, default=6,
                        help="blocks of the model, one bucket each (default 6)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
    results = queue.get(timeout=10)
    buckets = args.layers + 1
    collectives = 2 * buckets - 1 + buckets
    print(f"2 ranks, gloo, {args.layers} blocks, {collectives} collectives per step, "
          f"each delayed to >= {args.delay * 1000:.0f} ms ({collectives * args.delay * 1000:.0f} ms "
          "if serial)")
    for depth, times in results.items():
        print(f"prefetch depth {depth}: median step {statistics.median(times) * 1000:.1f} ms "
              f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}, {len(times)} steps)")


if __name__ == "__main__":
    main()
