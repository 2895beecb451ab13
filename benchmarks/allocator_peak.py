"""A second memory meter: flexshard against FSDP2 by the CPU allocator's own events.

    PYTHONPATH=$PWD python -m benchmarks.allocator_peak [--model llama] [--world-size 2] [--breakdown 6]
        [--placement owned] [--dtype bf16]

`benchmarks/compare.py` tracks storages through a TorchDispatchMode; this one reads the
profiler's raw allocator records instead (every allocation and free the CPU allocator
sees, inside ops or not: `benchmarks/harness/allocator.py`, the meter `compile_bench.py`
uses too). For flexshard and FSDP2 (one group per block plus the root, reshard after
forward on and off, eager, AdamW; fp32 unless `--dtype`, flexshard's placement Shard(0)
unless `--placement`) it reports, for one step after two warm-up steps, the bytes
allocated minus freed: at their peak during the forward, at the end of the forward, at
their peak during the backward (counted from the step's start), and at their peak over the
whole step (optimizer included). What exists when the step begins (sharded params, AdamW
state) is in none of them. Rank 0's numbers, max over ranks for the whole-step peak; then,
per rank, the bytes resident when the step begins (the storages of the params and the
optimizer state, padding included) beside the step's peak.
"""

from __future__ import annotations

import argparse
import os
import sys

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import flexshard as fs

from .harness.allocator import allocated
from .harness.meters import distinct_storages
from .harness.model import batch, build_model, loss_fn
from .harness.runners import DTYPES, flexshard_placement

MIB = 2 ** 20


def wrap(name: str, runner: str, reshard: bool, placement: str = "shard",
         dtype: str = "fp32") -> torch.nn.Module:
    model = build_model(name)
    param_dtype = DTYPES[dtype]
    if runner == "flexshard":
        return fs.flex_shard(model, placement=flexshard_placement(placement),
                             mp_policy=fs.MixedPrecisionPolicy(param_dtype=param_dtype),
                             reshard_after_forward=reshard)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard, mp_policy=mp)
    return fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)


def measure(name: str, runner: str, reshard: bool, rank: int, placement: str = "shard",
            dtype: str = "fp32") -> dict:
    model = wrap(name, runner, reshard, placement, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        x, y = batch(name, i, rank, torch.device("cpu"))
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(2):
        step(i)
    x, y = batch(name, 2, rank, torch.device("cpu"))
    loss, fwd_end, fwd_peak, _ = allocated(lambda: loss_fn(model(x), y))
    _, _, bwd_peak, bwd_live = allocated(loss.backward)
    opt.step()
    opt.zero_grad(set_to_none=True)
    _, _, step_peak, step_live = allocated(lambda: step(3))
    peak = torch.tensor([float(step_peak)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"fwd_peak": fwd_peak, "fwd_end": fwd_end, "bwd_peak": fwd_end + bwd_peak,
            "step_peak": peak.item(), "step_peak_rank": step_peak, "bwd_live": bwd_live, "step_live": step_live,
            "resident": resident(model, opt)}


def resident(model, opt) -> int:
    """Bytes of the distinct storages under the params and the optimizer state: what
    the step's counts start from (a storage buffer's padding included; raw bytes, as
    the allocator's records count them)."""
    tensors = list(model.parameters())
    tensors += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(st.nbytes() for st in distinct_storages(tensors))


def _worker(rank: int, world: int, port: int, model: str, breakdown: int,
            placement: str, dtype: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    rows = [(runner, reshard, measure(model, runner, reshard, rank, placement, dtype))
            for reshard in (True, False) for runner in ("flexshard", "fsdp2")]
    every = [None] * world
    dist.all_gather_object(every, [(m["resident"], m["fwd_end"], m["bwd_peak"], m["step_peak_rank"])
                                   for _, _, m in rows])
    if rank == 0:
        print(f"model {model}, world size {world}, flexshard placement {placement}, "
              f"param dtype {dtype}, eager, torch {torch.__version__}")
        print("| reshard | runner | fwd peak MiB | fwd end MiB | bwd peak MiB | step peak MiB |")
        print("|---|---|---|---|---|---|")
        for runner, reshard, m in rows:
            print(f"| {'on' if reshard else 'off'} | {runner} | {m['fwd_peak'] / MIB:.3f} | "
                  f"{m['fwd_end'] / MIB:.3f} | {m['bwd_peak'] / MIB:.3f} | "
                  f"{m['step_peak'] / MIB:.3f} |")
        print("\nper rank, bytes: resident (params + optimizer state storages at the step's "
              "start) / step peak / resident + step peak")
        print("| reshard | runner | rank | resident | step peak | resident + step peak |")
        print("|---|---|---|---|---|---|")
        for k, (runner, reshard, _) in enumerate(rows):
            for r in range(world):
                res, _, _, peak = every[r][k]
                print(f"| {'on' if reshard else 'off'} | {runner} | {r} | {res} | {int(peak)} | "
                      f"{res + int(peak)} |")
        for runner, reshard, m in rows if breakdown else ():
            for key, what in (("bwd_live", "the backward's peak, allocated during the backward"),
                              ("step_live", "the whole step's peak (rank 0), allocated during the step")):
                print(f"\nlive at {what}: {runner}, reshard {'on' if reshard else 'off'} "
                      "(MiB, span / op)")
                print(f"  running at the peak: {m[key].running or '?'}")
                for (span, op), size in sorted(m[key].items(), key=lambda kv: -kv[1])[:breakdown]:
                    print(f"  {size / MIB:6.3f}  {span} / {op}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", help="a name in benchmarks/harness/model.py")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks to spawn (gloo, CPU; default 2)")
    parser.add_argument("--port", type=int, default=29617,
                        help="MASTER_PORT of the spawned ranks' process group (default 29617)")
    parser.add_argument("--breakdown", type=int, default=0, metavar="N",
                        help="also print the N largest groups live at the backward's peak")
    parser.add_argument("--placement", default="shard", choices=("shard", "ragged", "owned", "mixed"),
                        help="flexshard's placement (as benchmarks/compare.py names them)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                        help="param dtype of both runners' mixed precision (fp32: no cast)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_worker, (args.world_size, args.port, args.model, args.breakdown,
                                          args.placement, args.dtype),
                                nprocs=args.world_size)


if __name__ == "__main__":
    main()
