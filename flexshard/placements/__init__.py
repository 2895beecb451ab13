"""Placements: how each parameter is split across ranks."""

from .contract import Placement
from .owned import Owned
from .ragged import RaggedShard, shard_sizes
from .shard import Shard

__all__ = ["Owned", "Placement", "RaggedShard", "Shard", "shard_sizes"]
