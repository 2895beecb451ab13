"""Compiled vs eager flexshard, and the gather in hooks vs in the graph: step time
and peak memory, reshard on and off.

    PYTHONPATH=$PWD python -m benchmarks.compile_bench [--model llama] [--world-size 2]

For each reshard setting one model per mode trains `benchmarks/harness/model.py`'s
model under flex_shard (one bucket per block plus root): "eager"; "hooks", every block
compiled after flex_shard (`block.compile()`, inductor), the gather in flexshard's
eager hooks around it; "whole", the whole model compiled with every gather and
gradient reduction inside the graph (`fs.compile`, reshard = the compiler's selective
recompute of the gather); "whole-aot", the same with the aot_eager backend
(AOTAutograd's graphs run by eager kernels), to tell the partitioner's choices from
inductor's.
Warm-up steps (the compiles among them) are not timed; then the modes take turns,
one step each, the order rotating every round, so load on a shared machine falls on
all of them alike. Wall and process CPU time per step: the slowest rank's, median
and range over the timed steps. Peak memory is the highest sum of live CPU
allocations during one step, read from the profiler's allocator events (these see
inductor's buffers as much as eager's, which a TorchDispatchMode would not), max
over ranks and over `--peak-steps` steps.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python -m benchmarks.compile_bench --fake-world 8

`--fake-world N`: peak memory of one forward+backward, eager against compiled blocks,
flexshard against FSDP2, at one rank of a fake world of N ranks ("FSDP2's peak fell with
compile"): harness/fake_world.py's model and wrapping (HF Llama, bf16 params, fp32
reduce, reshard after forward; `--modes` eager and/or compile, torch.compile of each
block), after `--warmup` steps. The peak is read from the same allocator events. Printed
per side and mode: the peak, what ran at the peak, and the `--top` largest live groups.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist

import flexshard as fs

from .harness.allocator import allocated
from .harness.fake_world import PRESETS, Side, fake_world
from .harness.model import batch, build_model, loss_fn

MODES = ("eager", "hooks", "whole")  # and "whole-aot" (backend aot_eager), on request
FAKE_WORLD_MODES = ("eager", "compile")  # --fake-world: torch.compile of each block, or not
MIB = 2 ** 20


def _step(model, opt, name: str, step: int, rank: int) -> float:
    x, y = batch(name, step, rank, torch.device("cpu"))
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def peak_bytes(run) -> int:
    """Peak of live CPU allocator bytes while `run()` runs (profiler memory events;
    an allocation or free outside every op, e.g. inductor's buffers, counts too)."""
    return allocated(run)[2]


def build(name: str, mode: str, reshard):
    model = fs.flex_shard(build_model(name), reshard_after_forward=reshard)
    if mode == "whole":
        fs.compile(model, fullgraph=True)
    elif mode == "whole-aot":  # the same graphs, AOTAutograd without inductor
        fs.compile(model, fullgraph=True, backend="aot_eager")
    for block in model.layers if mode == "hooks" else ():
        block.compile()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _timed(model, opt, name: str, step: int, rank: int) -> tuple:
    dist.barrier()
    w, c = time.perf_counter(), time.process_time()
    loss = _step(model, opt, name, step, rank)
    return time.perf_counter() - w, time.process_time() - c, loss


def run_reshard(name: str, modes, reshard, args) -> list:
    """One row per mode: the modes' timed steps interleaved, then their peaks."""
    rank = dist.get_rank()
    runs = {mode: build(name, mode, reshard) for mode in modes}
    for mode, (model, opt) in runs.items():
        for step in range(args.warmup):
            _step(model, opt, name, step, rank)
    times = {mode: [] for mode in modes}
    losses = {}
    for i in range(args.steps):
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        for mode in order:
            wall, cpu, losses[mode] = _timed(*runs[mode], name, args.warmup + i, rank)
            times[mode].append((wall, cpu))
    rows = []
    for mode in modes:
        model, opt = runs[mode]
        peak = max(peak_bytes(lambda: _step(model, opt, name, args.warmup + args.steps + k, rank))
                   for k in range(args.peak_steps))
        per_step = torch.tensor(times[mode] + [(float(peak), 0.0)])
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # the slowest rank, step by step
        walls, cpus = per_step[:-1, 0].tolist(), per_step[:-1, 1].tolist()
        rows.append({"mode": mode, "reshard": reshard, "wall": _spread(walls),
                     "cpu": _spread(cpus), "peak_mib": per_step[-1, 0].item() / 2**20,
                     "loss": losses[mode]})
    return rows


def _spread(values: list) -> tuple:
    return statistics.median(values), min(values), max(values)


def _worker(rank: int, world: int, port: int, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    rows = [row for reshard in args.reshard
            for row in run_reshard(args.model, args.modes, reshard, args)]
    if rank == 0:
        print(f"model {args.model}, world size {world}, {args.steps} timed steps per mode "
              f"(interleaved) after {args.warmup} warm-up, CPU inductor, torch {torch.__version__}, "
              f"load average at the end {os.getloadavg()[0]:.1f}")
        print("| reshard | mode | wall s/step median [min, max] | CPU s/step median [min, max] "
              "| peak MiB | last loss |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {_reshard_name(r['reshard'])} | {r['mode']} | {_fmt(r['wall'])} | "
                  f"{_fmt(r['cpu'])} | {r['peak_mib']:.2f} | {r['loss']:.5f} |")
    dist.destroy_process_group()


def _reshard_name(reshard) -> str:
    return ("on" if reshard else "off") if isinstance(reshard, bool) else str(reshard)


def _reshard_value(word: str):
    """--reshard's on / off / N as reshard_after_forward's True / False / N."""
    if word in ("on", "off"):
        return word == "on"
    if word.isdigit():
        return int(word)
    raise argparse.ArgumentTypeError(f"--reshard takes on, off or an int, not {word!r}")


def _fmt(spread: tuple) -> str:
    return "{:.3f} [{:.3f}, {:.3f}]".format(*spread)


def fake_world_peaks(args) -> None:
    """--fake-world N: per mode and side, the peak of one forward+backward after
    `args.warmup` steps, what ran at the peak and the largest live groups."""
    device = torch.device("cpu")
    with fake_world(args.fake_world, 0, device) as mesh:
        for mode in args.modes:
            for side in ("fsdp2", "flexshard"):
                s = Side(side, mode, PRESETS["cpu"], mesh, device)
                for _ in range(args.warmup):
                    s.step()
                _, _, peak, live = allocated(s.forward_backward)
                s.optimizer_step()
                print(f"{mode:8s} {side:9s} peak {peak / MIB:6.1f} MiB at {live.running}")
                for (span, op), n in sorted(live.items(), key=lambda kv: -kv[1])[:args.top]:
                    print(f"    {n / MIB:6.1f} MiB  {span} / {op}")
                del s
                gc.collect()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="even", help="a name in benchmarks/harness/model.py")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks to spawn (gloo, CPU; default 2)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps before the timed ones, compilation included "
                             "(default 3); with --fake-world, forward+backward passes before "
                             "the measured one")
    parser.add_argument("--steps", type=int, default=8,
                        help="timed steps (default 8)")
    parser.add_argument("--peak-steps", type=int, default=2,
                        help="steps whose peak memory is read after the timed ones (default 2)")
    parser.add_argument("--modes", nargs="+", default=None,
                        help="of " + ", ".join(MODES + ("whole-aot",)) + " (default "
                             + ",".join(MODES) + "; commas or spaces); with --fake-world of "
                             + " and ".join(FAKE_WORLD_MODES) + " (default both)")
    parser.add_argument("--reshard", default="on,off",
                        help="comma-separated settings of on, off and N (an int "
                             "reshard_after_forward: keep 1/N, regather within N ranks; "
                             "N divides --world-size) (default on,off)")
    parser.add_argument("--port", type=int, default=29613,
                        help="MASTER_PORT of the spawned ranks' process group (default 29613)")
    fake = parser.add_argument_group("fake world (peak memory at one rank of N, one process)")
    fake.add_argument("--fake-world", type=int, default=None, metavar="N",
                      help="instead of the timed runs: each side's peak, eager and compiled "
                           "blocks, at rank 0 of N ranks")
    fake.add_argument("--top", type=int, default=6,
                      help="with --fake-world: largest live allocation groups printed at the "
                           "peak (default 6)")
    args = parser.parse_args(argv)
    default = FAKE_WORLD_MODES if args.fake_world is not None else MODES
    args.modes = tuple(m for arg in args.modes or default for m in arg.split(",") if m)
    try:
        args.reshard = [_reshard_value(word) for word in args.reshard.split(",") if word]
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.fake_world is not None:
        fake_world_peaks(args)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_worker, (args.world_size, args.port, args),
                                nprocs=args.world_size)


if __name__ == "__main__":
    main()
