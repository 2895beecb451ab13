"""flexshard: bucketed, placement-pluggable parameter sharding for PyTorch."""

from . import collectives, optim
from .api import FlexShardModule, flex_shard
from .comm import Comm
from .config import BucketSpec, MixedPrecisionPolicy
from .placements import Owned, Placement, RaggedShard, Shard, shard_sizes
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "BucketSpec",
    "Comm",
    "FlexShardModule",
    "MixedPrecisionPolicy",
    "Owned",
    "Placement",
    "RaggedShard",
    "Shard",
    "flex_shard",
    "full_state_dict",
    "collectives",
    "load_full_state_dict",
    "optim",
    "shard_sizes",
]
