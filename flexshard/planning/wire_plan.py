"""A bucket's wire: the format each parameter is sent in and the parts (wire
slots) those formats make, which the gather layout is planned over. Each
param's way through a layout at step time, its encode and decode, is
runtime/unsharded.py's."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ..placements.contract import WireFormat
from ..placements.wire import Cast
from .layout import SlotPlan


class WirePlan(NamedTuple):
    """A bucket's wire: a format per slot and the slots its parts make (what
    the gather layout is planned over); slot i's parts are wire slots
    `first[i]` to `first[i + 1]` (exclusive)."""

    formats: tuple
    slots: tuple  # SlotPlan per part
    first: tuple  # len(formats) + 1 indices into `slots`
    dtypes: tuple = ()  # each slot's own dtype (its pieces': what a batch encodes from)

    def regions(self, slot: int) -> range:
        return range(self.first[slot], self.first[slot + 1])

    @property
    def plain(self) -> bool:
        """Whether every slot sends itself (one part of its own shape): the
        layout's regions are then the slots'."""
        return len(self.slots) == len(self.formats)


def plan_wire(slots: Sequence[SlotPlan], formats: Sequence[WireFormat],
              world_size: int) -> WirePlan:
    """The wire slots of `slots` sent in `formats`."""
    out, first = [], [0]
    for slot, fmt in zip(slots, formats):
        parts = fmt.parts(slot.shape, slot.placement, world_size)
        for k, part in enumerate(parts):
            shapes = tuple(part.placement.local_shape(part.shape, r, world_size)
                           for r in range(world_size))
            fqn = slot.fqn if k == 0 else f"{slot.fqn}#{k}"
            out.append(SlotPlan(fqn, part.shape, part.dtype, part.placement, shapes))
        first.append(len(out))
    return WirePlan(tuple(formats), tuple(out), tuple(first), tuple(s.dtype for s in slots))


def cast_wire(slots: Sequence[SlotPlan], dtypes: Sequence[torch.dtype],
              world_size: int) -> WirePlan:
    """Every slot gathered as itself in `dtypes` (the storage and reduce layouts)."""
    return plan_wire(slots, [Cast(d) for d in dtypes], world_size)
