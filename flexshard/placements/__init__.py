"""Placements: how each parameter is split across ranks."""

from .contract import Placement
from .shard import Shard

__all__ = ["Placement", "Shard"]
