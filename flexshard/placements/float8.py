"""torchao's float8 weights encoded a bucket at a time.

torchao's `WeightWithDynamicFloat8CastTensor` casts its piece to fp8 in its
fsdp_pre_all_gather: amax = max|piece|, all-reduced (MAX) over the shard group,
scale = fp8 max / amax (in float64, then float32), bits = clamp(piece * scale)
as fp8. Weight by weight that is a collective and about ten kernels per weight:
on an H100 it made a bucket's copy-in ten times its bf16 one. FSDP2 gets the
amaxes of all weights from one `torch._foreach_norm` and one all-reduce
(torchao's `precompute_float8_dynamic_scale_for_fsdp`); flexshard does the same
per bucket and also casts the bucket's weights together: a chunk of weights
of one size at a time (placements/batch.py), each chunk's pieces one view of the
bucket's storage (or joined as float32 in one op), one multiply by the scales
broadcast over their weights, one clamp and one cast. Same float32 products,
same clamp, same rounding: the bits and scales are those of the
weight-by-weight path (tests/test_float8_gather.py checks them bit for bit).

flexshard knows this class by its module and name (core does not import
torchao) and only while it carries no precomputed scale: any other subclass,
or a change torchao makes to this math, goes through the subclass's own hooks
weight by weight (the test above fails on such a change).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..compat import current_graph_task_id, foreach_norm, tensor_version
from .batch import Chunk, chunk_rows, chunks

EPS = 1e-12  # torchao.float8.float8_utils.EPS: an all-zero weight keeps a finite scale
_UP_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)  # exact in float32
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def is_dynamic_float8(cls: type, names: Sequence[str], ctx) -> bool:
    """Whether a subclass param is torchao's dynamically scaled float8 weight
    whose cast flexshard batches (one inner tensor, no precomputed scale)."""
    return (cls.__module__ == "torchao.float8.fsdp_utils"
            and cls.__name__ == "WeightWithDynamicFloat8CastTensor"
            and list(names) == ["_tensor"] and isinstance(ctx, dict) and ctx.get("dtype") in _FP8)


def local_amax(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """max|piece| of each piece on this rank, float32, one op (inf-norm: exact)."""
    return torch.stack(foreach_norm(pieces, ord=math.inf)).float()


def amax(pieces: Sequence[torch.Tensor], mesh) -> torch.Tensor:
    """max|piece| of each piece over the shard group, float32, one all-reduce.
    Over the whole default group when `mesh` is None, as torchao's per-weight
    path reduces (a world of one is then left alone only without a process group)."""
    out = local_amax(pieces)
    if dist.is_available() and dist.is_initialized():
        group = mesh.get_group() if mesh is not None else dist.group.WORLD
        with record_function("FlexShard::float8_amax_all_reduce"):
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def bucket_scales(pieces: Sequence[torch.Tensor], mesh, dtype: torch.dtype,
                  cache: dict) -> torch.Tensor:
    """Each piece's scale: its amax over the group, as `scales`. Backward's
    regather reuses forward's: the same pieces at the same version hold the
    same values (the regather refuses params changed since forward, on every
    rank, before this runs), so it is one all-reduce per bucket and step where
    FSDP2 + torchao's precompute makes one per step for the whole model."""
    version = tensor_version(pieces[0])  # the storage's counter, shared by its views
    kept = cache.get("scale")
    in_backward = current_graph_task_id() != -1  # a regather, inside backward
    if (kept is not None and in_backward and kept[0] == version
            and all(a is b for a, b in zip(kept[1], pieces))):
        return kept[2]
    out = scales(amax(pieces, mesh), dtype)
    cache["scale"] = (version, list(pieces), out)
    return out


def scales(amaxes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's amax_to_scale, elementwise: float64, clamp, max / amax, float32."""
    amaxes = amaxes.to(torch.float64)
    return (torch.finfo(dtype).max / torch.clamp(amaxes, min=EPS)).to(torch.float32)


def cast(pieces: Sequence[torch.Tensor], scale: torch.Tensor, dtype: torch.dtype,
         cache: dict) -> torch.Tensor:
    """Every piece times its scale, saturated to `dtype`'s range and cast: the
    pieces' fp8 bits joined flat, in order; a chunk of pieces of one size at a
    time (batch.py), each piece a block of its own scale."""
    plan = cache.get("cast")
    if plan is None:
        plan = cache["cast"] = chunks([p.numel() for p in pieces], [p.numel() for p in pieces])
    out = torch.empty(plan[-1].stop, dtype=dtype, device=pieces[0].device)
    for c in plan:
        _cast_chunk(pieces, c, scale[c.first:c.last, None], out[c.start:c.stop])
    return out


def _cast_chunk(pieces: Sequence[torch.Tensor], c: Chunk, scale: torch.Tensor,
                out: torch.Tensor) -> None:
    """A chunk's pieces cast into `out` (its float32 products freed on return)."""
    rows, fresh = chunk_rows(pieces, c, torch.float32, _UP_TO_FP32)
    # torchao upcasts to float32, then multiplies; type promotion does the same
    scaled = rows.mul_(scale) if fresh else torch.mul(rows, scale)
    top = torch.finfo(out.dtype).max
    out.view(scaled.shape).copy_(scaled.clamp_(min=-top, max=top))


def cast_each(pieces: Sequence[torch.Tensor], scale: torch.Tensor, dtype: torch.dtype) -> list:
    """cast, piece by piece (the whole-step graph's: runtime/traced.py): the same
    float32 products, clamp and rounding, each piece its own tensor."""
    top = torch.finfo(dtype).max
    return [(p.float() * s).clamp(-top, top).to(dtype) for p, s in zip(pieces, scale.unbind(0))]


def cast_into(pieces: Sequence[torch.Tensor], scale: torch.Tensor,
              outs: Sequence[torch.Tensor], cache: dict) -> None:
    """cast, each piece straight into its place in the gather input (`outs`), by one
    fused kernel launch (placements/quantized_kernels.py, where batch.fused_kernels):
    the same float32 products, clamp and rounding."""
    from .quantized_kernels import scale_and_cast

    scale_and_cast(pieces, scale, outs, torch.finfo(outs[0].dtype).max, cache)
