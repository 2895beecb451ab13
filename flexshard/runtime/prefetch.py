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

The prefetcher asks a bucket for two things only: `prefetch()` launches its
gather if it takes one, `gather.discard()` drops it unused.

The order buckets unshard in (`ExecutionOrder`) is re-recorded whenever a pass
changes it, and a cursor follows it. One ExecutionOrder is kept for forward and
one for backward (where the recompute regathers). The first pass records; a
later pass follows the recorded order and names the buckets that come next,
which the prefetcher launches early. A pass that unshards a bucket other than
the one expected (a layer skipped on some steps, train/eval branches, a reversed
route) has deviated: it names no more buckets until it ends, and the order it
actually ran becomes the recorded order for the next pass. So a prediction is
only ever made while the pass has matched the recorded order so far.
"""

from __future__ import annotations

import enum

from ..compat import in_backward


class OrderState(enum.Enum):
    EMPTY = "empty"  # between passes, nothing recorded yet
    RECORDED = "recorded"  # between passes, an order is recorded
    RECORDING = "recording"  # a pass runs with nothing to follow: it is recorded
    FOLLOWING = "following"  # a pass runs and has matched the recorded order so far
    DEVIATED = "deviated"  # a pass left the recorded order: no predictions until it ends


class ExecutionOrder:
    """A recorded sequence of buckets (a bucket may appear several times)."""

    def __init__(self) -> None:
        self.state = OrderState.EMPTY
        self.buckets: tuple = ()
        self.changes = 0  # passes whose order differed from the recorded one
        self._ran: list = []  # the buckets the running pass unsharded, in order

    def begin_pass(self) -> None:
        """A pass starts: follow the recorded order, or record one."""
        self.state = OrderState.FOLLOWING if self.buckets else OrderState.RECORDING
        self._ran = []

    def end_pass(self) -> None:
        """A pass ended: the order it ran is what the next pass follows (the
        same as before, unless it deviated or stopped short)."""
        if self.state in (OrderState.EMPTY, OrderState.RECORDED):
            return  # no pass was running
        ran, self._ran = tuple(self._ran), []
        if ran and ran != self.buckets:  # a pass that unsharded nothing keeps the order
            self.changes += bool(self.buckets)
            self.buckets = ran
        self.state = OrderState.RECORDED if self.buckets else OrderState.EMPTY

    @property
    def deviated(self) -> bool:
        return self.state is OrderState.DEVIATED

    def visit(self, bucket, depth: int) -> list:
        """`bucket` unshards now; returns the up to `depth` buckets expected
        next: none outside a pass, while recording, or once the pass deviated."""
        if self.state in (OrderState.EMPTY, OrderState.RECORDED):
            return []  # a module run outside the root's forward: no pass to follow
        position = len(self._ran)
        self._ran.append(bucket)
        if self.state is not OrderState.FOLLOWING:
            return []
        if position >= len(self.buckets) or self.buckets[position] is not bucket:
            self.state = OrderState.DEVIATED
            return []
        return list(self.buckets[position + 1:position + 1 + depth])


class Prefetcher:
    """Execution orders of one model and the gathers launched ahead of use."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
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
            if b is not bucket and b.prefetch():
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
            b.gather.discard()
            self._launched.remove(b)
