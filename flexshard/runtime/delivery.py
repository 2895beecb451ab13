"""Gradient delivery: how a bucket's reduced sharded grads reach `.grad` through
autograd itself (AccumulateGrad, post-accumulate-grad hooks, torch.autograd.grad).

At the start of each forward under grad (the root pre-forward hook) every
bucket renews its GradRoute: one `_Deliver` node taking the sharded params as
inputs and giving an empty *anchor*, which each `_Unshard` of the bucket in
that forward takes as an input. In backward, `_Unshard` launches the bucket's
reduce-scatter and hands it to the model's ReduceQueue with a callable that
adds the finished sharded grads to the route's `Delivery`; the anchor's grad
(an empty tensor) then reaches `_Deliver`, whose backward finishes the queue
and returns the summed sharded grads, which AccumulateGrad puts into `.grad`.

Why `_Deliver` runs at the end of backward: autograd's engine runs ready nodes
in decreasing sequence number (creation order), and the `_Deliver` nodes are
made first in forward, so they have the lowest numbers: they run once nothing
made later is ready, i.e. after the block computations, and every reduction of
the bucket in that forward was launched before them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .reduction import ReduceQueue


class Delivery:
    """The sharded grads one forward's reductions of one bucket produced, until
    its _Deliver node hands them to autograd."""

    def __init__(self) -> None:
        self.grads: Optional[list] = None
        # CPU offload: host waits to run before the host reads the grads (a
        # device may still be copying them into host memory).
        self._host_waits: list = []

    def add(self, grads: list, host_wait: Optional[Callable[[], None]] = None) -> None:
        if host_wait is not None:
            self._host_waits.append(host_wait)
        if self.grads is None:
            self.grads = list(grads)
            return
        self._wait_host()  # the sum reads both forwards' grads on the host
        self.grads = [a if b is None else b if a is None else a + b
                      for a, b in zip(self.grads, grads)]

    def take(self) -> list:
        self._wait_host()
        grads, self.grads = self.grads, None
        return grads

    def _wait_host(self) -> None:
        waits, self._host_waits = self._host_waits, []
        for wait in waits:
            wait()

    def expect(self, queue: ReduceQueue, work, finish: Callable[[], list],
               host_wait: Optional[Callable[[], None]] = None) -> None:
        """A reduction was launched (`work`, its collective); `finish()` waits
        for it and returns the sharded grads, which the queue adds here.
        `host_wait()` (CPU offload) returns once the host may read them."""
        queue.push(work, lambda: self.add(finish(), host_wait))


class _Deliver(torch.autograd.Function):
    """Forward: sharded params -> an empty anchor. Backward: the reduced sharded grads."""

    @staticmethod
    def forward(ctx, queue: ReduceQueue, delivery: Delivery, device, *params: torch.Tensor):
        # ctx keeps the Delivery alive for as long as the graph of this forward lives.
        ctx.queue, ctx.delivery, ctx.count = queue, delivery, len(params)
        # The anchor lives on the compute device (not the params', which are in
        # host memory under CPU offload), so autograd runs this node's backward
        # on the same device thread as the _Unshard nodes and the ReduceQueue.
        return torch.empty(0, device=device)

    @staticmethod
    def backward(ctx, grad):
        # Runs last in backward (lowest sequence number, see the module docstring),
        # so finishing the queue here waits only for reductions already overlapped.
        ctx.queue.finish_all()
        grads = ctx.delivery.take() or [None] * ctx.count
        return (None, None, None, *grads)


class GradRoute:
    """One bucket's route from its reductions into its sharded params' .grad:
    the Delivery and the anchor of the current forward (None outside one)."""

    def __init__(self) -> None:
        self.delivery: Optional[Delivery] = None
        self.anchor: Optional[torch.Tensor] = None

    def renew(self, queue: ReduceQueue, params: Sequence[torch.Tensor], trainable: bool,
              device: torch.device) -> None:
        """Start a new route (at the start of each forward; none under no_grad
        or for a bucket without trainable params); the anchor is on `device`,
        the compute device."""
        self.delivery = self.anchor = None
        if trainable and torch.is_grad_enabled():
            self.delivery = Delivery()
            self.anchor = _Deliver.apply(queue, self.delivery, device, *params)

    def clear(self) -> None:
        """Forget the route (the params it takes were replaced, e.g. a device move)."""
        self.delivery = self.anchor = None

    def anchor_for_unshard(self, queue: ReduceQueue, params: Sequence[torch.Tensor],
                           trainable: bool, device: torch.device) -> torch.Tensor:
        """The input tying an unshard's outputs to the route (renewed when there
        is none, e.g. a module run on its own, or it lives on another device);
        an empty stand-in when no grads will flow. `self.delivery` is its Delivery."""
        if self.anchor is None or self.anchor.device != device:
            self.renew(queue, params, trainable, device)
        if self.anchor is None:
            return torch.empty(0, device=device)
        return self.anchor


def anchor_grad(device: torch.device) -> torch.Tensor:
    """The anchor's grad from _Unshard.backward: a defined (empty) grad, so the
    anchor's _Deliver node runs."""
    return torch.empty(0, device=device)
