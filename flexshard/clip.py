"""Gradient clipping over sharded gradients: one all-reduce for the global norm."""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from .runtime.sharded_grad import piece_norm, plain
from .runtime.state import get_state


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the sharded gradients of a flex_shard-ed `module` in place so their
    global `norm_type` norm is at most `max_norm`; returns that norm (before
    clipping), the same on every rank. Like torch.nn.utils.clip_grad_norm_ on
    the unsharded model, with one all-reduce. norm_type: any p > 0 or inf."""
    max_norm, norm_type = _check_clip_args(max_norm, norm_type)
    state = get_state(module)
    grads = _grads_by_group(state)
    device = state.buckets[0].compute_device  # CPU offload: some grads are in host memory
    with record_function("FlexShard::clip_grad_norm_all_reduce"):
        if state.bucket_meshes:
            total = _norm_over_bucket_meshes(state, norm_type, device)
        else:
            total = _global_norm(grads, norm_type, device, state)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                           f"{total.item()}; pass error_if_nonfinite=False to clip anyway")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in (g for part in grads.values() for g in part):
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _check_clip_args(max_norm, norm_type) -> tuple:
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"clip_grad_norm_: {name} must be a number, got {value!r}")
    if max_norm < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or float('inf'), got "
                         f"{norm_type}; use 1, 2 or inf")
    return float(max_norm), float(norm_type)


def _grads_by_group(state) -> dict:
    """The sharded grads keyed by the extra groups their norms sum over: () for
    plain params and TP replicas, the process groups of the mesh dims a DTensor
    param is sharded on (tensor parallel) otherwise. Insertion order is the
    buckets' order, the same on every rank."""
    out: dict = {(): []}
    for b in state.buckets:
        for p, spec in zip(b.params, (w.tp for w in b.wiring)):
            if p.grad is not None:
                out.setdefault(_tp_groups(spec), []).append(plain(p.grad))  # local norms
    return out


def _tp_groups(spec) -> tuple:
    if spec is None or not spec.sharded_over_tp:
        return ()
    from torch.distributed.tensor import Shard

    return tuple(spec.mesh.get_group(d) for d, pl in enumerate(spec.placements)
                 if isinstance(pl, Shard))


def _global_norm(grads: dict, norm_type: float, device, state) -> torch.Tensor:
    """The norm over every rank's pieces: local p-th power sums (or max) per
    group key, one all-reduce over the shard group, one more per TP group."""
    inf = math.isinf(norm_type)
    parts = [_local_part(g, norm_type, device) for g in grads.values()]
    local, op = torch.cat(parts), dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    if state.world_size > 1:  # the shard group: under HSDP the replicas hold the same pieces
        state.comm.all_reduce(local, state.group, op=op)
    for i, groups in enumerate(grads):
        for group in groups:  # sum (max) the TP pieces over each mesh dim they split on
            part = local[i:i + 1].clone()
            state.comm.all_reduce(part, group, op=op)
            local[i] = part[0]
    total = local.max() if inf else local.sum()
    return total if inf else total.pow(1.0 / norm_type)


def _local_part(grads: list, norm_type: float, device) -> torch.Tensor:
    if not grads:
        return torch.zeros(1, device=device)
    norms = torch.stack([piece_norm(g, norm_type, torch.float32).to(device) for g in grads])
    return norms.max().reshape(1) if math.isinf(norm_type) else norms.pow(norm_type).sum().reshape(1)


def _norm_over_bucket_meshes(state, norm_type: float, device) -> torch.Tensor:
    """The norm when buckets run on their own meshes: every rank adds its pieces,
    each bucket's weighted 1/(its replicas), and one all-reduce over the model's
    whole mesh counts every piece once (ranks outside a bucket's mesh hold other
    params: other experts). The inf-norm needs no weights."""
    inf = math.isinf(norm_type)
    local = torch.zeros(1, device=device)
    for bucket in state.buckets:
        grads = [plain(p.grad) for p in bucket.params if p.grad is not None and p.grad.numel()]
        if not grads:
            continue
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device)
                             for g in grads])
        if inf:
            local = torch.maximum(local, norms.max().reshape(1))
        else:
            local += norms.pow(norm_type).sum() / bucket.replicate_size
    if state.mesh_size > 1:
        state.comm.all_reduce(local, state.mesh_group,
                              op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    return local[0] if inf else local[0].pow(1.0 / norm_type)
