"""Flat byte buffers of a bucket and the typed views into them."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..planning.layout import BucketLayout, typed_view
from ..wrap.identity import replace_keeping


def segment_views(buffer: torch.Tensor, layout: BucketLayout, slots, rank: int) -> list:
    """Views of one rank's pieces in `buffer` (a segment, or its first
    `layout.used_bytes(rank)` bytes: an empty piece past them views nothing)."""
    return [typed_view(buffer, reg.offsets[rank], reg.dtype, slot.local_shapes[rank])
            for slot, reg in zip(slots, layout.regions)]


class BucketStorage:
    """The flat uint8 buffer holding one rank's sharded parameters of a bucket:
    `layout.storage_bytes(rank)` bytes. A rank whose pieces fall well short of
    the segment (the light rank of an Owned bucket) holds only its pieces and
    their alignment gaps; its gather input is padded instead (see
    `BucketGather._buffers`)."""

    def __init__(self, layout: BucketLayout, slots, rank: int, device) -> None:
        self.layout = layout
        self.rank = rank
        self.slots = slots
        self.buffer = torch.zeros(layout.storage_bytes(rank), dtype=torch.uint8, device=device)
        self.views = segment_views(self.buffer, layout, slots, rank)
        self.flat = [v.view(-1) for v in self.views]  # the copy-in's sources
        self.ptrs = [v.data_ptr() for v in self.views]  # where each sharded param must point

    def replace_buffer(self, buffer: torch.Tensor) -> None:
        """Hold `buffer` (same size, e.g. on another device) and view it afresh."""
        if buffer.dtype != torch.uint8 or buffer.shape != self.buffer.shape:
            raise AssertionError(f"a storage buffer must stay uint8 of shape "
                                 f"{tuple(self.buffer.shape)}, got {buffer.dtype} {tuple(buffer.shape)}")
        self.buffer = buffer
        self.views = segment_views(buffer, self.layout, self.slots, self.rank)
        self.flat = [v.view(-1) for v in self.views]
        self.ptrs = [v.data_ptr() for v in self.views]

    @property
    def short(self) -> bool:
        """Whether the buffer is shorter than the layout's segment, so it cannot be
        the gather input itself (a copy-in pads it into the gather output)."""
        return self.buffer.numel() < self.layout.segment_bytes


def moved_param(old: nn.Parameter, view: torch.Tensor, fn) -> nn.Parameter:
    """The sharded param over `view`, carrying `old`'s grad (moved by `fn`) and
    hooks: `old` itself where it can be kept (identity.py; an optimizer built
    before the move keeps working), else a new object. Never `old.data = view`,
    which would stop the param from sharing the storage buffer's version counter."""
    grad = None if old.grad is None else fn(old.grad)
    param = replace_keeping(old, nn.Parameter(view, requires_grad=old.requires_grad))
    param.grad = grad
    return param
