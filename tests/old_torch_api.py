"""One rank of flexshard on torch 2.11's API surface (run by tests/test_compat.py).

torch 2.13 renamed two names flexshard calls: dist.all_gather_into_tensor ->
dist.all_gather_single and dist.reduce_scatter_tensor -> dist.reduce_scatter_single (the
old names stay as deprecated aliases). Before flexshard is imported, this deletes the
new names and puts the implementation back under the old ones, as torch 2.11 has it,
counting the calls; then it trains TinyGPT with flex_shard on this rank's batches and
saves what train_sharded returns, for the test to compare with one process.

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python old_torch_api.py OUT_DIR
"""

from __future__ import annotations

import collections
import datetime
import os
import sys

import torch
import torch.distributed as dist

RENAMED = ((dist, "all_gather_single", "all_gather_into_tensor"),
           (dist, "reduce_scatter_single", "reduce_scatter_tensor"))
STEPS = 3
CALLS = collections.Counter()


def as_torch_2_11() -> None:
    """Remove torch 2.13's new names; the old ones call the implementation, counted."""
    for module, new, old in RENAMED:
        impl = getattr(module, new, None) or getattr(module, old)  # on torch 2.11 itself: old
        if hasattr(module, new):
            delattr(module, new)

        def counted(*args, _impl=impl, _old=old, **kwargs):
            CALLS[_old] += 1
            return _impl(*args, **kwargs)

        setattr(module, old, counted)


def main(out_dir: str) -> None:
    as_torch_2_11()
    tests = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(tests), tests]
    import flexshard as fs  # imported on the reduced surface
    from reference import train_sharded

    torch.set_num_threads(1)  # as the harness workers and reference_run
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    # fs.Comm(): every gather and reduce is the one collective (GlooComm would
    # broadcast large ones), so the renamed names carry the whole step.
    result = train_sharded(STEPS, {"comm": fs.Comm(), "reshard_after_forward": True})
    torch.save({"result": result[:3],  # losses, full params (rank 0), step-0 sharded grads
                "calls": dict(CALLS),
                "still_there": [new for module, new, _ in RENAMED if hasattr(module, new)]},
               os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip torch's teardown at exit (as tests/harness.py's workers do)


if __name__ == "__main__":
    main(sys.argv[1])
