"""Gradient reductions in flight: launched in backward, delivered into .grad later.

A bucket's backward launches its reduce-scatter and returns at once, so the
collective overlaps the backward of the buckets before it. The queue keeps at
most `max_in_flight` reductions launched; the oldest is finished (waited for,
averaged, accumulated into `.grad`) to make room, and whatever is left is
finished by a callback autograd runs when the backward pass ends.
"""

from __future__ import annotations

from collections import deque

import torch


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class ReduceQueue:
    """Launched reduce-scatters of one model, finished in launch order."""

    def __init__(self, max_in_flight: int = 1) -> None:
        self.max_in_flight = max_in_flight
        self._pending: deque = deque()  # (bucket, PendingReduce)
        self._callback_task = None  # graph task id the end-of-backward callback is queued on

    def __len__(self) -> int:
        return len(self._pending)

    def make_room(self) -> None:
        """Finish the oldest reductions until another one may be launched."""
        while len(self._pending) >= max(self.max_in_flight, 1):
            self._finish_oldest()

    def push(self, bucket, pending) -> None:
        """Track a launched reduction; make sure backward's end finishes it."""
        self._pending.append((bucket, pending))
        task = torch._C._current_graph_task_id()
        if self.max_in_flight == 0 or task == -1:
            self.finish_all()
            return
        if task != self._callback_task:
            self._callback_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_all)

    def finish_all(self) -> None:
        """Deliver every launched reduction's sharded grads into .grad."""
        while self._pending:
            self._finish_oldest()
        self._callback_task = None

    def _finish_oldest(self) -> None:
        bucket, pending = self._pending.popleft()
        bucket.accumulate_grads(bucket.finish_reduce(pending))
