"""The autograd node of a bucket's unshard: its forward is the bucket's gather,
its backward packs the bucket's unsharded grads and defers the launch of their
reduce-scatter until the node has returned (see grad_reduce.py).

The node receives the bucket as an argument and reaches it through
`UnshardTarget`, the typed interface Bucket implements (bucket.py imports this
file, so the node names what it needs instead of importing Bucket); the gather
and the reduction it calls directly: the bucket's BucketGather and GradReduce.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .gather import BucketGather
from .grad_reduce import GradReduce, GradRoute, ReduceQueue, Reduction


class UnshardTarget(Protocol):
    """What _Unshard needs of a bucket (runtime/bucket.py's Bucket)."""

    params: list  # the sharded params: one frozen since the wrap gets no grad
    grad_route: GradRoute
    reduce_queue: ReduceQueue
    compute_device: torch.device
    gather: BucketGather  # its gather: the forward's outputs
    grads: GradReduce  # its gradient path: pack here, launch and finish through the queue

    def backward_done(self, forward=None) -> None: ...


class _Unshard(torch.autograd.Function):
    """Forward: the bucket's gather. Backward: the bucket's reduce-scatter."""

    @staticmethod
    def forward(ctx, bucket: UnshardTarget, anchor: torch.Tensor, new_tensors: bool,
                refill_in_backward: bool):
        # The route's Delivery of this forward (None under no_grad): a later forward's
        # new route must not receive this graph's grads.
        ctx.bucket, ctx.delivery = bucket, bucket.grad_route.delivery
        ctx.set_materialize_grads(False)
        outs = bucket.gather.gather(None, new_tensors)
        # What this graph's backward needs of the params made once (unsharded.py):
        # held by the graph, so a forward never backpropagated stops counting.
        ctx.forward = bucket.gather.open_forward() if refill_in_backward else None
        # frozen now (requires_grad_(False) after the wrap included): no grad is computed
        frozen = [o for o, p in zip(outs, bucket.params) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # The reduce-scatter runs while the rest of backward does; the queue
        # delivers the sharded grads into .grad (at the latest when backward ends).
        bucket = ctx.bucket
        # Every grad is known: the block's backward is done with its refilled params;
        # dropped before the reduce buffers are made, so the two never coexist.
        bucket.backward_done(ctx.forward)  # and the int reshard's kept slice (postforward.py)
        bucket.reduce_queue.watch_backward()
        bucket.reduce_queue.make_room()
        packed = bucket.grads.pack(grads)
        if packed is not None:
            # Launched once this backward has returned and autograd has let go of the
            # unsharded grads, so they never sit beside the collective's buffers.
            bucket.reduce_queue.defer(Reduction(bucket.grads, packed, ctx.delivery))
        return None, bucket.grad_route.anchor_grad(bucket.compute_device), None, None
