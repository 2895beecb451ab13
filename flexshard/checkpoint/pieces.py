"""Where a rank's piece of a parameter lies in the full tensor, and the value
DCP saves and loads for it.

Any placement works, user-defined ones too: the piece's boxes are found by
sharding an index tensor (first a meta tensor, whose views reveal a box for
free, else real flat indices) and reading back which elements the piece holds.
A box is a dense n-d block of the full tensor; most pieces are one box, an
empty piece is none, a flat range that wraps rows is a few.

The value: a DTensor when the piece is exactly DTensor's Shard(dim) chunk
(then every DTensor tool, full-tensor gathers included, works on it), else a
`ShardedPieces`, a tensor of the full shape that only holds this rank's boxes
and speaks DCP's protocol (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`). Both are views of the local tensor, so DCP loads in
place.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple, Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..compat import dtensor_spec, make_wrapper_subclass, set_dtensor_local
from ..placements.contract import Placement
from ..placements.shard import Shard, chunk_bounds


class Box(NamedTuple):
    """A dense block of the full tensor held by one rank."""

    offsets: tuple  # where the block starts in the full tensor, per dim
    sizes: tuple  # its extent per dim
    start: int  # where its elements start in the rank's flattened piece


def piece_boxes(placement: Placement, shape: Sequence[int], rank: int,
                world_size: int) -> tuple:
    """The boxes of the full tensor that rank `rank`'s piece holds, in the
    piece's (row-major) element order."""
    shape = tuple(shape)
    local = tuple(placement.local_shape(torch.Size(shape), rank, world_size))
    if math.prod(local) == 0:
        return ()
    box = _view_box(placement, shape, rank, world_size)
    boxes = (box,) if box is not None else _index_boxes(placement, shape, rank, world_size)
    found = sum(math.prod(b.sizes) for b in boxes)
    if found != math.prod(local):
        raise ValueError(f"{placement!r}.shard() returned a piece of {found} elements for rank "
                         f"{rank} of a {shape} tensor, but local_shape says "
                         f"{local}; make shard() and local_shape() agree")
    return boxes


def _view_box(placement, shape, rank, world_size) -> Optional[Box]:
    """The piece as one box when shard() returns a strided sub-block view
    (found on the meta device, so nothing is allocated); else None."""
    full = torch.empty(shape, device="meta")
    try:
        piece = placement.shard(full, rank, world_size)
    except (RuntimeError, NotImplementedError):
        return None  # a shard() that needs data: fall back to real indices
    if piece is not full and piece._base is not full:
        return None
    if piece.dim() != full.dim():
        return None
    if any(n > 1 and s != fs for n, s, fs in zip(piece.shape, piece.stride(), full.stride())):
        return None
    offsets = _unravel(piece.storage_offset(), shape)
    if any(o + n > d for o, n, d in zip(offsets, piece.shape, shape)):
        return None
    return Box(offsets, tuple(piece.shape), 0)


def _unravel(flat: int, shape: Sequence[int]) -> tuple:
    out = []
    for d in reversed(shape):
        flat, rem = divmod(flat, d) if d else (flat, 0)
        out.append(rem)
    return tuple(reversed(out))


def _index_boxes(placement, shape, rank, world_size) -> tuple:
    """Boxes from the flat indices the piece holds: runs of consecutive
    indices, each cut into row-major blocks."""
    numel = math.prod(shape)
    dtype = torch.int32 if numel < 2**31 else torch.int64
    index = torch.arange(numel, dtype=dtype).view(shape)
    flat = placement.shard(index, rank, world_size).reshape(-1).to(torch.int64)
    breaks = (torch.nonzero(flat[1:] - flat[:-1] != 1).flatten() + 1).tolist()
    boxes = []
    for lo, hi in zip([0] + breaks, breaks + [flat.numel()]):
        first = int(flat[lo])
        boxes.extend(_range_boxes(first, first + hi - lo, shape, lo))
    return tuple(boxes)


def _range_boxes(a: int, b: int, shape: Sequence[int], start: int) -> list:
    """Row-major blocks covering flat range [a, b) of a `shape` tensor; the
    first element sits at `start` in the piece."""
    if len(shape) == 0:
        return [Box((), (), start)]
    if len(shape) == 1:
        return [Box((a,), (b - a,), start)]
    inner = math.prod(shape[1:])

    def in_row(row, lo, hi, at):
        return [Box((row, *x.offsets), (1, *x.sizes), x.start)
                for x in _range_boxes(lo, hi, shape[1:], at)]

    (r0, rem0), (r1, rem1) = divmod(a, inner), divmod(b, inner)
    if r0 == r1:
        return in_row(r0, rem0, rem1, start)
    boxes = []
    if rem0:
        boxes += in_row(r0, rem0, inner, start)
        start, r0 = start + inner - rem0, r0 + 1
    if r1 > r0:
        boxes.append(Box((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), start))
        start += (r1 - r0) * inner
    if rem1:
        boxes += in_row(r1, 0, rem1, start)
    return boxes


def box_views(local: torch.Tensor, boxes: Sequence[Box]) -> list:
    """Each box's elements as a view of the (contiguous) local piece."""
    if boxes and not local.is_contiguous():
        raise AssertionError("a sharded piece must be contiguous to be viewed as boxes")
    flat = local.reshape(-1)
    return [flat[b.start:b.start + math.prod(b.sizes)].view(b.sizes) for b in boxes]


class ShardedPieces(torch.Tensor):
    """This rank's boxes of a tensor of the full shape, for DCP.

    Holds no full tensor. DCP saves each box as one chunk and, on load, copies
    the chunks that overlap each box straight into it (into the sharded
    parameter or optimizer state it views). Any other tensor op is refused.
    A copy (DCP's stager, DSD's cpu offload) pickles as its pieces and boxes;
    the `LivePieces` that state_dict() returns refuse to be pickled, but
    copy.deepcopy gives a ShardedPieces of a copy of the pieces.
    """

    _local: torch.Tensor
    _boxes: tuple
    _views: list

    @staticmethod
    def __new__(cls, local: torch.Tensor, shape: Sequence[int], boxes: Sequence[Box]):
        out = make_wrapper_subclass(cls, torch.Size(shape), dtype=local.dtype,
                                    device=local.device, requires_grad=False)
        out._local, out._boxes, out._views = local, tuple(boxes), box_views(local, boxes)
        return out

    @property
    def local(self) -> torch.Tensor:
        """The rank's piece (the tensor the boxes view)."""
        return self._local

    @property
    def boxes(self) -> tuple:
        return self._boxes

    def __repr__(self) -> str:  # type: ignore[override]
        boxes = [(b.offsets, b.sizes) for b in self._boxes]
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, boxes={boxes})"

    def __reduce_ex__(self, protocol):
        return ShardedPieces, (self._local, tuple(self.shape), self._boxes)

    def __deepcopy__(self, memo):  # a rollback snapshot of an optimizer's state_dict()
        out = ShardedPieces(self._local.clone(), self.shape, self._boxes)
        memo[id(self)] = out
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func is aten.detach.default:
            return args[0]
        if func is aten._to_copy.default:  # e.g. DSD's cpu offload: copy the pieces
            src = args[0]
            return ShardedPieces(func(src._local, **(kwargs or {})), src.shape, src._boxes)
        if func is aten.new_empty.default:  # DCP's stager: it then sets _local, _boxes, _views
            src, kwargs = args[0], dict(kwargs or {})
            empty = torch.empty(0, dtype=kwargs.get("dtype") or src.dtype,
                                device=kwargs.get("device") or src.device)
            return ShardedPieces(empty, src.shape, ())
        raise NotImplementedError(
            f"{func} on a ShardedPieces (one rank's pieces of a {tuple(args[0].shape)} tensor "
            "for torch.distributed.checkpoint); for full tensors call fs.full_state_dict(model) "
            "on every rank (to export a Hugging Face model, pass it as "
            "save_pretrained(..., state_dict=full) on rank 0: docs/checkpoints.md). A "
            "state_dict hook that reshapes or splits a param (torchtitan's fused QKV "
            "attention splits wqkv) needs that param placed fs.Shard(0), whose values are "
            "DTensors")

    # torch.distributed.checkpoint's protocol.

    def __create_write_items__(self, fqn: str, obj) -> list:
        props = TensorProperties.create_from_tensor(self._local)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(b.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=_chunk(b), properties=props,
                                                      size=self.shape))
                for b in self._boxes]

    def __create_chunk_list__(self) -> list:
        return [_chunk(b) for b in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for box, view in zip(self._boxes, self._views):
            if torch.Size(box.offsets) == index.offset:
                return view
        raise AssertionError(f"{index.fqn!r}: DCP asked for a box at {tuple(index.offset)} that "
                             "this rank does not hold")


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


class LivePieces(ShardedPieces):
    """The ShardedPieces that `module.state_dict()` returns: views of the sharded
    parameters themselves. Pickling one (torch.save) raises: it would write
    one rank's pieces, which no plain model can load. Its copies are
    ShardedPieces."""

    def __reduce_ex__(self, protocol):
        raise not_picklable(self.shape)

    def untyped_storage(self):
        """The sharded parameter's: each state_dict() call's LivePieces of one param
        share it (torchtitan's ModelWrapper checks so before copying into its cache)."""
        return self._local.untyped_storage()


class LiveDTensor(DTensor):
    """A state-dict DTensor viewing a sharded parameter. Pickling it raises, as
    for LivePieces, and so does any op but copies: the state dict is often
    read on one rank only (rank 0 of torch.save or save_pretrained), where an
    op that needs the other ranks' pieces (a reshape of a sharded dim) would
    wait for them forever. DCP, DSD and `full_tensor()` read it through
    DTensor's own methods; a copy is a plain DTensor. Its storage is refused
    too (its wrapper has none; the piece's is not the tensor's), but its
    data_ptr() stays 0: DCP's stager and DSD's cpu offload read that as "no
    storage of its own" and copy it through DTensor's methods."""

    _key: Optional[str] = None  # the state dict's key, for errors

    def __reduce_ex__(self, protocol):
        raise not_picklable(self.shape)

    def untyped_storage(self):
        """Refused: serializers that read a tensor's bytes through its storage
        (safetensors, PEFT's save_pretrained) would find no full tensor here.
        Tensor.storage() reads this too."""
        what = "a value" if self._key is None else repr(self._key)
        raise TypeError(  # not NotImplementedError: safetensors takes that as "meta tensor"
            f"{what} of a flex_shard state dict (a model's or its optimizer's) has no "
            f"storage to read: it is this rank's pieces of a {tuple(self.shape)} tensor, not "
            "the tensor, so a serializer reading its bytes (safetensors, PEFT's "
            "save_pretrained) cannot write it. Call full = fs.full_state_dict(model) on every "
            "rank and save that on rank 0: save_pretrained(path, state_dict=full) "
            "(docs/checkpoints.md; an optimizer's: fs.full_optimizer_state_dict(model, "
            "optimizer)); for a resharding checkpoint, fs.save_checkpoint(directory, model, "
            "optimizer, step)")

    def __deepcopy__(self, memo):  # a plain DTensor of a copy of the piece, as other copies
        out = DTensor(self.to_local().clone(), dtensor_spec(self), requires_grad=False)
        memo[id(self)] = out
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _COPIES:
            return DTensor.__torch_dispatch__(func, types, args, kwargs)
        raise NotImplementedError(
            f"{func} on a value of a flex_shard model's state_dict() (this rank's pieces of a "
            f"{tuple(args[0].shape)} tensor): it could need the other ranks' pieces, which "
            "they never send when one rank reads the state dict. For full tensors call "
            "fs.full_state_dict(model) on every rank (to export a Hugging Face model, pass "
            "it as save_pretrained(..., state_dict=full) on rank 0: docs/checkpoints.md)")


_ATEN = torch.ops.aten
_COPIES = (_ATEN.detach.default, _ATEN.alias.default, _ATEN._to_copy.default,
           _ATEN.new_empty.default, _ATEN.clone.default)  # local: no other rank's piece


def not_picklable(shape) -> TypeError:
    """The error for pickling one rank's pieces of a state dict value."""
    return TypeError(
        f"cannot pickle a value of a flex_shard state dict, the model's or its optimizer's "
        f"(this rank's pieces of a {tuple(shape)} tensor, not the tensor): torch.save of "
        "model.state_dict() or optimizer.state_dict() would write a file no plain model or "
        "optimizer loads. For a file of full tensors, call full = fs.full_state_dict(model) "
        "on every rank and torch.save(full, path) on rank 0 (an optimizer's: "
        "fs.full_optimizer_state_dict(model, optimizer)); for a resharding checkpoint of "
        "both, fs.save_checkpoint(directory, model, optimizer, step) or "
        "torch.distributed.checkpoint.save(...)")


def live_dtensor(local: torch.Tensor, mesh, placements, shape: Sequence[int], stride,
                 key: Optional[str] = None):
    """A LiveDTensor of `local`, the value of state dict key `key`, whose
    wrapper has storage offset 0 (DTensor copies its local's offset, and a
    wrapper with a nonzero one cannot be pickled by torch.save nor staged by
    DCP's async_save)."""
    stand_in = local.new_empty(()).expand(local.shape)  # offset 0, no memory
    spec = DTensor.from_local(stand_in, mesh, placements, run_check=False, shape=shape,
                              stride=stride)
    out = LiveDTensor(stand_in, dtensor_spec(spec), requires_grad=False)
    set_dtensor_local(out, local)
    out._key = key
    return out


def copy_value(value):
    """A CPU copy of a state-dict value that holds only this rank's bytes: a
    ShardedPieces or DTensor of a copy of the local piece (metadata shared,
    not deep-copied), a copy of a plain tensor, anything else as it is."""
    if isinstance(value, ShardedPieces):
        return ShardedPieces(_cpu_copy(value.local), value.shape, value.boxes)
    if isinstance(value, DTensor):
        return DTensor(_cpu_copy(value.to_local()), dtensor_spec(value), requires_grad=False)
    if isinstance(value, torch.Tensor):
        return _cpu_copy(value.detach())
    return value


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", copy=True)


def dtensor_shard(placement: Placement, shape: Sequence[int], world_size: int):
    """DTensor's Shard(dim) when it gives every rank exactly this placement's
    piece (flexshard's Shard follows torch.chunk, as DTensor does), else None."""
    if not isinstance(placement, Shard) or len(shape) == 0:
        return None
    from torch.distributed.tensor import Shard as DShard

    dim = placement.dim % len(shape)
    for rank in range(world_size):
        start, length = chunk_bounds(shape[dim], rank, world_size)
        size, offset = DShard.local_shard_size_and_offset(shape[dim], world_size, rank)
        if size != length or (length and offset != start):
            return None
    return DShard(dim)


def shards_in_rank_order(mesh) -> bool:
    """Whether each rank's position along the mesh's shard dim (DTensor's piece
    index) is its rank in the shard group (flexshard's: the gathers' order, by
    ascending global rank). A mesh listing them otherwise (DeviceMesh("cpu", [1, 0]))
    has no DTensor for its Shard(d) pieces. The same answer on every rank; kept
    per mesh (a state dict asks for every value, and torch remakes `mesh.mesh`
    on each read: a third of an async save's blocked time at 2 ranks)."""
    known = _RANK_ORDER.get(mesh)
    if known is None:
        rows = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()
        known = _RANK_ORDER[mesh] = all(row == sorted(row) for row in rows)
    return known


_RANK_ORDER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
