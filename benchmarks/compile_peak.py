"""Peak memory of one forward+backward, eager against compiled blocks, flexshard
against FSDP2, at a fake world (issue 34, goal 6: "FSDP2's peak fell with compile").

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python -m benchmarks.compile_peak [--world 8] [--modes eager compile]

One rank of a fake world (benchmarks/fake_world.py's model and wrapping: HF Llama,
bf16 params, fp32 reduce, reshard after forward; "compile" is torch.compile of each
block). The peak is read from the CPU allocator's own events
(benchmarks/allocator_peak.allocated), which see inductor's buffers as much as eager
ones; a TorchDispatchMode meter would make dynamo run the compiled blocks eagerly.
Printed per side and mode: the peak, what ran at the peak, and the largest live groups.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch

from .allocator_peak import allocated
from .fake_world import PRESETS, Side, fake_world

MIB = 2 ** 20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8,
                        help="ranks of the fake world (default 8)")
    parser.add_argument("--modes", nargs="+", default=["eager", "compile"],
                        help="eager and/or compile (torch.compile of each block) (default both)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="forward+backward passes before the measured one (default 3)")
    parser.add_argument("--top", type=int, default=6,
                        help="largest live allocation groups printed at the peak (default 6)")
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    with fake_world(args.world, 0, device) as mesh:
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


if __name__ == "__main__":
    main()
