"""Prefetch: launch the gathers of the buckets expected next, in execution order.

Forward and backward each follow an ExecutionOrder, re-recorded by any pass
that changes it. Each time a bucket unshards, the next `depth` buckets of
that order get their all-gather launched asynchronously, so it flies while
this bucket's module computes. At most `depth` prefetched gathers are alive
at once: one the order no longer expects is dropped before a new one is
launched, and whatever is left unused is dropped when the pass ends.

When a pass deviates from the recorded order, nothing more is launched in
it, and the gathers already in flight are kept until the pass ends: a bucket
that still comes later consumes its own, so no bucket gathers twice for one
use; one that never comes costs one unused gather. Every rank takes the same
decisions as long as every rank runs the same modules in the same order,
which the collectives need anyway.

The prefetcher sees buckets only as keys: the owner passes the two callables
that launch and drop a bucket's gather.
"""

from __future__ import annotations

from typing import Callable

from .order import ExecutionOrder
from ..compat import in_backward


class Prefetcher:
    """Execution orders of one model and the gathers launched ahead of use."""

    def __init__(self, launch: Callable[[object], bool], discard: Callable[[object], None],
                 depth: int = 1) -> None:
        self.depth = depth
        self._launch = launch  # launch(bucket): start its gather; False if nothing was launched
        self._discard = discard  # discard(bucket): drop its unconsumed gather
        self.forward = ExecutionOrder()
        self.backward = ExecutionOrder()
        self._launched: list = []  # buckets whose gather was prefetched, unconsumed
        self._backward_pass = False  # a backward pass is being followed

    def begin_forward(self) -> None:
        """The root module's forward starts (not a recompute inside backward)."""
        if not in_backward():
            if self._backward_pass:  # a backward that raised never ended
                self.end_backward()
            self.forward.begin_pass()

    def end_forward(self) -> None:
        if not in_backward():
            self.forward.end_pass()
            self._drop(self._launched)

    def unsharded(self, bucket) -> None:
        """`bucket` was just unsharded: launch the gathers expected next."""
        if bucket in self._launched:  # its unshard just consumed the prefetched gather
            self._launched.remove(bucket)
        if in_backward():
            self._follow_backward()
        order = self.backward if in_backward() else self.forward
        expected = order.visit(bucket, self.depth)
        if order.deviated:
            return  # launch nothing more this pass; what flies may still be used
        self._drop([b for b in self._launched if b not in expected])
        for b in expected[:self.depth]:
            if b is not bucket and self._launch(b):
                self._launched.append(b)

    def drop_all(self) -> None:
        """Drop every prefetched gather (explicit reshard, device moves)."""
        self._drop(self._launched)

    def _follow_backward(self) -> None:
        if not self._backward_pass:
            self._backward_pass = True
            self.backward.begin_pass()

    def end_backward(self) -> None:
        """The outermost backward pass ended (a ReduceQueue listener)."""
        if self._backward_pass:
            self.backward.end_pass()
        self._drop(self._launched)
        self._backward_pass = False

    def _drop(self, buckets) -> None:
        for b in list(buckets):
            self._discard(b)
            self._launched.remove(b)
