"""Autograd collectives for activations (public as `fs.collectives`): uneven
shard / gather / reduce-scatter / all-to-all with explicit per-rank sizes
(uneven.py) and the halo exchange of partitioned graphs and grids (halo.py)."""

from .halo import HaloPlan, halo_exchange
from .uneven import (FullGrad, all_reduce_grad, all_to_all, gather_tensor, reduce_scatter_tensor,
                     shard_tensor)

__all__ = ["FullGrad", "HaloPlan", "all_reduce_grad", "all_to_all", "gather_tensor",
           "halo_exchange", "reduce_scatter_tensor", "shard_tensor"]
