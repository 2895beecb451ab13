"""Collectives on tensors and process groups. Knows nothing of modules or parameters.

A bucket calls its Comm for every collective, so tests and benchmarks can
inject one that counts, delays or fails them.

Collectives a CPU run with gloo takes instead (rooted broadcasts and reduces,
uneven segments) live in gloo.py, behind one switch: `Comm(rooted_on_gloo=False)`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .gloo import ROOTED_MIN_BYTES, Works, broadcast_segments, reduce_to_roots, takes_rooted

class Comm:
    """The collectives flexshard issues, each over a whole flat buffer.

    `rooted_on_gloo=False` keeps gloo on its all-gather and reduce-scatter
    for every size; `rooted_min_bytes` is the smallest per-rank segment that
    goes rooted there (see the module docstring)."""

    def __init__(self, rooted_on_gloo: bool = True,
                 rooted_min_bytes: int = ROOTED_MIN_BYTES) -> None:
        if isinstance(rooted_min_bytes, bool) or not isinstance(rooted_min_bytes, int) \
                or rooted_min_bytes < 0:
            raise ValueError(f"Comm: rooted_min_bytes must be an int >= 0 (bytes per rank), "
                             f"got {rooted_min_bytes!r}")
        self.rooted_on_gloo, self.rooted_min_bytes = bool(rooted_on_gloo), rooted_min_bytes
        self._gloo: dict = {}  # process group -> whether it is gloo's

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group,
                   async_op: bool = False) -> Optional[dist.Work]:
        """Rank-major gather of equal-sized `input`s into `output`."""
        if not self._rooted(input, group):
            return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
        n = input.numel()
        segments = [(k * n, n) for k in range(dist.get_world_size(group))]
        return Comm.all_gather_segments(self, output, input, segments, group, async_op)

    def gathers_uneven(self, group, device: torch.device) -> bool:
        """Whether `all_gather_segments` may gather uneven segments of `device`
        tensors over `group`: where the rooted path may run (gloo's broadcasts
        take any sizes), whatever the size: a compact gather saves the
        padding's memory, which W round trips for a small buffer are worth.
        A Comm that overrides `all_gather` (to count, delay or fail it) keeps
        the equal segments it was written for, unless it overrides
        `all_gather_segments` too (and so sees the compact gathers)."""
        own = type(self)
        if (own.all_gather is not Comm.all_gather
                and own.all_gather_segments is Comm.all_gather_segments) \
                or not dist.is_initialized():
            return False
        return self._rooted_group(device, group)

    def all_gather_segments(self, output: torch.Tensor, input: torch.Tensor,
                            segments: Sequence[tuple], group,
                            async_op: bool = False) -> Optional[Works]:
        """Rank k's `input` lands in `output[start:start + length]` on every rank,
        (start, length) = segments[k] (uneven, 0 allowed): one broadcast per
        non-empty segment. Only where `gathers_uneven` said so."""
        return broadcast_segments(output, input, segments, group, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group,
                       async_op: bool = False,
                       op: dist.ReduceOp = dist.ReduceOp.SUM) -> Optional[dist.Work]:
        """Reduce rank-major `input`s by `op` (SUM, or AVG where `averages`)
        and give rank r segment r in `output`. On the rooted path `input` is
        scratch: its segments are overwritten."""
        if not self._rooted(output, group):
            return dist.reduce_scatter_tensor(output, input, op=op, group=group,
                                              async_op=async_op)
        return reduce_to_roots(output, input, group, async_op, op)

    def averages(self, group) -> bool:
        """Whether reduce_scatter takes ReduceOp.AVG on `group` (NCCL does;
        gloo does not, so a bucket pre-divides and sums there)."""
        return group is not None and dist.get_backend(group) == dist.Backend.NCCL

    def all_reduce(self, tensor: torch.Tensor, group,
                   op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """In-place all-reduce: norms, plan fingerprints, and under HSDP the
        reduced gradient shards across the replicate group."""
        dist.all_reduce(tensor, op=op, group=group)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list,
                   input_split_sizes: list, group) -> None:
        """Flat all-to-all: rank r sends its `input_split_sizes[j]` elements in
        segment j to rank j and receives `output_split_sizes[j]` from rank j
        (sizes may differ and be 0)."""
        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)

    def _rooted(self, segment: torch.Tensor, group) -> bool:
        """Whether a collective whose per-rank segment is `segment` goes rooted."""
        least = getattr(self, "rooted_min_bytes", ROOTED_MIN_BYTES)
        return (segment.numel() * segment.element_size() >= least
                and self._rooted_group(segment.device, group))

    def _rooted_group(self, device: torch.device, group) -> bool:
        """Whether gloo's rooted collectives may run on `group` for `device`'s tensors
        (not in a compiled region: dynamo traces the plain collectives)."""
        if (not getattr(self, "rooted_on_gloo", True) or device.type != "cpu"
                or torch.compiler.is_compiling()):
            return False
        cache = self.__dict__.setdefault("_gloo", {})
        key = group if group is not None else dist.group.WORLD
        if key not in cache:
            cache[key] = takes_rooted(group)
        return cache[key]

