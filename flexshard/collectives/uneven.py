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

Each function checks its arguments before any collective, and unless
`check_sizes=False` one small all-gather (six int64s) compares the
ranks' sizes, dims, `full_grad`, tensor shapes outside the sharded dims and
dtypes, and carries each rank's own check's result: every rank raises the same
error when one rank's arguments were refused or the ranks disagree, instead of
one rank raising while the others hang, or the data mixing rows or bytes (the
details travel in a second, object all-gather, on that failure only). It also
attaches the autograd node on a rank whose tensor does not require grad where
another rank's does (an empty piece made by `torch.zeros(0, C)`), so that every
rank runs the backward's collective. Once a loop's sizes are known to be right,
`check_sizes=False` saves that collective (and, on GPUs, its host sync).

Outputs are new tensors, never views, so in-place ops on them (`relu_`, `+=`)
work, except `all_reduce_grad`'s (a view of its input) and, with `sizes=None`,
`shard_tensor`'s and `gather_tensor`'s (the input itself): clone those first. Backwards are differentiable
(`create_graph=True`: gradient penalties): each backward is the adjoint
collective's autograd Function, whose own backward is the forward again.

Under `torch.compile` every collective here traces into the graph (dynamo turns
the c10d calls into functional collectives, and traces the autograd Functions),
with no graph break: the local checks (this rank's piece against its size
included) run while tracing, the cross-rank check is left out (it reads its
result on the host). A user Comm's methods are traced too; one doing what
dynamo cannot trace breaks the graph there.

gloo has no uneven all-gather: pieces travel padded to the largest one
through `all_gather_into_tensor` / `reduce_scatter_tensor` and are trimmed.
The all-to-all is one uneven `all_to_all_single` of flat buffers.
"""

from __future__ import annotations

import enum
import functools
import math
import numbers
import zlib
from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import record_function

from ..compat import TRACES_COLLECTIVE_FUNCTIONS
from ..runtime.comm import Comm
from ..wrap.teardown import destroy_gloo_group_at_exit


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


def _group(name: str, group, comm: Optional[Comm]) -> _Group:
    comm = comm or Comm()
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(f"{name}: a process group was given but torch.distributed is not "
                             "initialized; call dist.init_process_group first")
        return _Group(None, 0, 1, comm)
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{name}: group is a {group.ndim}-D DeviceMesh "
                             f"{tuple(group.mesh_dim_names or ())}; pass one dim's group: "
                             "mesh.get_group(\"name\") (or the 1-D mesh[\"name\"])")
        group = group.get_group()
    if not torch.compiler.is_compiling():  # a clean exit for a script using only these
        destroy_gloo_group_at_exit()  # (wrap/teardown.py)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{name}: this process (rank {dist.get_rank()} of the default group) is "
                         "not in the group given; call it on the group's ranks only")
    return _Group(group, rank, dist.get_world_size(group), comm)


def _sizes(name: str, given, g: _Group, label: str = "sizes", what: str = "") -> tuple:
    """`sizes` as a tuple of ints, one >= 0 per rank of the group (numpy ints
    too), or ValueError naming it."""
    if not hasattr(given, "__iter__") or isinstance(given, str):  # one int, say
        raise ValueError(f"{name}: {label}={given!r} must be a list of one int >= 0 per rank "
                         f"of the group ({g.size} ranks){what}; fs.shard_sizes(n) gives "
                         "balanced sizes")
    sizes = tuple(given)
    ok = all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in sizes)
    if ok:
        sizes = tuple(s if isinstance(s, int) else int(s) for s in sizes)
    if not ok or len(sizes) != g.size or any(s < 0 for s in sizes):
        kinds = "" if ok else (f"; it holds {sorted({type(s).__name__ for s in sizes})}: pass "
                               "Python ints (a tensor's .tolist())")
        raise ValueError(f"{name}: {label}={list(sizes)} must hold one int >= 0 per rank of "
                         f"the group ({g.size} ranks){what}{kinds}; fs.shard_sizes(n) gives "
                         "balanced sizes")
    return sizes


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


def _check(name: str, tensor: torch.Tensor, sizes, dim: int, g: _Group, whole: bool,
           label: str = "sizes", dim_label: str = "dim") -> tuple:
    """Validate on this rank; returns sizes as a tuple (or None) and dim.
    `whole`: the tensor holds all sum(sizes) rows, else this rank's piece."""
    if sizes is None:  # the whole tensor (a 0-d loss too: no dim to cut)
        return None, _check_dim(name, tensor, dim, dim_label) if tensor.dim() else 0
    dim = _check_dim(name, tensor, dim, dim_label)
    sizes = _sizes(name, sizes, g, label)
    if whole and tensor.shape[dim] != sum(sizes):
        raise ValueError(f"{name}: the tensor has {tensor.shape[dim]} rows along {dim_label} "
                         f"{dim} but sum({label}) is {sum(sizes)}; pass sizes that sum to it")
    if not whole and tensor.shape[dim] != sizes[g.rank]:
        raise ValueError(f"{name}: the tensor on rank {g.rank} has {tensor.shape[dim]} rows "
                         f"along {dim_label} {dim} but {label}[{g.rank}] is {sizes[g.rank]}; "
                         "pass sizes that match each rank's tensor")
    return sizes, dim


class _Agreement(NamedTuple):
    """What every rank of the group must pass alike: label -> tuple of values,
    and the dims along which the ranks' tensors may differ (their pieces);
    `flow`: digests of what this rank sends and receives, whose sums over the
    ranks must match (a halo plan's), and `hint`: what a differing field asks for."""

    fields: dict
    piece_dims: tuple = ()
    flow: tuple = (0, 0)
    hint: str = "every rank must pass the same sizes, dims and full_grad"


def _checked(name: str, g: _Group, tensor: torch.Tensor, check: Callable, agree: bool) -> tuple:
    """`check()` (this rank's validation: (result, _Agreement), or it raises)
    and, when `agree`, the ranks' agreement (`_agree`). Returns (result,
    tensor); the tensor made to require grad where another rank's does."""
    def checks() -> tuple:  # a non-tensor (an empty piece passed as None) too
        _check_tensor(name, tensor)
        return check()

    if not agree or g.size == 1 or torch.compiler.is_compiling():
        return checks()[0], tensor  # compiled: the check would read its result on the host
    try:
        result, agreement = checks()
        error = None
    except (TypeError, ValueError) as e:
        result, agreement, error = None, None, e
    return result, _never_traced(_agree)(name, g, tensor, agreement, error)


@functools.lru_cache(maxsize=None)
def _never_traced(fn: Callable) -> Callable:
    """`fn`, run whole and eagerly where a compiled function calls it after a graph
    break (the cross-rank check reads its result on the host). Made at first use:
    torch.compiler.disable imports dynamo, which importing flexshard must not."""
    return torch.compiler.disable(fn, reason="the cross-rank check reads its result on the host")


def _control_device(g: _Group) -> torch.device:
    """Where small control tensors travel (a check without a tensor, a halo plan's
    ids): the host, except on NCCL, which moves only the current CUDA device's."""
    nccl = dist.is_initialized() and dist.get_backend(g.group) == dist.Backend.NCCL
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _summary(tensor: torch.Tensor, agreement: _Agreement) -> dict:
    shape = tuple(n for d, n in enumerate(tensor.shape) if d not in agreement.piece_dims)
    return {**agreement.fields, "shape": (tensor.dim(), shape), "dtype": str(tensor.dtype)}


def _agree(name: str, g: _Group, tensor: torch.Tensor, agreement: Optional[_Agreement],
           error: Optional[Exception]) -> torch.Tensor:
    """One all-gather of six int64s per rank: whether its own check failed,
    whether its tensor needs grad, its grad mode, a checksum of what the ranks
    must pass alike, and its flow digests. Every rank raises when any check
    failed, the checksums differ or what the ranks send is not what they
    receive; a tensor that does not require grad where another rank's does is
    returned as a leaf that does (its backward's collective must run)."""
    summary = None if error is not None else _summary(tensor, agreement)
    grad_mode, is_tensor = torch.is_grad_enabled(), isinstance(tensor, torch.Tensor)
    digest = 0 if summary is None else zlib.crc32(repr(summary).encode())
    flow = (0, 0) if agreement is None else agreement.flow
    mine = [error is not None, grad_mode and is_tensor and tensor.requires_grad, grad_mode,
            digest, *flow]
    device = tensor.device if is_tensor else _control_device(g)
    vec = torch.tensor(mine, dtype=torch.int64, device=device)
    out = vec.new_empty(g.size * len(mine))
    with record_function("FlexShard::activation_size_check"):
        g.comm.all_gather(out, vec, g.group)
    rows = out.view(g.size, len(mine)).tolist()
    if any(row[0] or row[3] != rows[0][3] for row in rows):
        _raise_disagreement(name, g, error, summary, tuple(getattr(tensor, "shape", ())),
                            (agreement or _Agreement({})).hint)
    if sum(row[4] for row in rows) != sum(row[5] for row in rows):
        raise ValueError(f"{name}: the ranks' plans disagree on the rows they exchange (what a "
                         "rank sends is not what its receiver's plan expects: a stale plan, or "
                         "plans built from each rank's own edges); build every rank's plan from "
                         "the same graph, HaloPlan.from_edges with the whole graph's edges on "
                         "every rank, or HaloPlan.from_send_index from what each rank sends")
    if any(row[1] for row in rows):
        off = [r for r, row in enumerate(rows) if not row[2]]
        if off:
            raise RuntimeError(f"{name}: ranks {off} run it with gradients off (torch.no_grad) "
                               "while other ranks' tensors require grad: their backward would "
                               "wait for those ranks forever; run every rank in one grad mode")
        if not tensor.requires_grad:
            tensor = tensor.detach().requires_grad_()
    return tensor


def _raise_disagreement(name: str, g: _Group, error, summary, shape: tuple, hint: str) -> None:
    """The ranks' own errors and summaries (one object all-gather), and the
    error every rank raises: the first refused rank's, or what differs."""
    own = None if error is None else (type(error).__name__, str(error))
    every = [None] * g.size
    dist.all_gather_object(every, (own, summary), group=g.group)
    for rank, (failed, _) in enumerate(every):
        if failed is not None:  # the first refused rank's error, the same on every rank
            if rank == g.rank:
                raise error
            kind = TypeError if failed[0] == "TypeError" else ValueError
            raise kind(f"{failed[1]} (raised on rank {rank}; every rank of the group raises it)")
    summaries = [s for _, s in every]
    for label, value in summary.items():
        have = [s[label] for s in summaries]
        if all(v == have[0] for v in have):
            continue
        if label == "shape":
            differ = [r for r, v in enumerate(have) if v != have[0]]
            raise ValueError(f"{name}: the tensors' shapes outside the sharded dims differ across "
                             f"the ranks of the group (ranks {differ} differ from rank 0; this "
                             f"rank has shape {shape}); every rank must pass a tensor of the "
                             "same shape except along the sharded dims")
        listed = ", ".join(f"rank {r}: {_shown(v)}" for r, v in enumerate(have))
        if label == "dtype":
            raise ValueError(f"{name}: the tensors' dtypes differ across the ranks of the group "
                             f"({listed}); pass one dtype on every rank, an empty piece's too "
                             "(torch.zeros(0, ..., dtype=x.dtype))")
        raise ValueError(f"{name}: {label} differs across the ranks of the group ({listed}); "
                         f"{hint}")
    raise AssertionError(f"{name}: the ranks' checksums differ but their arguments agree")


def _shown(value):
    """A field's value as messages show it: one value bare, several as a list."""
    if isinstance(value, tuple):
        return value[0] if len(value) == 1 else list(value)
    return value


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
    parts = [out[r * width: r * width + s].movedim(0, dim) for r, s in enumerate(sizes)]
    return torch.cat(parts, dim)  # a new tensor, contiguous


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
    if dim == 0 and sizes[g.rank] == width:
        return out
    return out[: sizes[g.rank]].movedim(0, dim).clone(memory_format=torch.contiguous_format)


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
    joined = torch.cat(blocks, cat_dim)
    if split_dim == 0:
        return joined
    return joined.movedim(0, split_dim).clone(memory_format=torch.contiguous_format)


def _slice(whole: torch.Tensor, sizes, dim: int, rank: int) -> torch.Tensor:
    return whole.narrow(dim, sum(sizes[:rank]), sizes[rank])


def _pad(piece: torch.Tensor, sizes, dim: int, rank: int) -> torch.Tensor:
    shape = list(piece.shape)
    shape[dim] = sum(sizes)
    whole = piece.new_zeros(shape)
    whole.narrow(dim, sum(sizes[:rank]), sizes[rank]).copy_(piece)
    return whole


# Each backward is its adjoint's autograd Function, in pairs: shard and gather
# under REPLICATE, gather under PARTIAL and reduce-scatter, the all-reduce under
# REPLICATE and all_reduce_grad, the all-reduce under PARTIAL and the all-to-all
# with themselves (shard under PARTIAL pads with torch ops). A backward run with
# create_graph=True records the adjoint, and a second backward runs the forward
# again: second derivatives keep the FullGrad conventions. In a plain backward
# (grad mode off) `.apply` records nothing.


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full, sizes, dim, g, full_grad):
        ctx.args = (sizes, dim, g, full_grad)
        return _slice(full, sizes, dim, g.rank).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        sizes, dim, g, full_grad = ctx.args
        if full_grad is FullGrad.REPLICATE:
            return _Gather.apply(grad.contiguous(), sizes, dim, g, full_grad), None, None, None, None
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
            return _Shard.apply(grad, sizes, dim, g, full_grad), None, None, None, None
        return _ReduceScatter.apply(grad, sizes, dim, g), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole, sizes, dim, g):
        ctx.args = (sizes, dim, g)
        return _reduce_scatter(whole, sizes, dim, g)

    @staticmethod
    def backward(ctx, grad):
        sizes, dim, g = ctx.args
        # each rank's whole got the same gradient; a second backward sums theirs
        out = _Gather.apply(grad.contiguous(), sizes, dim, g, FullGrad.PARTIAL)
        return out, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, g, full_grad):
        ctx.args = (g, full_grad)
        return _all_reduce(tensor, g)

    @staticmethod
    def backward(ctx, grad):
        g, full_grad = ctx.args
        if full_grad is FullGrad.REPLICATE:
            return _AllReduceGrad.apply(grad, g), None, None
        return _AllReduce.apply(grad, g, full_grad), None, None


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
        out = _AllToAll.apply(grad.contiguous(), concat_sizes, concat_dim, split_sizes,
                              split_dim, g)
        return out, None, None, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, g):
        ctx.g = g
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return _AllReduce.apply(grad, ctx.g, FullGrad.REPLICATE), None


def _check_flag(name: str, value, label: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: {label} must be a bool, got {value!r}")


def _prepare(name, tensor, sizes, dim, group, full_grad, comm, whole, check_sizes,
             replicated_collective=False) -> tuple:
    """Validate; with `check_sizes`, check the ranks agree when a collective will
    run (sizes given, or `replicated_collective`: an all-reduce of the whole).
    Returns sizes, dim, the group and the tensor to run on (`_agree`)."""
    _check_flag(name, check_sizes, "check_sizes")
    g = _group(name, group, comm)

    def check():
        if not isinstance(full_grad, FullGrad):
            raise TypeError(f"{name}: full_grad must be a fs.collectives.FullGrad, got "
                            f"{full_grad!r}")
        checked = _check(name, tensor, sizes, dim, g, whole)
        fields = {"sizes": checked[0] or (), "dim": (checked[1],), "full_grad": (full_grad.value,)}
        return checked, _Agreement(fields, () if whole else (checked[1],))

    agree = check_sizes and (sizes is not None or replicated_collective)
    (sizes, dim), tensor = _checked(name, g, tensor, check, agree)
    return sizes, dim, g, tensor


@traced_from_2_13
def shard_tensor(full: torch.Tensor, sizes: Optional[Sequence[int]], dim: int = 0,
                 group=None, *, full_grad: FullGrad = FullGrad.REPLICATE,
                 comm: Optional[Comm] = None, check_sizes: bool = True) -> torch.Tensor:
    """This rank's piece (`sizes[rank]` rows along `dim`) of a whole tensor that
    every rank holds. No collective forward (but the size check, see the module
    docstring); backward all-gathers (REPLICATE) or pads with zeros (PARTIAL)."""
    sizes, dim, g, full = _prepare("shard_tensor", full, sizes, dim, group, full_grad, comm,
                                   True, check_sizes)
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
    sizes, dim, g, piece = _prepare("gather_tensor", piece, sizes, dim, group, full_grad, comm,
                                    False, check_sizes)
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
    sizes, dim, g, tensor = _prepare("reduce_scatter_tensor", tensor, sizes, dim, group,
                                     full_grad, comm, True, check_sizes,
                                     replicated_collective=True)
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
    _check_flag(name, check_sizes, "check_sizes")
    g = _group(name, group, comm)
    _, tensor = _checked(name, g, tensor, lambda: (None, _Agreement({})), check_sizes)
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
    _check_flag(name, check_sizes, "check_sizes")
    g = _group(name, group, comm)

    def check():
        if _check_dim(name, tensor, split_dim, "split_dim") == _check_dim(name, tensor, concat_dim,
                                                                            "concat_dim"):
            raise ValueError(f"{name}: split_dim and concat_dim are both {split_dim % tensor.dim()}; "
                             "an all-to-all moves the sharding to another dim (to re-split one "
                             "dim, use gather_tensor then shard_tensor)")
        split = _check(name, tensor, split_sizes, split_dim, g, True, "split_sizes", "split_dim")
        concat = _check(name, tensor, concat_sizes, concat_dim, g, False, "concat_sizes",
                        "concat_dim")
        fields = {"split_sizes": split[0], "concat_sizes": concat[0], "split_dim": (split[1],),
                  "concat_dim": (concat[1],)}
        return split + concat, _Agreement(fields, (concat[1],))

    (split_sizes, split_dim, concat_sizes, concat_dim), tensor = _checked(name, g, tensor, check,
                                                                          check_sizes)
    return _AllToAll.apply(tensor, split_sizes, split_dim, concat_sizes, concat_dim, g)
