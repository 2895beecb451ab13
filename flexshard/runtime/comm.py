"""Collectives on tensors and process groups. Knows nothing of modules or parameters.

A bucket calls its Comm for every collective, so tests and benchmarks can
inject one that counts, delays or fails them (wrapping the real ones).

`Comm` runs torch.distributed's collectives as they are, on any backend. On
gloo flex_shard takes `GlooComm` (gloo.py) instead, a Comm whose large
gathers and reduces run rooted: chosen from the process group's backend
(`comm_for`), so no other code knows which backend runs.

`hidden_from_checkpoint` keeps these collectives out of selective activation
checkpointing's dispatch modes, which replay ops by call index.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist

from ..compat import (SAC_MODES as _SAC_MODES, all_gather_single, coalescing_manager,
                      get_dispatch_stack_at, len_torch_dispatch_stack, pop_mode as _pop_mode,
                      push_mode as _push_mode, reduce_scatter_single)


def _op(op: Optional[dist.ReduceOp]) -> dict:
    """The `op` keyword for a c10d collective: none for SUM, torch's default."""
    return {} if op is None else {"op": op}


def group_parts(buffer: torch.Tensor, spans: tuple, ranks: int = 1) -> list:
    """`buffer` cut into its gather groups' parts (one split; `spans`: the groups'
    (start, stop) byte ranges of a segment, BucketLayout.spans), for `ranks`
    consecutive ranks: a rank's segment (ranks=1: the gather input, the reduce
    output), an int reshard's kept slice, or the gathered buffer (ranks=world
    size). The buffer may be typed: its element size scales the byte offsets."""
    if len(spans) == 1:
        return [buffer]
    size = buffer.element_size()
    return list(buffer.split([(stop - start) * ranks // size for start, stop in spans]))


class Comm:
    """The collectives flexshard issues, each over a whole flat buffer."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group,
                   async_op: bool = False) -> Optional[dist.Work]:
        """Rank-major gather of equal-sized `input`s into `output`."""
        return all_gather_single(output, input, group=group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group,
                       async_op: bool = False,
                       op: Optional[dist.ReduceOp] = None) -> Optional[dist.Work]:
        """Reduce rank-major `input`s by `op` (None: SUM; AVG where `averages`)
        and give rank r segment r in `output`. `input` may be used as scratch."""
        # SUM is torch's default, left unnamed: torch 2.11's dynamo cannot trace a
        # ReduceOp default (the activation collectives trace this call)
        return reduce_scatter_single(output, input, group=group, async_op=async_op,
                                     **_op(op))

    def all_gather_groups(self, outputs: list, inputs: list, group,
                          async_op: bool = False):
        """One rank-major gather per (output, input) pair, launched as one coalesced
        collective (a bucket's gather groups, planning/layout.py); one pair is
        `all_gather` itself. Returns a work to wait on when `async_op`."""
        if len(outputs) == 1:
            return self.all_gather(outputs[0], inputs[0], group, async_op=async_op)
        with coalescing_manager(group, async_ops=async_op) as launched:
            for output, input in zip(outputs, inputs):
                all_gather_single(output, input, group=group)
        return launched if async_op else None

    def reduce_scatter_groups(self, outputs: list, inputs: list, group,
                              async_op: bool = False,
                              op: Optional[dist.ReduceOp] = None):
        """`reduce_scatter` per (output, input) pair, launched as one coalesced
        collective (see all_gather_groups)."""
        if len(outputs) == 1:
            return self.reduce_scatter(outputs[0], inputs[0], group, async_op=async_op,
                                       **_op(op))
        with coalescing_manager(group, async_ops=async_op) as launched:
            for output, input in zip(outputs, inputs):
                reduce_scatter_single(output, input, group=group, **_op(op))
        return launched if async_op else None

    def averages(self, group) -> bool:
        """Whether reduce_scatter takes ReduceOp.AVG on `group` (NCCL does;
        gloo does not, so a bucket pre-divides and sums there). torch's "fake"
        backend takes any op and moves nothing: it stands in for NCCL in the
        fake-world benchmark, so it takes NCCL's path (FSDP2 averages there too)."""
        return group is not None and dist.get_backend(group) in (dist.Backend.NCCL, "fake")

    def all_reduce(self, tensor: torch.Tensor, group, op: Optional[dist.ReduceOp] = None) -> None:
        """In-place all-reduce by `op` (None: SUM): norms, plan fingerprints, and
        under HSDP the reduced gradient shards across the replicate group."""
        dist.all_reduce(tensor, group=group, **_op(op))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list,
                   input_split_sizes: list, group) -> None:
        """Flat all-to-all: rank r sends its `input_split_sizes[j]` elements in
        segment j to rank j and receives `output_split_sizes[j]` from rank j
        (sizes may differ and be 0)."""
        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


@contextmanager
def hidden_from_checkpoint():
    """Run a gather's ops outside selective-checkpoint dispatch modes.

    Under the user's selective activation checkpointing (torchtitan's "op" AC),
    torch replays ops by (op, call index), so the forward and the recompute
    must issue the same ops. A gather may be launched early (prefetch) in one
    and on demand in the other, so it never shows to those modes; other
    dispatch modes (CommDebugMode, user modes) still see it.
    """
    depth = len_torch_dispatch_stack()
    stack = [get_dispatch_stack_at(i) for i in range(depth)]
    if not any(isinstance(m, _SAC_MODES) for m in stack):
        yield
        return
    for _ in stack:
        _pop_mode()
    kept = [m for m in stack if not isinstance(m, _SAC_MODES)]
    for m in kept:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for m in stack:
            _push_mode(m)
