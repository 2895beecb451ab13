"""gloo's rooted collectives: a speed-up for CPU runs with gloo only.

Audience: training and tests on CPUs with gloo; NCCL never takes this path (it keeps
all_gather_into_tensor / reduce_scatter_tensor). Switch: `Comm(rooted_on_gloo=False)`
turns it off, with the same results.

A flat buffer of at least `ROOTED_MIN_BYTES` per rank is gathered by one broadcast per
rank and reduced by one reduce per rank (each into its root's segment), all launched at
once. Measured (benchmarks/RESULTS.md, "Step time at 2 ranks"): a training step at 2
ranks went from 0.90 / 0.97x FSDP2's wall / CPU time with gloo's all_gather_into_tensor
and reduce_scatter_tensor to 0.81 / 0.87x. Below that size the one collective is kept
(one round trip instead of W), and above `ROOTED_MAX_RANKS` ranks the W launches per
collective would grow a bucket's step with the world. The broadcasts also take uneven
segments, which compact gathers of whole-tensor (Owned) buckets use.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

ROOTED_MIN_BYTES = 1 << 20
ROOTED_MAX_RANKS = 8


class Works:
    """Several launched collectives as one handle: `wait()` waits for each,
    then runs `then` once (the host's copy of a result out of its buffer)."""

    def __init__(self, works: Sequence[dist.Work], then: Optional[Callable[[], None]] = None):
        self.works, self.then = list(works), then

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


def takes_rooted(group) -> bool:
    """Whether `group` is gloo's and small enough for one launch per rank."""
    return (dist.get_backend(group) == dist.Backend.GLOO
            and dist.get_world_size(group) <= ROOTED_MAX_RANKS)


def broadcast_segments(output: torch.Tensor, input: torch.Tensor, segments: Sequence[tuple],
                       group, async_op: bool) -> Optional[Works]:
    """Rank k's `input` lands in `output[start:start + length]` on every rank,
    (start, length) = segments[k] (uneven, 0 allowed): one broadcast per
    non-empty segment."""
    start, length = segments[dist.get_rank(group)]
    mine = output[start:start + length]
    if length and mine.data_ptr() != input.data_ptr():
        mine.copy_(input[:length])
    works = [dist.broadcast(output[a:a + n], group=group, group_src=k, async_op=True)
             for k, (a, n) in enumerate(segments) if n]
    return _finish(Works(works), async_op)


def reduce_to_roots(output: torch.Tensor, input: torch.Tensor, group, async_op: bool,
                    op: dist.ReduceOp) -> Optional[Works]:
    """A reduce-scatter as one reduce per rank into its root's segment of `input`
    (scratch: overwritten), copied into `output` once done."""
    segments = input.view(dist.get_world_size(group), -1)
    works = [dist.reduce(seg, group=group, group_dst=k, op=op, async_op=True)
             for k, seg in enumerate(segments)]
    mine = segments[dist.get_rank(group)]
    return _finish(Works(works, lambda: output.copy_(mine)), async_op)


def _finish(works: Works, async_op: bool) -> Optional[Works]:
    if async_op:
        return works
    works.wait()
    return None
