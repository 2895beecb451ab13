"""The grads of a traced bucket's params into its reduce groups' stand-ins
(runtime/traced.py): each group's members' grad pieces joined at their places in
one write, Shard(d > 0) blocks put in by index, instead of a zero-filled copy of
the group per piece."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


def cast_as(t: torch.Tensor, dtype: torch.dtype, shape=None) -> torch.Tensor:
    """`t` in `dtype` (and `shape`), with no op where it is so already (the checks
    run while tracing: no node for a cast or reshape that changes nothing)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    if shape is not None and not (t.dim() == len(shape) == 1 if shape == (-1,)
                                  else t.shape == shape):
        t = t.reshape(shape)
    return t


class Indexed(NamedTuple):
    """An index plan's grad in its reduce group: block `positions[j]` of `block`
    elements holds the flat grad's block j."""

    block: int
    positions: torch.Tensor


class Spans(torch.autograd.Function):
    """Forward: each member's decoded value as it is (a view; a member whose value
    is None, a subclass's, gets an unfilled tensor of its shape, which
    traced.py's `_ValueFrom` joins to it); backward: their grads, in the stand-in's dtype,
    joined into the stand-in's layout (each member's pieces at their places, zeros
    in the gaps) in one write, and one index_put per block size of the index
    members, where slicing each member out would write a whole zero-padded group
    per piece (or per index member). One Function per reduce group, not one per
    param. `group`: the reduce group's `SpanGroup`; `tensors`: the members'
    values, then the group's positions (as tensors of the graph: a constant
    tensor traced in a backward fails)."""

    @staticmethod
    def forward(ctx, stand_in, group, *tensors):
        values = tensors[:len(group.members)]
        ctx.group, ctx.numel, ctx.dtype = group, stand_in.numel(), stand_in.dtype
        ctx.save_for_backward(*tensors[len(group.members):])
        return tuple(stand_in.new_empty(shape) if value is None else value.view_as(value)
                     for value, (_, shape) in zip(values, group.members))

    @staticmethod
    def backward(ctx, *grads):
        members = ctx.group.members
        flats = [cast_as(g, ctx.dtype, (-1,)) for g in grads]
        spans = [(k, pieces) for k, (pieces, _) in enumerate(members) if isinstance(pieces, tuple)]
        joined = joined_grads(spans, flats, ctx.numel)
        for block, where in zip(ctx.group.blocks, ctx.saved_tensors):
            values = [flats[k].view(-1, block) for k, (pieces, _) in enumerate(members)
                      if pieces == block]
            joined = joined.view(-1, block).index_put(
                (where,), torch.cat(values) if len(values) > 1 else values[0]).view(-1)
        return (joined, None) + (None,) * (len(members) + len(ctx.saved_tensors))


class SpanGroup(NamedTuple):
    """A reduce group's members as `Spans` takes them, made when the bucket is
    prepared: each member's trainable index; (pieces, shape) each, a piece (start
    in the stand-in, start in the member's flat grad, numel), or (block, shape)
    for an index member; the index members' block sizes, and per block size the
    positions of its members' blocks in the stand-in, in member order."""

    trainable: tuple
    members: tuple
    blocks: tuple
    positions: tuple


def span_group(members: Sequence[tuple], shapes: Sequence) -> SpanGroup:
    """`members`' (trainable index, pieces or Indexed) as Spans takes them."""
    blocks = tuple(dict.fromkeys(p.block for _, p in members if isinstance(p, Indexed)))
    positions = tuple(torch.cat([p.positions for _, p in members
                                 if isinstance(p, Indexed) and p.block == block])
                      for block in blocks)
    return SpanGroup(tuple(k for k, _ in members),
                      tuple((p.block if isinstance(p, Indexed) else p, shapes[k])
                            for k, p in members), blocks, positions)


def joined_grads(spans: Sequence[tuple], flats: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """A flat tensor of `numel` of the span members' grad pieces at their places
    (`spans`: (member, pieces) each), zeros elsewhere, in one write."""
    pieces = sorted((start, flat, n, k) for k, pieces in spans for start, flat, n in pieces)
    parts, pos = [], 0
    for start, flat, n, k in pieces:
        if start > pos:
            parts.append(flats[0].new_zeros(start - pos))
        parts.append(flats[k][flat:flat + n])
        pos = start + n
    if pos < numel:
        parts.append(flats[0].new_zeros(numel - pos))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
