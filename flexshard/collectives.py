"""Uneven collectives with autograd, for parameters and activations alike.

Each function takes explicit per-rank sizes along `dim`: `sizes[r]` rows on
rank r (0 is an empty piece; `fs.shard_sizes` computes balanced or weighted
sizes), or `None` for a tensor every rank holds whole (replicated).

Gradients of the whole (replicated) side follow `FullGrad`:

- `FullGrad.REPLICATE` (default, as DTensor's Replicate): the whole tensor and
  its gradient are the same on every rank, because every rank runs the same
  computation on it. `shard_tensor`'s backward all-gathers; `gather_tensor`'s
  backward keeps this rank's slice.
- `FullGrad.PARTIAL`: each rank's gradient of the whole tensor is its own
  contribution (ranks computed different losses from it); the true gradient is
  the sum over ranks. This is the exact adjoint: `shard_tensor`'s backward
  pads with zeros, `gather_tensor`'s backward reduce-scatters.

gloo has no uneven all-gather: pieces travel padded to the largest one
through `all_gather_into_tensor` / `reduce_scatter_tensor` and are trimmed.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .runtime.comm import Comm


class FullGrad(enum.Enum):
    """How the gradient of a whole (replicated) tensor is held across ranks."""

    REPLICATE = "replicate"  # the same full gradient on every rank
    PARTIAL = "partial"  # each rank holds a summand of the gradient


class _Group(NamedTuple):
    group: object
    rank: int
    size: int
    comm: Comm


def _group(group, comm: Optional[Comm]) -> _Group:
    comm = comm or Comm()
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not "
                             "initialized; call dist.init_process_group first")
        return _Group(None, 0, 1, comm)
    return _Group(group, dist.get_rank(group), dist.get_world_size(group), comm)


def _check(name: str, tensor: torch.Tensor, sizes, dim: int, g: _Group,
           whole: bool) -> Optional[tuple]:
    """Validate before any collective; returns sizes as a tuple (or None) and dim."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    if not -tensor.dim() <= dim < max(tensor.dim(), 1) or not tensor.dim():
        raise ValueError(f"{name}: dim={dim} is out of range for a tensor of shape "
                         f"{tuple(tensor.shape)}")
    dim %= tensor.dim()
    if sizes is None:
        return None, dim
    sizes = tuple(sizes)
    if len(sizes) != g.size or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                   for s in sizes):
        raise ValueError(f"{name}: sizes={list(sizes)} must hold one int >= 0 per rank of "
                         f"the group ({g.size} ranks); fs.shard_sizes(n) gives balanced sizes")
    have, want = tensor.shape[dim], sum(sizes) if whole else sizes[g.rank]
    if have != want:
        what = "sum(sizes)" if whole else f"sizes[{g.rank}] (this rank)"
        raise ValueError(f"{name}: the tensor has {have} rows along dim {dim} but "
                         f"{what} is {want}; pass sizes that match the tensor")
    return sizes, dim


def _offsets(sizes: Sequence[int]) -> list:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


def _all_gather(piece: torch.Tensor, sizes, dim: int, g: _Group) -> torch.Tensor:
    """Pieces (sizes along dim) -> the whole tensor on every rank."""
    rows = piece.movedim(dim, 0)
    width = max(sizes)
    if g.size == 1 or width == 0:
        return piece.clone()
    send = rows.new_zeros((width, *rows.shape[1:]))
    send[: rows.shape[0]] = rows
    out = rows.new_empty((g.size * width, *rows.shape[1:]))
    g.comm.all_gather(out, send, g.group)
    parts = [out[r * width: r * width + s] for r, s in enumerate(sizes)]
    return torch.cat(parts).movedim(0, dim)


def _reduce_scatter(whole: torch.Tensor, sizes, dim: int, g: _Group) -> torch.Tensor:
    """Sum the ranks' whole tensors; rank r keeps its piece (sizes along dim)."""
    rows = whole.movedim(dim, 0)
    width = max(sizes)
    if g.size == 1 or width == 0:
        return whole.clone()
    send = rows.new_zeros((g.size * width, *rows.shape[1:]))
    for r, (start, s) in enumerate(zip(_offsets(sizes), sizes)):
        send[r * width: r * width + s] = rows[start: start + s]
    out = rows.new_empty((width, *rows.shape[1:]))
    g.comm.reduce_scatter(out, send, g.group)
    return out[: sizes[g.rank]].movedim(0, dim).contiguous()


def _all_reduce(t: torch.Tensor, g: _Group) -> torch.Tensor:
    out = t.clone()
    if g.size > 1:
        g.comm.all_reduce(out, g.group)
    return out


def _slice(whole: torch.Tensor, sizes, dim: int, rank: int) -> torch.Tensor:
    return whole.narrow(dim, sum(sizes[:rank]), sizes[rank])


def _pad(piece: torch.Tensor, sizes, dim: int, rank: int) -> torch.Tensor:
    shape = list(piece.shape)
    shape[dim] = sum(sizes)
    whole = piece.new_zeros(shape)
    whole.narrow(dim, sum(sizes[:rank]), sizes[rank]).copy_(piece)
    return whole


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full, sizes, dim, g, full_grad):
        ctx.args = (sizes, dim, g, full_grad)
        return _slice(full, sizes, dim, g.rank).contiguous()

    @staticmethod
    def backward(ctx, grad):
        sizes, dim, g, full_grad = ctx.args
        if full_grad is FullGrad.REPLICATE:
            return _all_gather(grad.contiguous(), sizes, dim, g), None, None, None, None
        return _pad(grad, sizes, dim, g.rank), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece, sizes, dim, g, full_grad):
        ctx.args = (sizes, dim, g, full_grad)
        return _all_gather(piece, sizes, dim, g)

    @staticmethod
    def backward(ctx, grad):
        sizes, dim, g, full_grad = ctx.args
        if full_grad is FullGrad.REPLICATE:
            return _slice(grad, sizes, dim, g.rank).contiguous(), None, None, None, None
        return _reduce_scatter(grad, sizes, dim, g), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole, sizes, dim, g):
        ctx.args = (sizes, dim, g)
        return _reduce_scatter(whole, sizes, dim, g)

    @staticmethod
    def backward(ctx, grad):
        sizes, dim, g = ctx.args
        return _all_gather(grad.contiguous(), sizes, dim, g), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, g, full_grad):
        ctx.args = (g, full_grad)
        return _all_reduce(tensor, g)

    @staticmethod
    def backward(ctx, grad):
        g, full_grad = ctx.args
        out = grad if full_grad is FullGrad.REPLICATE else _all_reduce(grad, g)
        return out, None, None


def _prepare(name, tensor, sizes, dim, group, full_grad, comm, whole) -> tuple:
    if not isinstance(full_grad, FullGrad):
        raise TypeError(f"{name}: full_grad must be a fs.collectives.FullGrad, got {full_grad!r}")
    g = _group(group, comm)
    sizes, dim = _check(name, tensor, sizes, dim, g, whole)
    return sizes, dim, g


def shard_tensor(full: torch.Tensor, sizes: Optional[Sequence[int]], dim: int = 0,
                 group=None, *, full_grad: FullGrad = FullGrad.REPLICATE,
                 comm: Optional[Comm] = None) -> torch.Tensor:
    """This rank's piece (`sizes[rank]` rows along `dim`) of a whole tensor that
    every rank holds. No collective forward; see FullGrad for the backward."""
    sizes, dim, g = _prepare("shard_tensor", full, sizes, dim, group, full_grad, comm, True)
    if sizes is None:
        return full
    return _Shard.apply(full, sizes, dim, g, full_grad)


def gather_tensor(piece: torch.Tensor, sizes: Optional[Sequence[int]], dim: int = 0,
                  group=None, *, full_grad: FullGrad = FullGrad.REPLICATE,
                  comm: Optional[Comm] = None) -> torch.Tensor:
    """The whole tensor on every rank from each rank's piece (`sizes[r]` rows
    along `dim` on rank r): one padded all-gather. See FullGrad for the backward."""
    sizes, dim, g = _prepare("gather_tensor", piece, sizes, dim, group, full_grad, comm, False)
    if sizes is None:
        return piece
    return _Gather.apply(piece, sizes, dim, g, full_grad)


def reduce_scatter_tensor(tensor: torch.Tensor, sizes: Optional[Sequence[int]], dim: int = 0,
                          group=None, *, full_grad: FullGrad = FullGrad.REPLICATE,
                          comm: Optional[Comm] = None) -> torch.Tensor:
    """Sum every rank's whole `tensor` and keep this rank's piece (`sizes[rank]`
    rows along `dim`): one padded reduce-scatter; backward all-gathers.
    `sizes=None` keeps the whole sum (an all-reduce); its gradient then
    follows `full_grad`."""
    sizes, dim, g = _prepare("reduce_scatter_tensor", tensor, sizes, dim, group, full_grad,
                             comm, True)
    if sizes is None:
        return _AllReduce.apply(tensor, g, full_grad)
    return _ReduceScatter.apply(tensor, sizes, dim, g)
