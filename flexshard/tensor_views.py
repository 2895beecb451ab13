"""Views over flat buffers that save a copy: shared by the wire formats' batched
encodes (placements/batch.py) and gloo's rooted collectives (runtime/gloo.py),
which sit on either side of the layers, so it sits below both."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def back_to_back(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensors as one 1-D view when they lie back to back in one storage (one
    dtype, each contiguous, in order): no copy needed to join them. Else None."""
    first, at = tensors[0], tensors[0].data_ptr()
    storage = first.untyped_storage().data_ptr()
    for t in tensors:  # back to back in memory is not enough: one storage must hold them
        if (t.dtype != first.dtype or not t.is_contiguous() or t.data_ptr() != at
                or t.untyped_storage().data_ptr() != storage):
            return None
        at += t.numel() * t.element_size()
    return first.as_strided((sum(t.numel() for t in tensors),), (1,))
