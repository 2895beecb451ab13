"""The order buckets unshard in, re-recorded whenever a pass changes it, and
a cursor that follows it.

One ExecutionOrder is kept for forward and one for backward (where the
recompute regathers). The first pass records; a later pass follows the
recorded order and names the buckets that come next, which the prefetcher
launches early. A pass that unshards a bucket other than the one expected
(a layer skipped on some steps, train/eval branches, a reversed route) has
deviated: it names no more buckets until it ends, and the order it actually
ran becomes the recorded order for the next pass. So a prediction is only
ever made while the pass has matched the recorded order so far.
"""

from __future__ import annotations

import enum


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
