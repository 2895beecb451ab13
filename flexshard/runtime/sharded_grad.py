"""Sharded grads whose norms are the full gradient's.

A sharded param's `.grad` is this rank's piece of the averaged gradient. Code
written for unsharded models takes norms of grads (torch.nn.utils.clip_grad_norm_
and get_total_norm call torch._foreach_norm or torch.linalg.vector_norm on them;
logging calls p.grad.norm()): on plain pieces each rank would get its own
pieces' norm and clip by it, silently. FSDP2's grads are DTensors, whose norms
are global. Here, when a backward ends, each bucket's sharded grads become
`ShardedGrad`s: the same tensors under a __torch_function__ subclass that runs
every op as a plain tensor (no wrapping of outputs, so optimizer state stays
plain) except full norms, which it completes with one all-reduce per call over
the ranks holding the other pieces. A norm of a sharded grad is therefore a
collective, as a DTensor's is: every rank must take it. Two more calls are
completed the same way: `.data` and `.detach()` return the piece still as a
ShardedGrad (hand-written clipping loops take `p.grad.data.norm()`), and
torch.amp.GradScaler's inf/NaN check makes its found_inf flag the maximum over
the ranks, so every rank skips the same steps. Other reductions (sum, max,
norms along dims) stay this rank's piece's.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..compat import amp_unscale_, foreach_norm, plain_torch_function
from .comm import Comm

_SPEC = "_flexshard_norm"  # a ShardedGrad's NormGroups


class NormGroups(NamedTuple):
    """Where a sharded grad's other pieces are: the groups its norm sums over."""

    groups: tuple  # the bucket's shard group (if > 1 rank), then TP groups it is split over
    comm: Comm
    device: Callable[[], torch.device]  # the collective's device: the bucket's compute
    #                                     device now (grads may be on host; meta at wrap time)
    refusal: Optional[str] = None  # why its norm cannot be completed here (raised instead)
    full_of: Optional[Callable] = None  # this piece -> the full grad (ShardedGrad.full_tensor)
    flag_groups: tuple = ()  # where a GradScaler's found_inf must agree: `groups`, and the
    #                          model's mesh for a bucket on a smaller one (other experts)
    name: str = "a param"  # "param 'fqn' (bucket 'b')", for errors
    agreement: Any = None  # the model's RankAgreement: the ranks pass the same grads

    def __deepcopy__(self, memo):
        return self  # process groups are not copied; the copy's pieces lie where these do


class ShardedGrad(torch.Tensor):
    """This rank's piece of a sharded param's gradient; full norms and GradScaler's
    inf/NaN check are global."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with plain_torch_function():
            if func is foreach_norm:
                return _foreach_norm(*args, **kwargs)
            if func in _FULL_NORMS and _full_reduction(func, args, kwargs):
                return _norm(func, args, kwargs)
            if func in _LINALG_NORMS:
                return _linalg_norm(func, args, kwargs)
            if func is amp_unscale_:
                return _unscale(*args, **kwargs)
            out = func(*args, **kwargs)
            if func in _ALIASES and type(args[0]) is ShardedGrad:
                return _sharded(out, _spec_of(args[0]))  # the same piece: norms stay global
            if func in _ARITHMETIC:
                return _arithmetic(out, args)
            return out

    def full_tensor(self) -> torch.Tensor:
        """The full gradient, as FSDP2's DTensor grads spell it: a collective
        (one all-gather of the bucket's pieces) that every rank holding a piece
        calls. For many grads, fs.full_grads(model) gathers each bucket once."""
        with record_function("FlexShard::grad_full_tensor"):
            return _spec_of(self).full_of(plain(self))

    def __reduce_ex__(self, protocol):
        # torch.save, pickling: a plain tensor (the piece); the groups stay behind
        with plain_torch_function():
            return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A plain alias of a ShardedGrad (its local norms are this rank's), else itself."""
    if type(tensor) is ShardedGrad:
        with plain_torch_function():
            return tensor.as_subclass(torch.Tensor)
    return tensor


def wrap_grads(params: Sequence[torch.Tensor], specs: Sequence[Optional[NormGroups]]) -> None:
    """Make each param's new grad a ShardedGrad (backward's end)."""
    for param, spec in zip(params, specs):
        grad = param.grad
        if spec is None or grad is None or type(grad) is ShardedGrad:
            continue
        param.grad = _sharded(grad, spec)


def _sharded(tensor: torch.Tensor, spec: NormGroups) -> "ShardedGrad":
    """`tensor` (a piece of a sharded grad, or an alias of one) as a ShardedGrad."""
    with plain_torch_function():
        sharded = tensor.as_subclass(ShardedGrad)
    sharded.__dict__[_SPEC] = spec
    return sharded


# The norms, completed.

_FULL_NORMS = (torch.linalg.vector_norm, torch.norm, torch.Tensor.norm)


def _full_reduction(func, args, kwargs) -> bool:
    """A norm over every element, of an order we can complete (p or 'fro')."""
    ord_ = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 else 2))
    dim = kwargs.get("dim", args[2] if len(args) > 2 else None)
    if ord_ == "fro":
        ord_ = 2
    return dim is None and kwargs.get("out") is None and isinstance(ord_, (int, float))


def _norm(func, args, kwargs) -> torch.Tensor:
    ord_ = kwargs.get("ord", kwargs.get("p", args[1] if len(args) > 1 else 2))
    if args[0].numel() == 0 and ord_ != "fro" and math.isinf(ord_):
        local = _empty_piece_norm(args[0], ord_, kwargs.get("dtype"))
    else:
        local = func(*args, **kwargs)
    return complete_norms([local], [_spec_of(args[0])], 2.0 if ord_ == "fro" else float(ord_))[0]


def _foreach_norm(tensors, ord=2, dtype=None) -> list:
    has_norm = [t.numel() > 0 or not math.isinf(ord) for t in tensors]
    kept = [t for t, has in zip(tensors, has_norm) if has]
    norms = iter(foreach_norm(kept, ord, dtype=dtype) if kept else ())
    local = [next(norms) if has else _empty_piece_norm(t, ord, dtype)
             for t, has in zip(tensors, has_norm)]
    return complete_norms(local, [_spec_of(t) for t in tensors], float(ord))


def piece_norm(piece: torch.Tensor, ord_: float, dtype=None) -> torch.Tensor:
    """The vector norm of this rank's piece, as its share of the full tensor's."""
    if piece.numel() == 0 and math.isinf(ord_):
        return _empty_piece_norm(piece, ord_, dtype)
    return torch.linalg.vector_norm(piece, ord_, dtype=dtype)


def _empty_piece_norm(piece: torch.Tensor, ord_, dtype) -> torch.Tensor:
    """What an empty piece adds to a norm: torch has no inf-norm of an empty tensor
    (max of nothing), where the rank's share of the full norm is 0 (inf for -inf)."""
    dtype = dtype or (piece.dtype if piece.is_floating_point() else torch.get_default_dtype())
    fill = math.inf if isinstance(ord_, (int, float)) and ord_ == -math.inf else 0.0
    return torch.full((), fill, dtype=dtype, device=piece.device)


def _arg(args, kwargs, i: int, name: str, default):
    return kwargs.get(name, args[i] if len(args) > i else default)


_LINALG_NORMS = (torch.linalg.norm, torch.linalg.matrix_norm)


def _linalg_norm(func, args, kwargs) -> torch.Tensor:
    """torch.linalg.norm / matrix_norm of a sharded grad: over every element
    (Frobenius; a vector norm of a 1-D piece) completed, other matrix norms
    refused; along dims (rows, a batch of matrices) this rank's, as Tensor.norm."""
    x, spec = args[0], _spec_of(args[0])
    matrix = func is torch.linalg.matrix_norm
    ord_ = _arg(args, kwargs, 1, "ord", "fro" if matrix else None)
    if (x.ndim == 1 and x.numel() == 0 and isinstance(ord_, (int, float)) and math.isinf(ord_)
            and spec is not None and kwargs.get("out") is None):
        local = _empty_piece_norm(x, ord_, kwargs.get("dtype"))
    else:
        local = func(*args, **kwargs)  # torch checks the arguments first
    dim = _arg(args, kwargs, 2, "dim", (-2, -1) if matrix else None)
    every = (x.ndim == 2 and sorted(d % 2 for d in dim) == [0, 1]) if matrix else dim is None
    if spec is None or not every or kwargs.get("out") is not None:
        return local
    if ord_ is None or ord_ == "fro":
        return complete_norms([local], [spec], 2.0)[0]
    if x.ndim == 1:  # linalg.norm of a vector: a p-norm
        return complete_norms([local], [spec], float(ord_))[0]
    name = "matrix_norm" if matrix else "norm"
    raise NotImplementedError(
        f"torch.linalg.{name}(grad, ord={ord_!r}) of {spec.name}: a matrix norm of order "
        f"{ord_!r} cannot be completed from the ranks' pieces of a sharded grad (only the "
        "Frobenius norm can). Use ord='fro' for the global Frobenius norm, or take this "
        "norm of the full gradient, p.grad.full_tensor() (a collective)")


_ALIASES = (torch.Tensor.data.__get__, torch.Tensor.detach)  # new tensors on the same piece
# `p.grad = p.grad / accum_steps`, `p.grad + noise`: a new piece of the same sharded grad
_ARITHMETIC = frozenset(getattr(owner, name) for owner in (torch.Tensor, torch)
                        for name in ("add", "sub", "mul", "div", "neg", "__add__", "__radd__",
                                     "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
                                     "__rtruediv__", "__neg__")
                        if hasattr(owner, name))


def _arithmetic(out, args):
    """`out` a ShardedGrad of the spec its sharded operands share, where it is a new
    tensor shaped as they are (an elementwise result): its norms stay global. Not
    clone(): an optimizer's state made by cloning a grad would carry the subclass."""
    grads = [a for a in args if type(a) is ShardedGrad]
    spec = _spec_of(grads[0]) if grads else None
    if (spec is None or type(out) is not torch.Tensor or out.shape != grads[0].shape
            or any(_spec_of(g) is not spec for g in grads)):
        return out
    return _sharded(out, spec)


def _unscale(grads, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's check of this rank's pieces; then found_inf the maximum over
    every group where other pieces (or the model's other experts) lie, so the
    ranks skip the same steps. Plain tensors in `grads` count as this rank's."""
    amp_unscale_(grads, found_inf, inv_scale)
    groups: dict = {}  # first use of each group, in the grads' order (the same on every rank)
    for spec in filter(None, map(_spec_of, grads)):
        for group in spec.flag_groups:
            groups.setdefault(id(group), (group, spec))
    if not groups:
        return
    flag = found_inf.to(next(iter(groups.values()))[1].device())  # the collective's device
    with record_function("FlexShard::found_inf_all_reduce"):
        for group, spec in groups.values():
            spec.comm.all_reduce(flag, group, op=dist.ReduceOp.MAX)
    if flag is not found_inf:
        found_inf.copy_(flag)


def _spec_of(tensor) -> Optional[NormGroups]:
    return getattr(tensor, "__dict__", {}).get(_SPEC)


def complete_norms(local: list, specs: Sequence[Optional[NormGroups]], ord_: float,
                   agreed: bool = False) -> list:
    """Each local norm of a piece made the full tensor's (None spec: left
    local): per group key, one all-reduce of the stacked p-th powers (max /
    min for +-inf, counts for 0). `agreed`: every rank passes the same grads by
    construction (fs.grad_norms); otherwise a CPU key's grads are checked first."""
    for spec in specs:
        if spec is not None and spec.refusal is not None:
            raise NotImplementedError(spec.refusal)
    by_key: dict = {}
    for i, spec in enumerate(specs):
        if spec is not None and spec.groups:
            by_key.setdefault((tuple(id(g) for g in spec.groups), spec.device()), []).append(i)
    op = _reduce_op(ord_)
    out = list(local)
    with record_function("FlexShard::grad_norm_all_reduce"):
        for (_, device), indices in by_key.items():
            spec = specs[indices[0]]
            if not agreed and spec.agreement is not None and not torch.compiler.is_compiling():
                spec.agreement.check_norms([specs[i].name for i in indices])
            dtype = torch.float64 if any(local[i].dtype == torch.float64 for i in indices) \
                else torch.float32  # at least fp32; a float64 norm keeps its precision
            values = torch.stack([local[i].to(device, dtype) for i in indices])
            values = values if op != dist.ReduceOp.SUM or ord_ == 0 else values.pow(ord_)
            for group in spec.groups:
                spec.comm.all_reduce(values, group, op=op)
            if op == dist.ReduceOp.SUM and ord_ != 0:
                values = values.pow(1.0 / ord_)
            for j, i in enumerate(indices):
                out[i] = values[j].to(local[i].device, local[i].dtype).reshape(local[i].shape)
    return out


def _reduce_op(ord_: float) -> Any:
    if math.isinf(ord_):
        return dist.ReduceOp.MAX if ord_ > 0 else dist.ReduceOp.MIN
    return dist.ReduceOp.SUM


def norm_groups(bucket, index: int, tp_spec, model_group=None, agreement=None) -> NormGroups:
    """Slot `index`'s NormGroups: its bucket's shard group, and the TP mesh dims
    its DTensor param is split over; `model_group`: every rank of the model's mesh;
    `agreement`: the model's RankAgreement."""
    groups = (bucket.group,) if bucket.world_size > 1 else ()
    if tp_spec is not None and tp_spec.sharded_over_tp:
        from torch.distributed.tensor import Shard

        groups += tuple(tp_spec.mesh.get_group(d) for d, pl in enumerate(tp_spec.placements)
                        if isinstance(pl, Shard))
    refusal = None
    if bucket.on_sub_mesh and tp_spec is None:
        refusal = (f"bucket {bucket.name!r} runs on its own mesh, smaller than the model's, "
                   "and its params are plain tensors: the other ranks hold other params "
                   "(other experts) under the same names, so a per-rank total of torch's "
                   "norms would differ across ranks. Use fs.clip_grad_norm_(model, max_norm) "
                   "for clipping, fs.grad_norms(model) for logging")
    # Replicas hold equal pieces (HSDP's all-reduce); experts on a smaller mesh differ.
    flags = groups + ((model_group,) if bucket.on_sub_mesh and model_group is not None else ())
    return NormGroups(groups, bucket.comm, lambda: bucket.compute_device, refusal,
                      functools.partial(_full_grad, bucket, index, tp_spec), flags,
                      f"param {bucket.slots[index].fqn!r} (bucket {bucket.name!r})", agreement)


def _full_grad(bucket, index: int, tp_spec, piece: torch.Tensor) -> torch.Tensor:
    """Slot `index`'s full grad from this rank's `piece` (gathered as fs.full_grads does)."""
    pieces = [None] * len(bucket.slots)
    pieces[index] = piece
    full = bucket.gather.gather_pieces(pieces)[index]
    return full if tp_spec is None else tp_spec.full_of(full)
