"""`module.unshard()` and `module.reshard()`: every bucket gathered and held
unsharded between steps (new tensors, apart from the params the step makes once),
and put back, refusing writes to what was held (held.py)."""

from __future__ import annotations

from typing import Sequence

import torch

from .bucket import Bucket, BucketState
from .hooks import outside_inference_mode


class UnshardHandle:
    """What module.unshard(async_op=True) returns: wait() finishes the gathers
    and installs the unsharded params, which stay until module.reshard()."""

    def __init__(self, buckets: Sequence[Bucket]) -> None:
        self._buckets = list(buckets)  # gathers launched, not yet held
        for bucket in self._buckets:
            bucket.hold_handle = self

    def wait(self) -> None:
        """Block until every bucket is unsharded and installed (idempotent)."""
        buckets, self._buckets = self._buckets, []
        for bucket in buckets:
            bucket.hold_handle = None
            with torch.enable_grad():  # so forwards run under grad reach the reduction
                outs = bucket.unshard(new_tensors=True)  # kept apart from the params made once
            bucket.hold(outs)


@outside_inference_mode
def unshard_explicitly(buckets: Sequence[Bucket], async_op: bool):
    """Launch the gathers of `buckets` (module.unshard()); see UnshardHandle."""
    buckets = [b for b in buckets if b.held is None and b.hold_handle is None]
    for bucket in buckets:
        bucket.check_viewed()
        if bucket.state is not BucketState.SHARDED:
            raise RuntimeError(f"module.unshard() called while bucket {bucket.name!r} is "
                               f"{bucket.state.value} (inside its forward?); call it between steps")
    for bucket in buckets:
        bucket.start_gather(new_tensors=True)
    handle = UnshardHandle(buckets)
    if async_op:
        return handle
    handle.wait()
    return None


def reshard_explicitly(buckets: Sequence[Bucket]) -> None:
    """Undo unshard_explicitly: sharded params back on the modules (all of them),
    then refuse in-place writes to the held params, which that dropped (held.py)."""
    for bucket in buckets:
        if bucket.hold_handle is not None:
            bucket.hold_handle.wait()
    written = [(bucket.name, fqn) for bucket in buckets if bucket.held is not None
               for fqn in bucket.release()]
    if written:
        bucket_name, fqn = written[0]
        more = f" (and {len(written) - 1} more: {[f for _, f in written[1:4]]})" if written[1:] else ""
        raise RuntimeError(
            f"module.reshard(): parameter {fqn!r} (bucket {bucket_name!r}){more} was written in "
            "place while module.unshard() held it unsharded, and that write was dropped: the "
            "sharded params are the parameters, the unsharded ones only gathered copies (a PEFT "
            "merge_adapter() there leaves the base weights unmerged). Change weights through the "
            "shards: after reshard(), load the changed full weights with "
            "fs.load_full_state_dict(model, sd) (sd from fs.full_state_dict(model)), or write "
            "model.parameters() in place; to merge an adapter, merge on an unwrapped model "
            "loaded from fs.full_state_dict(model)")
