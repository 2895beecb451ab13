"""Wire formats (placements/contract.py, WireFormat) and the policies that pick one per param.

`Cast` is the default: a parameter's piece as it is, or cast to the gather
dtype (MixedPrecisionPolicy.param_dtype). One part, split as the parameter is,
so the gathered part is the unsharded parameter (a view of the gathered buffer
where the layout allows: zero copy). A `WirePolicy` in
`MixedPrecisionPolicy(gather_format=...)` picks another format for some params
of a bucket (quantized gathers)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .contract import Placement, WireFormat, WirePart


@dataclass(frozen=True)
class Cast(WireFormat):
    """Gather a parameter in `dtype` (its own, or the policy's param_dtype)."""

    dtype: torch.dtype

    def parts(self, shape: torch.Size, placement: Placement, world_size: int) -> tuple:
        return (WirePart(torch.Size(shape), self.dtype, placement),)

    def encode(self, piece: torch.Tensor, outs: Sequence[torch.Tensor], mesh=None) -> None:
        outs[0].copy_(piece)

    def decode(self, fulls: Sequence[torch.Tensor], meta=None) -> torch.Tensor:
        return fulls[0]


class WirePolicy(abc.ABC):
    """Picks each parameter's wire format in a bucket (a frozen value, the same on every rank)."""

    @abc.abstractmethod
    def format(self, fqn: str, shape: torch.Size, dtype: torch.dtype,
               gather_dtype: torch.dtype, placement: Placement,
               world_size: int) -> Optional[WireFormat]:
        """The format parameter `fqn` (of `dtype`, gathered as `gather_dtype`
        without this policy, split by bound `placement` over `world_size`
        ranks) is sent in; None for the default `Cast(gather_dtype)`."""
