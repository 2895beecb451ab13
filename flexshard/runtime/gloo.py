"""gloo's rooted collectives: a speed-up for CPU runs with gloo only.

Audience: training and tests on CPUs with gloo. `comm_for` gives a model on a gloo
process group a `GlooComm`; NCCL (and any other backend) gets the plain `Comm`, whose
all_gather_single / reduce_scatter_single GlooComm keeps below its threshold.
Switch: pass `comm=fs.Comm()` to flex_shard for gloo's own collectives, with the same
results.

A flat buffer of at least `rooted_min_bytes` per rank is gathered by one broadcast per
rank and reduced by one reduce per rank (each into its root's segment), all launched at
once. Measured (benchmarks/RESULTS.md, "Step time at 2 ranks"): a training step at 2
ranks went from 0.90 / 0.97x FSDP2's wall / CPU time with gloo's all_gather_into_tensor
and reduce_scatter_tensor to 0.81 / 0.87x. Below that size the one collective is kept
(one round trip instead of W), and above `ROOTED_MAX_RANKS` ranks the W launches per
collective would grow a bucket's step with the world.

A bucket's gather groups (planning/layout.py: a large param gathered by a collective of
its own, its output the param) are what NCCL runs as one group; gloo runs a coalesced
collective as one collective per group after joining the inputs into a buffer of its
own. So GlooComm, where the groups together pass the threshold, broadcasts each group's
pieces straight into its output (no buffer: the backward's peak at 2 ranks, Llama shape,
51-53 MiB against 61.5 through gloo's coalesced all-gather, benchmarks.allocator_peak),
and reduces the groups' rows joined rank-major (one cat) by one reduce per rank, as one
segment: a Llama-shaped step at 2 ranks 0.94-0.96x FSDP2's against 0.92-1.08 (RESULTS.md,
"Gather groups on gloo").

A bucket's uneven gather groups (Comm.all_gather_groups' `uneven`) are one broadcast per
rank already, as Comm runs them on every backend (gloo refuses an uneven list all_gather),
and its uneven reduce groups one list reduce_scatter (Comm.reduce_scatter_uneven), which
GlooComm runs rooted as well above its threshold (gloo's list reduce_scatter all-reduces
every piece to every rank).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..tensor_views import back_to_back
from .comm import Comm, Works, finish, has_uneven

ROOTED_MIN_BYTES = 1 << 20
ROOTED_MAX_RANKS = 8


def comm_for(group) -> Comm:
    """The Comm flex_shard uses when given none: GlooComm on a gloo group, else Comm."""
    if group is not None and dist.get_backend(group) == dist.Backend.GLOO:
        return GlooComm()
    return Comm()


class GlooComm(Comm):
    """Comm with gloo's rooted gathers and reduces for flat buffers of at least
    `rooted_min_bytes` per rank (see the module docstring); every other
    collective, and every one on another backend, as Comm runs it."""

    def __init__(self, rooted_min_bytes: int = ROOTED_MIN_BYTES) -> None:
        if isinstance(rooted_min_bytes, bool) or not isinstance(rooted_min_bytes, int) \
                or rooted_min_bytes < 0:
            raise ValueError(f"GlooComm: rooted_min_bytes must be an int >= 0 (bytes per "
                             f"rank), got {rooted_min_bytes!r}")
        self.rooted_min_bytes = rooted_min_bytes
        self._gloo: dict = {}  # process group -> whether the rooted path may run on it

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group,
                   async_op: bool = False) -> Optional["Works"]:
        flat = self._rooted(input, group) and _flat(output, input)  # N-D: activation rows
        if not flat:
            return super().all_gather(output, input, group, async_op)
        return broadcast_segments(*flat, group, async_op)

    def all_gather_groups(self, outputs: list, inputs: list, group, async_op: bool = False,
                          uneven: Optional[tuple] = None):
        """A bucket's gather groups rooted (together large enough): each group's
        broadcasts write straight into its output, all launched at once, where
        gloo's coalesced all-gather joins the inputs and gathers into a buffer of
        its own before copying out (module docstring)."""
        segment = back_to_back(inputs)
        if (len(outputs) == 1 or segment is None or has_uneven(uneven)
                or not self._rooted(segment, group)):
            return super().all_gather_groups(outputs, inputs, group, async_op, uneven)
        return finish(Works([broadcast_segments(output, input, group, True)
                             for output, input in zip(outputs, inputs)]), async_op)

    def reduce_scatter_groups(self, outputs: list, inputs: list, group,
                              async_op: bool = False, op: Optional[dist.ReduceOp] = None,
                              uneven: Optional[tuple] = None):
        """A bucket's reduce groups rooted (together large enough): each group's
        rows joined rank-major (one cat), reduced by one reduce per rank, this
        rank's segment copied into the outputs (back to back) once done, where
        gloo's coalesced reduce-scatter runs one per group (module docstring)."""
        segment = back_to_back(outputs)
        if (len(outputs) == 1 or segment is None or has_uneven(uneven)
                or not self._rooted(segment, group)):
            return super().reduce_scatter_groups(outputs, inputs, group, async_op, op, uneven)
        ranks = dist.get_world_size(group)
        joined = torch.cat([i.view(ranks, -1) for i in inputs], dim=1).view(-1)
        return reduce_to_roots(segment, joined, group, async_op,
                               dist.ReduceOp.SUM if op is None else op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group,
                       async_op: bool = False,
                       op: Optional[dist.ReduceOp] = None) -> Optional["Works"]:
        flat = self._rooted(output, group) and _flat(output, input)
        if not flat:
            return super().reduce_scatter(output, input, group, async_op, op)
        return reduce_to_roots(*flat, group, async_op, dist.ReduceOp.SUM if op is None else op)

    def reduce_scatter_uneven(self, output: torch.Tensor, input: torch.Tensor, sizes: tuple,
                              group, async_op: bool = False,
                              op: Optional[dist.ReduceOp] = None) -> Optional["Works"]:
        """Rooted (one reduce per rank into its piece) where the largest piece is large
        enough: gloo's list reduce_scatter all-reduces every piece to every rank (1.1-1.5x
        the reduces' time at 2 ranks from 1 to 16 MiB per rank: gloo_collectives.py)."""
        if not self._rooted(input, group, max(sizes)):
            return super().reduce_scatter_uneven(output, input, sizes, group, async_op,
                                                 **({} if op is None else {"op": op}))
        return reduce_to_roots(output, input, group, async_op,
                               dist.ReduceOp.SUM if op is None else op, sizes)

    def _rooted(self, segment: torch.Tensor, group, numel: Optional[int] = None) -> bool:
        """Whether a collective whose per-rank segment is `segment` (or its first
        `numel` elements) goes rooted: large enough, CPU tensors, a gloo group of at
        most ROOTED_MAX_RANKS, and not in a compiled region (dynamo traces the plain
        collectives)."""
        # read with defaults: a subclass (a test's counting Comm) may skip __init__
        least = getattr(self, "rooted_min_bytes", ROOTED_MIN_BYTES)
        numel = segment.numel() if numel is None else numel
        if (numel * segment.element_size() < least
                or segment.device.type != "cpu" or torch.compiler.is_compiling()):
            return False
        cache = self.__dict__.setdefault("_gloo", {})
        key = group if group is not None else dist.group.WORLD
        if key not in cache:
            cache[key] = (dist.get_backend(group) == dist.Backend.GLOO
                          and dist.get_world_size(group) <= ROOTED_MAX_RANKS)
        return cache[key]


def _flat(*tensors: torch.Tensor) -> Optional[list]:
    """1-D views of `tensors` (the rooted path slices segments by elements: an N-D
    output sliced so cut rows), or None where one is not contiguous."""
    return [t.view(-1) for t in tensors] if all(t.is_contiguous() for t in tensors) else None


def broadcast_segments(output: torch.Tensor, input: torch.Tensor, group,
                       async_op: bool) -> Optional[Works]:
    """Rank k's `input` lands in segment k of `output` on every rank: one
    broadcast per rank."""
    n = input.numel()
    mine = output[dist.get_rank(group) * n:][:n]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input)
    works = [dist.broadcast(output[k * n:(k + 1) * n], group=group, group_src=k, async_op=True)
             for k in range(dist.get_world_size(group))]
    return finish(Works(works), async_op)


def reduce_to_roots(output: torch.Tensor, input: torch.Tensor, group, async_op: bool,
                    op: dist.ReduceOp, sizes: Optional[tuple] = None) -> Optional[Works]:
    """A reduce-scatter as one reduce per rank into its root's segment of `input`
    (scratch: overwritten; `sizes`: each rank's elements of an uneven input, its
    pieces back to back), copied into `output`'s first elements once done."""
    segments = input.view(dist.get_world_size(group), -1) if sizes is None else \
        input.split(sizes)
    works = [dist.reduce(seg, group=group, group_dst=k, op=op, async_op=True)
             for k, seg in enumerate(segments) if seg.numel()]
    mine = segments[dist.get_rank(group)]
    return finish(Works(works, lambda: output[:mine.numel()].copy_(mine)), async_op)
