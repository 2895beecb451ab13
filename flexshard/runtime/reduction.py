"""Gradient reductions in flight: launched in backward, delivered through autograd later.

A bucket's backward packs its grads and defers the reduce-scatter's launch
until it has returned (autograd holds a node's grad inputs until then): the
next node's pre-hook, `make_room` or `finish_all` launches it. The queue keeps
at most `max_in_flight` reductions launched (the device's call: one on CUDA,
where the collective overlaps the backward of the buckets before it; none on
a host, where the launch finishes it); the oldest is finished (its `finish`
callable waits, averages and hands the sharded grads on, see delivery.py) to
make room. The queue knows launched collectives and callables
only, never buckets. Other parts of the runtime add end-of-backward work to
`listeners`, which run when the outermost watched pass ends (a reentrant
checkpoint runs a nested backward pass inside the outer one).
"""

from __future__ import annotations

from collections import deque
from typing import Callable


from ..compat import current_graph_task_id, queue_callback


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return current_graph_task_id() != -1


class ReduceQueue:
    """Launched reduce-scatters of one model, finished in launch order."""

    def __init__(self, max_in_flight: int = 1) -> None:
        self.max_in_flight = max_in_flight
        self.listeners: list = []  # called when a backward pass ends, after the reductions
        # (work, finish), launched, not yet finished; `finish` holds the reduce
        # output alive until it has been read.
        self._pending: deque = deque()
        self._watched: list = []  # graph tasks with our end-of-backward callback, outermost first
        # Launches packed inside a backward node and run after it returned (when autograd
        # has let go of its grad inputs): at the next launch_deferred(), make_room() or
        # finish_all(), in the order they were deferred.
        self._deferred: deque = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def watch_backward(self) -> None:
        """Inside backward: make sure this pass ends by finishing the queue."""
        task = current_graph_task_id()
        if task != -1 and task not in self._watched:
            self._watched.append(task)
            # Runs when this graph task's engine has run every node, _Deliver included.
            queue_callback(
                lambda: self._backward_ended(task))

    def abandon_backward(self) -> None:
        """Forward starts outside backward, so no backward pass is running: one
        that raised never ran its callback. Its launched reductions are waited
        for and dropped (the user zeroes the grads of a failed step) and the
        listeners clean up after it."""
        if not (self._watched or self._pending or self._deferred):
            return
        self._deferred.clear()  # packed for a failed step: never launched
        while self._pending:
            work, _ = self._pending.popleft()
            if work is not None:
                work.wait()
        self._watched.clear()
        for listener in self.listeners:
            listener()

    def defer(self, launch: Callable[[], None]) -> None:
        """Run `launch()` (which launches a reduction and push()es it) once the
        current backward node has returned: see launch_deferred."""
        self._deferred.append(launch)
        self.watch_backward()

    def launch_deferred(self) -> None:
        """Run the deferred launches, oldest first (a hook on the next node to run
        calls this; so do make_room and finish_all)."""
        while self._deferred:
            self._deferred.popleft()()

    def make_room(self) -> None:
        """Finish the oldest reductions until another one may be launched."""
        self.launch_deferred()
        while len(self._pending) >= max(self.max_in_flight, 1):
            self._finish_oldest()

    def push(self, work, finish: Callable[[], None]) -> None:
        """Track a launched reduction: `work` is its collective (dist.Work, or
        None), `finish()` completes it (waits, hands the grads on). It is
        finished by backward's end at the latest."""
        self._pending.append((work, finish))
        if self.max_in_flight == 0 or not in_backward():
            self.finish_all()
        else:
            self.watch_backward()

    def finish_all(self) -> None:
        """Launch what is deferred, then finish every reduction, in launch order."""
        self.launch_deferred()
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
        _, finish = self._pending.popleft()
        finish()

