"""Gradient reductions in flight: launched in backward, delivered through autograd later.

A bucket's backward launches its reduce-scatter and returns at once, so the
collective overlaps the backward of the buckets before it. The queue keeps at
most `max_in_flight` reductions launched; the oldest is finished (waited for,
averaged, kept on its Delivery) to make room.

Delivery into `.grad` is autograd's own: each forward starts with one
`_Deliver` node per bucket, taking the sharded params as inputs and giving the
empty *anchor* that the bucket's `_Unshard` takes as input. Created first in
forward, these nodes have the lowest sequence numbers, so autograd's engine
runs them after the block computations that are ready with them, i.e. at the
end of backward; their backward returns the reduced sharded grads and
AccumulateGrad puts them into `.grad` (post-accumulate-grad hooks included).
Other parts of the runtime add end-of-backward work to `listeners`, which run
when the outermost watched pass ends (a reentrant checkpoint runs a nested
backward pass inside the outer one).
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from ..compat import current_graph_task_id, queue_callback


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return current_graph_task_id() != -1


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
        task = current_graph_task_id()
        if task != -1 and task not in self._watched:
            self._watched.append(task)
            queue_callback(
                lambda: self._backward_ended(task))

    def abandon_backward(self) -> None:
        """Forward starts outside backward, so no backward pass is running: one
        that raised never ran its callback. Its launched reductions are waited
        for and dropped (the user zeroes the grads of a failed step) and the
        listeners clean up after it."""
        if not (self._watched or self._pending):
            return
        while self._pending:
            _, pending, _ = self._pending.popleft()
            if pending.work is not None:
                pending.work.wait()
        self._watched.clear()
        for listener in self.listeners:
            listener()

    def make_room(self) -> None:
        """Finish the oldest reductions until another one may be launched."""
        while len(self._pending) >= max(self.max_in_flight, 1):
            self._finish_oldest()

    def push(self, bucket, pending, delivery) -> None:
        """Track a launched reduction; it is finished by backward's end at the latest."""
        self._pending.append((bucket, pending, delivery))
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
        bucket, pending, delivery = self._pending.popleft()
        delivery.add(bucket.finish_reduce(pending))


class Delivery:
    """The sharded grads one forward's reductions of one bucket produced, until
    its _Deliver node hands them to autograd."""

    def __init__(self) -> None:
        self.grads: Optional[list] = None

    def add(self, grads: list) -> None:
        if self.grads is None:
            self.grads = list(grads)
            return
        self.grads = [a if b is None else b if a is None else a + b
                      for a, b in zip(self.grads, grads)]

    def take(self) -> list:
        grads, self.grads = self.grads, None
        return grads


class _Deliver(torch.autograd.Function):
    """Forward: sharded params -> an empty anchor. Backward: the reduced sharded grads."""

    @staticmethod
    def forward(ctx, queue: ReduceQueue, delivery: Delivery, *params: torch.Tensor):
        ctx.queue, ctx.delivery, ctx.count = queue, delivery, len(params)
        return params[0].new_empty(0) if params else torch.empty(0)

    @staticmethod
    def backward(ctx, grad):
        ctx.queue.finish_all()
        grads = ctx.delivery.take() or [None] * ctx.count
        return (None, None, *grads)


def deliver_anchor(queue: ReduceQueue, params) -> tuple:
    """(Delivery, anchor): a new route from a bucket's reductions into its params' .grad."""
    delivery = Delivery()
    return delivery, _Deliver.apply(queue, delivery, *params)
