"""Records of a bucket's collectives in flight: a launched gather, a launched
reduce-scatter, and how a reduction averages (runtime/bucket.py makes and
consumes them)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from ..planning.layout import BucketLayout


class PendingGather(NamedTuple):
    """A launched all-gather whose output is not yet consumed."""

    work: Any  # dist.Work, or None when the launch waited (or world size 1)
    gathered: torch.Tensor  # the gather output
    layout: BucketLayout
    version: int  # storage version at launch: a later write makes it stale
    send: torch.Tensor  # the gather input, held until the compute stream waited on `done`
    done: Any  # event on the gather stream after the launch
    stream: Any  # the compute stream current at launch (where the buffers were allocated)
    gathered_version: Optional[int] = None  # into the params made once: the output's
    #                                         version at launch, set back once waited for


class PendingReduce(NamedTuple):
    """A launched reduce-scatter whose sharded grads are not yet delivered."""

    work: Any  # dist.Work, or None at world size 1
    output: torch.Tensor  # the reduce-scatter output (this rank's segment)
    held: tuple  # the reduce input, read by the collective on the reduce stream: kept
    #              until GradReduce.finish's compute stream waited past its last use
    post_divide: Optional[float]  # what the reduced sum is still divided by (see GradReduce.reduce_op)


class ReduceOp(NamedTuple):
    """How a bucket averages its grads: see GradReduce.reduce_op."""

    pre_scale: Optional[float]  # a power of two the reduce input is multiplied by
    post_divide: Optional[float]  # in [1, 2): the reduced output is divided by it
    op: Any  # dist.ReduceOp.SUM or AVG
