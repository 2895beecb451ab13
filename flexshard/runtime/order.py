"""The order buckets unshard in, recorded once, and a cursor that walks it.

One ExecutionOrder is kept for forward and one for backward (where the
recompute regathers). The first pass records; later passes look up where they
are and name the buckets that come next, which the prefetcher launches early.
"""

from __future__ import annotations

import enum
from typing import Optional


class OrderState(enum.Enum):
    EMPTY = "empty"  # nothing recorded yet
    RECORDING = "recording"  # the first pass is running
    RECORDED = "recorded"  # later passes follow the recorded order


class ExecutionOrder:
    """A recorded sequence of buckets (a bucket may appear several times)."""

    def __init__(self) -> None:
        self.state = OrderState.EMPTY
        self.buckets: tuple = ()
        self._recording: list = []
        self._cursor = 0

    def begin_pass(self) -> None:
        """A pass starts: record it if it is the first, else rewind the cursor."""
        if self.state is OrderState.EMPTY:
            self.state, self._recording = OrderState.RECORDING, []
        self._cursor = 0

    def end_pass(self) -> None:
        """A pass ended: a recording one becomes the order later passes follow."""
        if self.state is OrderState.RECORDING:
            self.buckets, self._recording = tuple(self._recording), []
            self.state = OrderState.RECORDED if self.buckets else OrderState.EMPTY
        self._cursor = 0

    def visit(self, bucket, depth: int) -> list:
        """`bucket` unshards now; returns the up to `depth` buckets expected
        next (none while recording or when `bucket` is not in the order)."""
        if self.state is OrderState.RECORDING:
            self._recording.append(bucket)
            return []
        if self.state is OrderState.EMPTY:
            return []
        index = self._find(bucket)
        if index is None:
            return []
        self._cursor = index + 1
        return list(self.buckets[index + 1:index + 1 + depth])

    def _find(self, bucket) -> Optional[int]:
        """The next position of `bucket` at or after the cursor, else the first."""
        n = len(self.buckets)
        for step in range(n):
            i = (self._cursor + step) % n
            if self.buckets[i] is bucket:
                return i
        return None
