"""Reshard-after-forward: the hooked module's forward runs inside a
non-reentrant activation checkpoint whose selective policy recomputes only
the bucket gathers (and free view ops). Every other op's output is saved, so
backward re-runs the gather and nothing else of the block.

The gather's collective itself is launched outside the checkpoint's dispatch
modes (bucket._hidden_from_checkpoint), so a gather prefetched in one pass and
issued on demand in the other replays the same ops; the policy sees only the
views (and copy-outs) that turn the gather output into unsharded params.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional, Sequence

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..compat import checkpoint_without_reentrant_generator, top_saved_tensors_default_hooks


def saved_tensors_hooked() -> bool:
    """True inside a region whose saved tensors some hooks already handle
    (an activation checkpoint, CPU offload): a nested region is not needed."""
    return top_saved_tensors_default_hooks(False) is not None


class RecomputeRegion:
    """The checkpointed forward of one module whose buckets reshard after forward."""

    def __init__(self, buckets: Sequence) -> None:
        self.buckets = buckets  # every bucket of the model: a nested runner's gather recomputes too
        self.recomputing = False
        self._gen = None

    def policy(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        """Recompute what any bucket's gather ran, and views; save the rest."""
        if any(b.gathering for b in self.buckets) or func.is_view:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    def _contexts(self):
        # A saved output may be mutated in place later in the block (CPU rms_norm adds eps
        # to its cached mean in place); in recompute the mutating op is cached as well, so
        # it is never replayed and the mutated value is the right one.
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(
            self.policy, allow_cache_entry_mutation=True)
        return forward_ctx, self._recomputing(recompute_ctx)

    @contextmanager
    def _recomputing(self, recompute_ctx):
        with recompute_ctx:
            self.recomputing = True
            try:
                yield
            finally:
                self.recomputing = False

    def enter(self, module, args, kwargs) -> None:
        """Start the checkpoint (in the pre-forward hook); a no-op while recomputing."""
        if self.recomputing:
            return
        self._gen = checkpoint_without_reentrant_generator(
            module, True, self._contexts, "default", False, True, *args, **kwargs)
        next(self._gen)

    def exit(self) -> None:
        """Close the checkpoint after a forward that returned (post-forward hook)."""
        gen: Optional[object] = self._gen
        self._gen = None
        if gen is None:
            return
        try:
            next(gen)
        except StopIteration:
            return
        raise AssertionError("checkpoint generator did not finish")

    def abort(self) -> None:
        """Close the checkpoint after a forward that raised: its dispatch mode and
        saved-tensor hooks are popped. A no-op when exit() already closed it."""
        gen: Optional[object] = self._gen
        self._gen = None
        if gen is not None:
            gen.close()
