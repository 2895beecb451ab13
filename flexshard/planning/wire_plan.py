"""Each parameter's way through a gather layout: its wire format's parts, the
layout regions they occupy and their copy plans, made once per layout. The one
object every gather of a param goes through: the copy-in (encode, also from an
offloaded storage's staged copy), the copy-out (decode, forward, the regather
in backward and an int reshard's gather from its kept slice alike) and the
experimental traced gather."""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from ..placements.contract import WireFormat
from ..placements.wire import Cast
from .copyplan import CopyPlan
from .layout import SlotPlan, typed_view


class WirePlan(NamedTuple):
    """A bucket's wire: a format per slot and the slots its parts make (what
    the gather layout is planned over); slot i's parts are wire slots
    `first[i]` to `first[i + 1]` (exclusive)."""

    formats: tuple
    slots: tuple  # SlotPlan per part
    first: tuple  # len(formats) + 1 indices into `slots`

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
    return WirePlan(tuple(formats), tuple(out), tuple(first))


def cast_wire(slots: Sequence[SlotPlan], dtypes: Sequence[torch.dtype],
              world_size: int) -> WirePlan:
    """Every slot gathered as itself in `dtypes` (the storage and reduce layouts)."""
    return plan_wire(slots, [Cast(d) for d in dtypes], world_size)


class ParamWire:
    """One parameter's parts in one layout, for one rank: where its piece goes
    in the gather input (encode) and how the gathered parts become it (decode).
    Holds what its last encode returned for decode (a subclass's scale): a
    gather from an int reshard's kept slice decodes with its forward's."""

    def __init__(self, layout, wire: WirePlan, slot: int, rank: int) -> None:
        self.format = wire.formats[slot]
        regions = wire.regions(slot)
        self.copies = tuple(CopyPlan(layout, wire.slots[j], j) for j in regions)
        # (offset, dtype, shape) of this rank's piece of each part in its segment
        self._sends = tuple((layout.regions[j].offsets[rank], layout.regions[j].dtype,
                             wire.slots[j].local_shapes[rank]) for j in regions)
        self.cast = isinstance(self.format, Cast)
        self.meta = None

    def encode(self, send: torch.Tensor, piece: torch.Tensor, mesh=None) -> None:
        """Write this rank's sharded `piece` into the gather input `send` (its segment)."""
        self.meta = self.format.encode(piece, [typed_view(send, start, dtype, shape)
                                               for start, dtype, shape in self._sends], mesh)

    def decode(self, gathered: torch.Tensor, view_ok: bool = True) -> tuple:
        """(unsharded param, bytes copied out): a view of `gathered` when the
        format returns its part as is, the part's pieces lie back to back and
        `view_ok`; else a tensor of its own."""
        first = self.copies[0]
        if self.cast:  # the common case, kept to one branch
            if first.span is not None and view_ok:
                return first.full(gathered), 0
            full = first.full(gathered, copy=True)
            return full, full.numel() * full.element_size()
        fulls = [plan.full(gathered) for plan in self.copies]
        out = self.format.decode(fulls, self.meta)
        if type(out) is not torch.Tensor:  # a subclass over the parts: count the parts copied
            return out, sum(f.numel() * f.element_size()
                            for f, plan in zip(fulls, self.copies) if plan.span is None)
        if out.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr():
            return out, 0  # the format handed back a view
        return out, math.prod(out.shape) * out.element_size()

    def traced(self, gathered: torch.Tensor) -> torch.Tensor:
        """decode for a traced region (no views, no counts)."""
        return self.format.decode([plan.traced_full(gathered) for plan in self.copies],
                                  self.meta)


def plan_param_wires(layout, wire: WirePlan, rank: int) -> tuple:
    """A ParamWire per slot of `wire` over `layout` (made at wrap time)."""
    return tuple(ParamWire(layout, wire, i, rank) for i in range(len(wire.formats)))
