"""Placements: how each parameter is split across ranks."""

from .contract import Placement, WireFormat, WirePart
from .owned import Owned
from .quantized import BlockQuantized, QuantizedGather
from .ragged import RaggedShard, shard_sizes
from .shard import Shard
from .wire import Cast, WirePolicy

__all__ = ["BlockQuantized", "Cast", "Owned", "Placement", "QuantizedGather", "RaggedShard", "Shard", "WireFormat", "WirePart",
           "WirePolicy", "shard_sizes"]
