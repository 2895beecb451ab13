"""Gradient reductions in flight: launched in backward, delivered into .grad later.

A bucket's backward launches its reduce-scatter and returns at once, so the
collective overlaps the backward of the buckets before it. The queue keeps at
most `max_in_flight` reductions launched; the oldest is finished (waited for,
averaged, accumulated into `.grad`) to make room, and whatever is left is
finished by a callback autograd runs when the backward pass ends. Other parts
of the runtime add their own end-of-backward work to `listeners`, which run
when the outermost watched pass ends (a reentrant checkpoint runs a nested
backward pass inside the outer one).
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
        self.listeners: list = []  # called when a backward pass ends, after the reductions
        self._pending: deque = deque()  # (bucket, PendingReduce)
        self._watched: list = []  # graph tasks with our end-of-backward callback, outermost first

    def __len__(self) -> int:
        return len(self._pending)

    def watch_backward(self) -> None:
        """Inside backward: make sure this pass ends by finishing the queue."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self._watched:
            self._watched.append(task)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._backward_ended(task))

    def abandon_backward(self) -> None:
        """Forward starts outside backward, so no backward pass is running: one
        that raised never ran its callback. Its launched reductions are waited
        for and dropped (the user zeroes the grads of a failed step) and the
        listeners clean up after it."""
        if not (self._watched or self._pending):
            return
        while self._pending:
            _, pending = self._pending.popleft()
            if pending.work is not None:
                pending.work.wait()
        self._watched.clear()
        for listener in self.listeners:
            listener()

    def make_room(self) -> None:
        """Finish the oldest reductions until another one may be launched."""
        while len(self._pending) >= max(self.max_in_flight, 1):
            self._finish_oldest()

    def push(self, bucket, pending) -> None:
        """Track a launched reduction; it is finished by backward's end at the latest."""
        self._pending.append((bucket, pending))
        if self.max_in_flight == 0 or not in_backward():
            self.finish_all()
        else:
            self.watch_backward()

    def finish_all(self) -> None:
        """Deliver every launched reduction's sharded grads into .grad."""
        while self._pending:
            self._finish_oldest()

    def _backward_ended(self, task) -> None:
        if task in self._watched:
            self._watched.remove(task)
        self.finish_all()
        if not self._watched:
            for listener in self.listeners:
                listener()

    def _finish_oldest(self) -> None:
        bucket, pending = self._pending.popleft()
        bucket.accumulate_grads(bucket.finish_reduce(pending))
