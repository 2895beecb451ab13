"""Typed options users build: BucketSpec and MixedPrecisionPolicy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from .placements.contract import Placement

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


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed-precision knobs, with the same names and meanings.

    param_dtype: dtype of unsharded parameters (and of the gather on the wire).
    reduce_dtype: dtype of the gradient reduction; None means param_dtype.
    output_dtype: dtype the hooked module's floating outputs are cast to.
    cast_forward_inputs: cast floating forward inputs to param_dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_float_dtype(field, getattr(self, field))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, "
                            f"got {self.cast_forward_inputs!r}")


@dataclass(frozen=True)
class BucketSpec:
    """One communication bucket: the parameters whose FQNs match `patterns`.

    Fields left None inherit the value given to flex_shard().
    `placement` is a Placement or a callable (fqn, param) -> Placement.
    """

    patterns: Union[str, Sequence[str]]
    placement: Optional[PlacementChoice] = None
    mp_policy: Optional[MixedPrecisionPolicy] = None
    reshard_after_forward: Optional[bool] = None
    name: Optional[str] = None

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
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                f"BucketSpec {label}: reshard_after_forward must be a bool or None (inherit), "
                f"got {self.reshard_after_forward!r}"
            )
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError(
                f"BucketSpec {label}: mp_policy must be a fs.MixedPrecisionPolicy, got {self.mp_policy!r}"
            )

    @property
    def label(self) -> str:
        """The bucket's name, or its patterns when it has none."""
        return self.name or ",".join(self.patterns)
