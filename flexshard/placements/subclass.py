"""Tensor subclasses that bring their own all-gather, as a wire format: FSDP2's
extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather`) inside flexshard's one
collective per bucket. torchao's float8 weights
(`WeightWithDynamicFloat8CastTensor`, `Float8LinearConfig(
enable_fsdp_float8_all_gather=True)`) are the user today: each rank casts its
piece to fp8 with the scale of the whole weight (its pre-all-gather all-reduces
the amax over the shard group), the fp8 bytes travel, and the post-all-gather
wraps the gathered fp8 weight for the float8 matmul. torchao's weights of a
bucket are cast together, their amaxes in one all-reduce (placements/float8.py).

At wrap flexshard keeps the param's bytes in its storage as a plain tensor (the
sharded param, what the optimizer and checkpoints see: high precision) and
remembers the subclass (`subclass_gather`); each gather rebuilds the subclass
around this rank's piece from the param's flatten context and asks it for its
gather input. The subclass must hand back one tensor of its piece's shape (the
wire dtype read from its context at wrap), and every rank must hold a non-empty
piece (its pre-all-gather reduces over the group): see `check_pieces`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

from . import float8
from .batch import fused_kernels
from .contract import Placement, WireFormat, WirePart


@dataclass(frozen=True)
class SubclassGather(WireFormat):
    """Gather through `cls`'s fsdp_pre_all_gather / fsdp_post_all_gather."""

    cls: type
    inner: str  # the flatten name of the high-precision tensor the subclass wraps
    ctx: Any  # the subclass's flatten context (its config)
    wire_dtype: torch.dtype
    out_dtype: torch.dtype  # the gather dtype (param_dtype), given to fsdp_post_all_gather
    batched: bool = False  # torchao's dynamic float8 weight: cast a bucket at a time (float8.py)

    needs_mesh = True

    def parts(self, shape: torch.Size, placement: Placement, world_size: int) -> tuple:
        return (WirePart(torch.Size(shape), self.wire_dtype, placement),)

    def encode(self, piece: torch.Tensor, outs: Sequence[torch.Tensor], mesh) -> Any:
        sub = self.rebuild(piece)
        inputs, meta = _pre_all_gather(sub, mesh)
        if len(inputs) != 1 or inputs[0].shape != outs[0].shape:
            raise NotImplementedError(
                f"{self.cls.__name__}.fsdp_pre_all_gather returned "
                f"{[tuple(t.shape) for t in inputs]}; flexshard gathers one tensor of the "
                f"piece's shape {tuple(outs[0].shape)} per param")
        outs[0].copy_(inputs[0])
        return sub, meta

    def batch_key(self):
        return ("torchao float8", self.cls, self.wire_dtype) if self.batched else None

    def encode_batch(self, formats, pieces, mesh, cache) -> tuple:
        """torchao's cast of each piece (see float8.py): one amax all-reduce and
        one cast for the batch; each decode gets its subclass and scale."""
        scale = float8.bucket_scales(pieces, mesh, self.wire_dtype, cache)
        bits = float8.cast(pieces, scale, self.wire_dtype, cache)
        return (bits,), [(sub, (s,)) for sub, s in zip(_rebuilt(formats, pieces, cache),
                                                      scale.unbind(0))]

    def encode_batch_into(self, formats, pieces, outs, mesh, cache):
        """encode_batch with the cast on CUDA fused, straight into the gather input."""
        if not (self.batched and fused_kernels(pieces)):
            return None
        scale = float8.bucket_scales(pieces, mesh, self.wire_dtype, cache)
        float8.cast_into(pieces, scale, [parts[0] for parts in outs], cache)
        return [(sub, (s,)) for sub, s in zip(_rebuilt(formats, pieces, cache),
                                              scale.unbind(0))]

    def rebuild(self, piece: torch.Tensor) -> torch.Tensor:
        """The subclass around this rank's piece (its post-all-gather reads its config)."""
        return self.cls.__tensor_unflatten__({self.inner: piece}, self.ctx, piece.shape,
                                             piece.stride())

    def decode(self, fulls: Sequence[torch.Tensor], meta: Any) -> torch.Tensor:
        sub, inner_meta = meta
        out, _ = sub.fsdp_post_all_gather((fulls[0],), inner_meta, self.out_dtype)
        return out

    def refill(self, fulls: Sequence[torch.Tensor], meta: Any, out: torch.Tensor) -> None:
        sub, inner_meta = meta
        sub.fsdp_post_all_gather((fulls[0],), inner_meta, self.out_dtype, out=out)


def _rebuilt(formats: Sequence[SubclassGather], pieces: Sequence[torch.Tensor],
             cache: dict) -> list:
    """Each piece's subclass, kept while the pieces are the same tensors (the
    storage's views; an offloaded bucket stages new ones each gather)."""
    kept = cache.get("subclasses")
    if kept is None or len(kept[0]) != len(pieces) or any(
            a is not b for a, b in zip(kept[0], pieces)):
        kept = cache["subclasses"] = (list(pieces), [f.rebuild(p) for f, p in zip(formats, pieces)])
    return kept[1]


def _pre_all_gather(sub: torch.Tensor, mesh) -> tuple:
    """FSDP2's two signatures: (mesh), or (mesh, outer_size, outer_stride, module, mp_policy)."""
    params = inspect.signature(sub.fsdp_pre_all_gather).parameters
    if len(params) == 1:
        return sub.fsdp_pre_all_gather(mesh)
    return sub.fsdp_pre_all_gather(mesh, sub.shape, sub.stride(), None, None)


def subclass_gather(fqn: str, param: torch.Tensor) -> Optional[SubclassGather]:
    """The wire format of a param whose tensor subclass defines its own
    all-gather (its out_dtype still the param's: the bucket sets its gather
    dtype); None for any other param."""
    cls = type(param.data) if isinstance(param, torch.nn.Parameter) else type(param)
    if not hasattr(cls, "fsdp_pre_all_gather") or not hasattr(cls, "__tensor_flatten__"):
        return None
    names, ctx = param.data.__tensor_flatten__()
    wire = ctx.get("dtype") if isinstance(ctx, dict) else None
    if len(names) < 1 or not isinstance(wire, torch.dtype):
        raise NotImplementedError(
            f"parameter {fqn!r} is a {cls.__name__}, a tensor subclass with its own "
            "all-gather, whose wire dtype flexshard cannot read at wrap time (it reads a "
            "'dtype' entry of its __tensor_flatten__ context, as torchao's float8 weights "
            "have); unwrap it to a plain tensor before flex_shard")
    if not _takes_out(cls):
        raise NotImplementedError(
            f"parameter {fqn!r} is a {cls.__name__} whose fsdp_post_all_gather takes no "
            "`out`: flexshard renews the unsharded param it made at the first gather, as "
            "FSDP2 does; give it FSDP2's signature fsdp_post_all_gather(self, "
            "all_gather_outputs, metadata, param_dtype, *, out=None)")
    return SubclassGather(cls, names[0], ctx, wire, param.dtype,
                          float8.is_dynamic_float8(cls, names, ctx))


def with_gather_dtype(fmt: SubclassGather, dtype: torch.dtype) -> SubclassGather:
    """`fmt` decoding to the bucket's gather dtype."""
    return replace(fmt, out_dtype=dtype)


def check_pieces(fqn: str, bucket: str, fmt: SubclassGather, local_shapes: Sequence) -> None:
    """Every rank calls the subclass's pre-all-gather, which reduces over the
    group; an empty piece cannot take part (torch.max of nothing)."""
    empty = [r for r, shape in enumerate(local_shapes) if 0 in tuple(shape)]
    if empty:
        raise ValueError(
            f"parameter {fqn!r} (bucket {bucket!r}) is a {fmt.cls.__name__}, which gathers "
            f"through its own fsdp_pre_all_gather on every rank, but its placement leaves "
            f"rank(s) {empty} an empty piece; place it with fs.Shard(0) or fs.RaggedShard() "
            "so that every rank holds rows (not fs.Owned)")


def _takes_out(cls: type) -> bool:
    """Whether `cls.fsdp_post_all_gather` takes `out` (FSDP2's contract)."""
    try:
        return "out" in inspect.signature(cls.fsdp_post_all_gather).parameters
    except (AttributeError, TypeError, ValueError):
        return False
