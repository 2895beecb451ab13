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

`all_to_all` switches which dim is sharded (points to heads and back); both
sides are sharded, so its backward, the reverse all-to-all, is the exact
adjoint. `all_reduce_grad` is the identity forward and all-reduces the
gradient: the entry of a replicated tensor into computations that differ by
rank. The README and design.md tabulate every pair.

Each function checks its arguments on this rank before any collective. Then,
unless `check_sizes=False`, one small all-gather of the sizes, dims and shape
(a few int64s) makes every rank raise a ValueError when the ranks disagree,
instead of hanging or mixing rows. Once a loop's sizes are known to be right,
`check_sizes=False` saves that collective (and, on GPUs, its host sync).

Under `torch.compile` every collective here traces into the graph (dynamo turns
the c10d calls into functional collectives, and traces the autograd Functions),
with no graph break: the local checks run while tracing, the cross-rank check is
left out (it reads its result on the host). A user Comm's methods are traced
too; one doing what dynamo cannot trace breaks the graph there.

gloo has no uneven all-gather: pieces travel padded to the largest one
through `all_gather_into_tensor` / `reduce_scatter_tensor` and are trimmed.
The all-to-all is one uneven `all_to_all_single` of flat buffers.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..compat import TRACES_COLLECTIVE_FUNCTIONS
from ..runtime.comm import Comm


def traced_from_2_13(fn):
    """`fn` (a public collective); on torch before 2.13, `fn` run eagerly under
    torch.compile (a graph break there): that dynamo traces its autograd Function
    into a graph whose backward gives zero gradients (compat.TRACES_COLLECTIVE_FUNCTIONS)."""
    if TRACES_COLLECTIVE_FUNCTIONS:
        return fn
    return torch.compiler.disable(fn, reason="torch before 2.13 traces flexshard's activation "
                                             "collectives into graphs with zero gradients")


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


def _check_tensor(name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")


def _check_dim(name: str, tensor: torch.Tensor, dim, label: str = "dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: {label} must be an int, got {dim!r}")
    if not -tensor.dim() <= dim < max(tensor.dim(), 1) or not tensor.dim():
        raise ValueError(f"{name}: {label}={dim} is out of range for a tensor of shape "
                         f"{tuple(tensor.shape)}")
    return dim % tensor.dim()


class _Piece(NamedTuple):
    """A sharded dim: each rank must hold sizes[rank] rows along it."""

    label: str  # the sizes argument's name
    dim_label: str  # the dim argument's name
    dim: int
    sizes: tuple


def _piece_error(name: str, piece: _Piece, rank: int, have: int) -> ValueError:
    return ValueError(f"{name}: the tensor on rank {rank} has {have} rows along "
                      f"{piece.dim_label} {piece.dim} but {piece.label}[{rank}] is "
                      f"{piece.sizes[rank]}; pass sizes that match each rank's tensor")


def _check(name: str, tensor: torch.Tensor, sizes, dim: int, g: _Group, whole: bool,
           label: str = "sizes", dim_label: str = "dim", defer_piece: bool = False) -> tuple:
    """Validate before any collective; returns sizes as a tuple (or None) and dim.
    `whole`: the tensor holds all sum(sizes) rows, else this rank's piece, whose
    check `defer_piece` leaves to `_agree` (so every rank raises, not one)."""
    _check_tensor(name, tensor)
    dim = _check_dim(name, tensor, dim, dim_label)
    if sizes is None:
        return None, dim
    sizes = tuple(sizes)
    if len(sizes) != g.size or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                   for s in sizes):
        raise ValueError(f"{name}: {label}={list(sizes)} must hold one int >= 0 per rank of "
                         f"the group ({g.size} ranks); fs.shard_sizes(n) gives balanced sizes")
    if whole and tensor.shape[dim] != sum(sizes):
        raise ValueError(f"{name}: the tensor has {tensor.shape[dim]} rows along {dim_label} "
                         f"{dim} but sum({label}) is {sum(sizes)}; pass sizes that sum to it")
    if not whole and not defer_piece and tensor.shape[dim] != sizes[g.rank]:
        raise _piece_error(name, _Piece(label, dim_label, dim, sizes), g.rank, tensor.shape[dim])
    return sizes, dim


def _agree(name: str, g: _Group, tensor: torch.Tensor, fields: dict, pieces=()) -> None:
    """One small all-gather; every rank raises the same ValueError if the ranks
    passed different `fields` (label -> tuple of ints, the same length on every
    rank, as validated locally), tensors that differ outside the `pieces`' dims,
    or a piece whose rows do not match its sizes on some rank."""
    if g.size == 1 or torch.compiler.is_compiling():
        return  # compiled: the check would read its result on the host mid-graph
    # hash() of a tuple of ints is the same in every process (only str and
    # bytes hashes are salted), so one int stands for the fixed dims.
    shape = tuple(n for d, n in enumerate(tensor.shape) if d not in {p.dim for p in pieces})
    mine = [v for value in fields.values() for v in value]
    mine += [tensor.dim(), hash(shape)] + [tensor.shape[p.dim] for p in pieces]
    vec = torch.tensor(mine, dtype=torch.int64, device=tensor.device)
    out = vec.new_empty(g.size * len(mine))
    with record_function("FlexShard::activation_size_check"):
        g.comm.all_gather(out, vec, g.group)
    rows = out.view(g.size, len(mine)).tolist()
    start = 0
    for label, value in fields.items():
        per_rank = [row[start: start + len(value)] for row in rows]
        start += len(value)
        if any(v != per_rank[0] for v in per_rank):
            have = ", ".join(f"rank {r}: {v if len(v) > 1 else v[0]}"
                             for r, v in enumerate(per_rank))
            raise ValueError(f"{name}: {label} differs across the ranks of the group ({have}); "
                             "every rank must pass the same sizes and dims")
    differ = [r for r, row in enumerate(rows) if row[start: start + 2] != rows[0][start: start + 2]]
    if differ:
        raise ValueError(f"{name}: the tensors' shapes outside the sharded dims differ across "
                         f"the ranks of the group (ranks {differ} differ from rank 0; this rank "
                         f"has shape {tuple(tensor.shape)}); every rank must pass a tensor of the "
                         "same shape except along the sharded dims")
    for i, piece in enumerate(pieces):
        for r, row in enumerate(rows):
            if row[start + 2 + i] != piece.sizes[r]:
                raise _piece_error(name, piece, r, row[start + 2 + i])


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
    with record_function("FlexShard::activation_all_gather"):
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
    with record_function("FlexShard::activation_reduce_scatter"):
        g.comm.reduce_scatter(out, send, g.group)
    return out[: sizes[g.rank]].movedim(0, dim).contiguous()


def _all_reduce(t: torch.Tensor, g: _Group) -> torch.Tensor:
    out = t.clone()
    if g.size > 1:
        with record_function("FlexShard::activation_all_reduce"):
            g.comm.all_reduce(out, g.group)
    return out


def _all_to_all(piece: torch.Tensor, split_sizes, split_dim: int, concat_sizes,
                concat_dim: int, g: _Group) -> torch.Tensor:
    """Sharded along concat_dim, whole along split_dim -> whole along concat_dim,
    split_sizes[rank] rows along split_dim: one uneven all_to_all_single."""
    if g.size == 1:
        return piece.clone()
    # With split_dim moved to the front, the block for rank j is a contiguous
    # run of split_sizes[j] rows: the flat send buffer is segmented by rank.
    rows = piece.movedim(split_dim, 0).contiguous()
    row_numel = math.prod(rows.shape[1:])
    cat_dim = concat_dim + 1 if concat_dim < split_dim else concat_dim  # its index in `rows`
    shapes = []
    for size in concat_sizes:  # the block received from rank j
        shape = [split_sizes[g.rank], *rows.shape[1:]]
        shape[cat_dim] = size
        shapes.append(shape)
    recv = [math.prod(shape) for shape in shapes]
    out = rows.new_empty(sum(recv))
    with record_function("FlexShard::activation_all_to_all"):
        g.comm.all_to_all(out, rows.view(-1), recv, [s * row_numel for s in split_sizes],
                          g.group)
    blocks = [block.view(shape) for block, shape in zip(out.split(recv), shapes)]
    return torch.cat(blocks, cat_dim).movedim(0, split_dim).contiguous()


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


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece, split_sizes, split_dim, concat_sizes, concat_dim, g):
        ctx.args = (split_sizes, split_dim, concat_sizes, concat_dim, g)
        return _all_to_all(piece, split_sizes, split_dim, concat_sizes, concat_dim, g)

    @staticmethod
    def backward(ctx, grad):
        split_sizes, split_dim, concat_sizes, concat_dim, g = ctx.args
        # The forward only moves elements (a permutation across ranks), so its
        # adjoint moves them back: the reverse all-to-all, no FullGrad needed.
        out = _all_to_all(grad.contiguous(), concat_sizes, concat_dim, split_sizes, split_dim, g)
        return out, None, None, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, g):
        ctx.g = g
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.g), None


def _check_flag(name: str, value, label: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: {label} must be a bool, got {value!r}")


def _prepare(name, tensor, sizes, dim, group, full_grad, comm, whole, check_sizes,
             replicated_collective=False) -> tuple:
    """Validate; with `check_sizes`, check the ranks agree when a collective will
    run (sizes given, or `replicated_collective`: an all-reduce of the whole)."""
    if not isinstance(full_grad, FullGrad):
        raise TypeError(f"{name}: full_grad must be a fs.collectives.FullGrad, got {full_grad!r}")
    _check_flag(name, check_sizes, "check_sizes")
    g = _group(group, comm)
    defer = check_sizes and g.size > 1
    sizes, dim = _check(name, tensor, sizes, dim, g, whole, defer_piece=defer)
    if defer and (sizes is not None or replicated_collective):
        pieces = [] if whole or sizes is None else [_Piece("sizes", "dim", dim, sizes)]
        _agree(name, g, tensor, {"sizes": sizes or (), "dim": (dim,)}, pieces)
    return sizes, dim, g


@traced_from_2_13
def shard_tensor(full: torch.Tensor, sizes: Optional[Sequence[int]], dim: int = 0,
                 group=None, *, full_grad: FullGrad = FullGrad.REPLICATE,
                 comm: Optional[Comm] = None, check_sizes: bool = True) -> torch.Tensor:
    """This rank's piece (`sizes[rank]` rows along `dim`) of a whole tensor that
    every rank holds. No collective forward (but the size check, see the module
    docstring); backward all-gathers (REPLICATE) or pads with zeros (PARTIAL)."""
    sizes, dim, g = _prepare("shard_tensor", full, sizes, dim, group, full_grad, comm, True,
                             check_sizes)
    if sizes is None:
        return full
    return _Shard.apply(full, sizes, dim, g, full_grad)


@traced_from_2_13
def gather_tensor(piece: torch.Tensor, sizes: Optional[Sequence[int]], dim: int = 0,
                  group=None, *, full_grad: FullGrad = FullGrad.REPLICATE,
                  comm: Optional[Comm] = None, check_sizes: bool = True) -> torch.Tensor:
    """The whole tensor on every rank from each rank's piece (`sizes[r]` rows
    along `dim` on rank r): one padded all-gather. Backward keeps this rank's
    slice (REPLICATE) or reduce-scatters (PARTIAL)."""
    sizes, dim, g = _prepare("gather_tensor", piece, sizes, dim, group, full_grad, comm, False,
                             check_sizes)
    if sizes is None:
        return piece
    return _Gather.apply(piece, sizes, dim, g, full_grad)


@traced_from_2_13
def reduce_scatter_tensor(tensor: torch.Tensor, sizes: Optional[Sequence[int]], dim: int = 0,
                          group=None, *, full_grad: FullGrad = FullGrad.REPLICATE,
                          comm: Optional[Comm] = None, check_sizes: bool = True) -> torch.Tensor:
    """Sum every rank's whole `tensor` and keep this rank's piece (`sizes[rank]`
    rows along `dim`): one padded reduce-scatter; backward all-gathers.
    `sizes=None` keeps the whole sum (an all-reduce, the row-parallel layer's
    output); its backward is the identity (REPLICATE) or an all-reduce (PARTIAL)."""
    sizes, dim, g = _prepare("reduce_scatter_tensor", tensor, sizes, dim, group, full_grad,
                             comm, True, check_sizes, replicated_collective=True)
    if sizes is None:
        return _AllReduce.apply(tensor, g, full_grad)
    return _ReduceScatter.apply(tensor, sizes, dim, g)


@traced_from_2_13
def all_reduce_grad(tensor: torch.Tensor, group=None, *, comm: Optional[Comm] = None,
                    check_sizes: bool = True) -> torch.Tensor:
    """The identity forward; backward all-reduces the gradient.

    Put it where a tensor every rank holds whole (REPLICATE) enters
    computations that differ by rank (each rank's heads or columns): each
    rank's gradient is then a summand (PARTIAL) and the sum is the true one.
    The reverse of `reduce_scatter_tensor(t, None)` (all-reduce forward,
    identity backward)."""
    name = "all_reduce_grad"
    _check_tensor(name, tensor)
    _check_flag(name, check_sizes, "check_sizes")
    g = _group(group, comm)
    if check_sizes:
        _agree(name, g, tensor, {})
    return _AllReduceGrad.apply(tensor, g)


@traced_from_2_13
def all_to_all(tensor: torch.Tensor, split_sizes: Sequence[int], split_dim: int,
               concat_sizes: Sequence[int], concat_dim: int, group=None, *,
               comm: Optional[Comm] = None, check_sizes: bool = True) -> torch.Tensor:
    """Move the sharding from `concat_dim` to `split_dim`: one uneven all-to-all.

    The input holds `concat_sizes[rank]` rows along `concat_dim` and all
    `sum(split_sizes)` rows along `split_dim`; the output holds all
    `sum(concat_sizes)` rows along `concat_dim` (rank 0's first) and
    `split_sizes[rank]` rows along `split_dim`. Either list may be uneven and
    hold zeros. Backward is the reverse all-to-all, the exact adjoint.
    """
    name = "all_to_all"
    _check_tensor(name, tensor)
    _check_flag(name, check_sizes, "check_sizes")
    if _check_dim(name, tensor, split_dim, "split_dim") == _check_dim(name, tensor, concat_dim,
                                                                        "concat_dim"):
        raise ValueError(f"{name}: split_dim and concat_dim are both {split_dim % tensor.dim()}; "
                         "an all-to-all moves the sharding to another dim (to re-split one "
                         "dim, use gather_tensor then shard_tensor)")
    g = _group(group, comm)
    defer = check_sizes and g.size > 1
    split_sizes, split_dim = _check(name, tensor, split_sizes, split_dim, g, True,
                                    "split_sizes", "split_dim")
    concat_sizes, concat_dim = _check(name, tensor, concat_sizes, concat_dim, g, False,
                                      "concat_sizes", "concat_dim", defer_piece=defer)
    if defer:
        _agree(name, g, tensor, {"split_sizes": split_sizes, "concat_sizes": concat_sizes,
                                 "split_dim": (split_dim,), "concat_dim": (concat_dim,)},
               [_Piece("concat_sizes", "concat_dim", concat_dim, concat_sizes)])
    return _AllToAll.apply(tensor, split_sizes, split_dim, concat_sizes, concat_dim, g)
