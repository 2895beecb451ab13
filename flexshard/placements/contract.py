"""The placement contract: everything a bucket needs to know about one parameter.

A placement says which piece of a parameter each rank of a 1-D mesh holds,
how to cut a full tensor into those pieces and how to join them again.
Buckets do the rest (byte layout, the one collective, gradient reduction), so
a new placement is a frozen dataclass implementing the six methods below.

A wire format says what a parameter's piece sends in its bucket's all-gather
and how the gathered bytes become the unsharded parameter: one or more *parts*
(each a tensor with its own dtype, split over the ranks by its own bound
placement), an encode of the piece into its parts and a decode of the gathered
parts. A cast (`placements/wire.py`, `Cast`) is the default; quantized gathers
are other formats, not other code paths (FSDP2's `fsdp_pre_all_gather` /
`fsdp_post_all_gather`, over any placement and several dtypes in one buffer).

Pieces are always taken in rank order. A rank may hold an empty piece. The
pieces partition the tensor: each element lies in exactly one rank's piece
(planning/placement_check.py checks a user's placement at wrap time).
"""

from __future__ import annotations

import abc
from typing import Any, Hashable, NamedTuple, Optional, Sequence

import torch


class Placement(abc.ABC):
    """How one parameter is split across the ranks of a 1-D mesh (a frozen value)."""

    @abc.abstractmethod
    def check(self, shape: torch.Size, world_size: int) -> None:
        """Raise ValueError (saying what is wrong and how to fix it) if this
        placement cannot split a tensor of `shape` over `world_size` ranks."""

    @abc.abstractmethod
    def bind(self, shape: torch.Size, itemsize: int, world_size: int,
             rank_bytes: Sequence[int]) -> "Placement":
        """Return this placement with every free choice made.

        `rank_bytes[r]` is how many bytes rank r already holds (the params
        bound before this one: of this bucket and of the buckets planned
        before it), so a placement may balance (Owned picks its owner here). The result
        must be deterministic: every rank calls bind with the same arguments.
        """

    @abc.abstractmethod
    def local_shape(self, shape: torch.Size, rank: int, world_size: int) -> torch.Size:
        """Shape of the piece rank `rank` holds (numel 0 for an empty piece)."""

    @abc.abstractmethod
    def shard(self, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
        """Rank `rank`'s piece of `full`, as a view of it where possible."""

    @abc.abstractmethod
    def unshard(self, pieces: Sequence[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        """Join the rank-ordered `pieces` into a new tensor of `shape`."""

    @abc.abstractmethod
    def rank_major(self, shape: torch.Size) -> bool:
        """True when the pieces, flattened and concatenated in rank order, are
        the full tensor flattened. The bucket may then lay the pieces out so
        that the gathered bytes are the parameter itself (no copy-out)."""


class WirePart(NamedTuple):
    """One tensor a parameter puts on the wire: its full shape and dtype, and
    the bound placement that cuts it into the ranks' pieces."""

    shape: torch.Size
    dtype: torch.dtype
    placement: Placement


class WireFormat(abc.ABC):
    """What one parameter sends in its bucket's all-gather and how it comes
    back (a frozen value; every rank builds the same one)."""

    needs_mesh = False  # encode's `mesh`: the shard group's 1-D DeviceMesh, else None
    # decode_batch(..., out=) writes a batch's params into a buffer made once by
    # batch_out: the bucket refills them in place each gather (runtime/unsharded.py)
    decodes_into = False

    @abc.abstractmethod
    def parts(self, shape: torch.Size, placement: Placement, world_size: int) -> tuple:
        """The WireParts of a parameter of `shape` split by bound `placement`
        over `world_size` ranks, in the order encode writes and decode reads them."""

    @abc.abstractmethod
    def encode(self, piece: torch.Tensor, outs: Sequence[torch.Tensor], mesh) -> Any:
        """Write this rank's `piece` (the sharded param) into `outs`: this
        rank's piece of each part, typed and shaped, in the gather input.
        Returns what decode needs besides the parts (None if nothing)."""

    @abc.abstractmethod
    def decode(self, fulls: Sequence[torch.Tensor], meta: Any) -> torch.Tensor:
        """The unsharded parameter from every part's full tensor and the
        `meta` this rank's encode returned. May return `fulls[0]` itself
        (then it stays a view of the gathered buffer)."""

    def refill(self, fulls: Sequence[torch.Tensor], meta: Any, out: torch.Tensor) -> None:
        """Make `out`, the param an earlier decode returned (kept by the bucket and
        refilled each gather), the one decode returns for `fulls` and `meta`. By
        default decode again and copy into `out` (nothing when decode handed back a
        view of `out`'s storage); a format whose decode returns a tensor subclass
        renews it in place instead (subclass.py: fsdp_post_all_gather(out=)). `fulls`
        are the same tensors at every refill, those the first decode got, with this
        gather's bytes in them (runtime/unsharded.py)."""
        new = self.decode(fulls, meta)
        if new.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            out.copy_(new)

    # Batches (optional): on a GPU each op is a kernel launch, so a bucket of N
    # params of one format encoded one by one launches N times the kernels of one
    # encode over them all. Params of a bucket whose formats return equal keys
    # (and whose pieces share a dtype) are encoded by the first one's
    # encode_batch and decoded by its decode_batch; the bucket writes the flat
    # parts into the gather input in a constant number of ops.

    def batch_key(self) -> Optional[Hashable]:
        """The key params encoded together share; None (the default): encode alone."""
        return None

    def encode_batch(self, formats: Sequence["WireFormat"], pieces: Sequence[torch.Tensor],
                     mesh, cache: dict) -> tuple:
        """(flats, metas) for the non-empty `pieces` of params sent in `formats`
        (this one among them): flats[k] is every piece's part k flattened and
        joined in order (part k's dtype), metas what each decode needs. `cache`
        lives as long as the batch (for index tensors made on first use).
        A param whose piece is empty on this rank is left out (its meta is None)."""
        raise AssertionError(f"{type(self).__name__} has a batch_key but no encode_batch "
                             "(refused at wrap time: runtime/unsharded.py, plan_param_wires)")

    def encode_batch_into(self, formats: Sequence["WireFormat"], pieces: Sequence[torch.Tensor],
                          outs: Sequence[Sequence[torch.Tensor]], mesh, cache: dict) -> Optional[list]:
        """encode_batch writing each piece's parts straight into `outs` (its parts'
        views in the gather input): the metas, or None (the default) where this
        format cannot here, and encode_batch runs instead."""
        return None

    def decode_batch(self, formats: Sequence["WireFormat"], fulls: Sequence[Sequence[torch.Tensor]],
                     metas: Sequence[Any], cache: dict, out: Optional[torch.Tensor] = None) -> list:
        """The unsharded parameters of a batch (decode of each, by default); with
        `out` (formats that decode_into): written into it, as batch_out's views."""
        return [f.decode(parts, meta) for f, parts, meta in zip(formats, fulls, metas)]

    def batch_out(self, formats: Sequence["WireFormat"], shapes: Sequence[torch.Size],
                  device: torch.device) -> tuple:
        """(flat buffer, each param's view of it) for decode_batch's `out`."""
        raise NotImplementedError(f"{type(self).__name__} does not decode into a buffer")
