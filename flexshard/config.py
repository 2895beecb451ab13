"""Typed options users build: BucketSpec, MixedPrecisionPolicy and OffloadPolicy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .placements.contract import Placement
from .placements.wire import WirePolicy

PlacementChoice = Union[Placement, Callable[[str, torch.nn.Parameter], Placement]]


def _check_float_dtype(field: str, dtype: Optional[torch.dtype]) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"MixedPrecisionPolicy.{field} must be a torch.dtype or None, got {dtype!r}"
        )
    if not dtype.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy.{field}={dtype} is not a floating-point dtype; "
            "use torch.float32, torch.bfloat16 or torch.float16 (or None to keep the parameter dtype)"
        )


def check_reshard(value, where: str = "", allowed: str = "a bool or an int") -> None:
    """reshard_after_forward is True, False or an int N >= 1 (N ranks per
    post-forward group; whether N divides the shard group is checked when the
    bucket's mesh is known)."""
    if isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise TypeError(f"{where}reshard_after_forward must be {allowed}, got {value!r}")
    if value < 1:
        raise ValueError(f"{where}reshard_after_forward={value}: an int is the number of ranks "
                         "to reshard to after forward and must be >= 1; pass a divisor of the "
                         "shard group's size, True or False")


def _is_mesh(value) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(value, DeviceMesh)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed-precision knobs, with the same names and meanings.

    param_dtype: dtype of unsharded parameters (and of the gather on the wire).
    reduce_dtype: dtype of the gradient reduction; None means param_dtype.
    output_dtype: dtype the hooked module's floating outputs are cast to.
    cast_forward_inputs: cast floating forward inputs to param_dtype.
    gather_format: a `fs.WirePolicy` choosing how some params travel in the
        all-gather (quantized gathers); None sends every param in param_dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    gather_format: Optional[WirePolicy] = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_float_dtype(field, getattr(self, field))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, "
                            f"got {self.cast_forward_inputs!r}")
        if self.gather_format is not None and not isinstance(self.gather_format, WirePolicy):
            raise TypeError(f"MixedPrecisionPolicy.gather_format must be a fs.WirePolicy "
                            f"(e.g. fs.QuantizedGather(torch.int8)) or None, "
                            f"got {self.gather_format!r}")


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep a bucket's sharded params, their grads and so the optimizer state
    in CPU memory (FSDP2's CPUOffloadPolicy, per bucket here).

    Each gather first copies this rank's shards to the compute device (the
    device the model's forward runs on: where its params were at flex_shard,
    or where `module.to_empty(device=...)` / `.to(...)` put it); the reduced
    sharded grads are copied back to CPU memory, and the optimizer steps there.
    pin_memory: page-lock the CPU buffers so the copies run asynchronously. It
    applies only when the compute device is a CUDA device; on a CPU compute
    device there is nothing to pin for, and it is ignored (the offload path
    then runs with CPU-to-CPU copies).
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"OffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}")


def check_offload_policy(where: str, policy, allow_false: bool) -> None:
    """`policy` is an OffloadPolicy or None (or False, a BucketSpec's opt-out)."""
    if policy is None or isinstance(policy, OffloadPolicy) or (allow_false and policy is False):
        return
    extra = ", None (inherit) or False (keep this bucket on the compute device)" if allow_false \
        else " or None (no offload)"
    raise TypeError(f"{where}: offload_policy must be a fs.OffloadPolicy{extra}, got "
                    f"{policy!r}; e.g. offload_policy=fs.OffloadPolicy(pin_memory=True)")


@dataclass(frozen=True)
class BucketSpec:
    """One communication bucket: the parameters whose FQNs match `patterns`.

    Fields left None inherit the value given to flex_shard();
    `offload_policy=False` keeps this bucket on the compute device even when
    flex_shard offloads.
    `placement` is a Placement or a callable (fqn, param) -> Placement.
    `reshard_after_forward`: True (free the unsharded params after forward),
    False (keep them until backward) or an int N (keep them sharded over
    groups of N consecutive ranks of the shard group: backward gathers within
    that group only; N must divide the shard group's size).
    `mesh`: a DeviceMesh of the bucket's own (a sub-mesh or flattening of
    flex_shard's mesh, 1-D or 2-D HSDP) its gathers and reductions run on.
    """

    patterns: Union[str, Sequence[str]]
    placement: Optional[PlacementChoice] = None
    mp_policy: Optional[MixedPrecisionPolicy] = None
    reshard_after_forward: Optional[Union[bool, int]] = None
    name: Optional[str] = None
    mesh: Optional[Any] = None  # DeviceMesh: this bucket's own (1-D or 2-D HSDP) mesh
    offload_policy: Union[OffloadPolicy, None, bool] = None  # False: never offload this bucket

    def __post_init__(self) -> None:
        patterns = (self.patterns,) if isinstance(self.patterns, str) else tuple(self.patterns)
        label = self.name or repr(self.patterns)
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise TypeError(f"BucketSpec {self.patterns!r}: name {self.name!r} is not a "
                            "non-empty string; pass a str such as 'layers.0', or None")
        if not patterns:
            raise ValueError(
                f"BucketSpec {label}: patterns is empty; give at least one fnmatch pattern "
                "such as 'layers.0.*'"
            )
        for p in patterns:
            if not isinstance(p, str) or not p:
                raise TypeError(
                    f"BucketSpec {label}: pattern {p!r} is not a non-empty string; "
                    "patterns are fnmatch strings matched against parameter FQNs"
                )
        object.__setattr__(self, "patterns", patterns)
        if self.placement is not None and not (
            isinstance(self.placement, Placement) or callable(self.placement)
        ):
            raise TypeError(
                f"BucketSpec {label}: placement {self.placement!r} is not a Placement "
                "or a callable (fqn, param) -> Placement; use e.g. fs.Shard(0)"
            )
        if self.reshard_after_forward is not None:
            check_reshard(self.reshard_after_forward, f"BucketSpec {label}: ",
                          "a bool, an int or None (inherit)")
        if self.mesh is not None and not _is_mesh(self.mesh):
            raise TypeError(f"BucketSpec {label}: mesh must be a DeviceMesh or None (inherit "
                            f"flex_shard's), got {type(self.mesh).__name__}")
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError(
                f"BucketSpec {label}: mp_policy must be a fs.MixedPrecisionPolicy, got {self.mp_policy!r}"
            )
        check_offload_policy(f"BucketSpec {label}", self.offload_policy, allow_false=True)

    @property
    def label(self) -> str:
        """The bucket's name, or its patterns when it has none."""
        return self.name or ",".join(self.patterns)
