"""flexshard: bucketed, placement-pluggable parameter sharding for PyTorch."""

from . import collectives, optim
from .api import FlexShardModule, flex_shard
from .checkpoint import load_checkpoint, save_checkpoint
from .comm import Comm
from .config import BucketSpec, MixedPrecisionPolicy
from .pieces import ShardedPieces
from .placements import Owned, Placement, RaggedShard, Shard, shard_sizes
from .pretrained import PretrainedKeys, load_pretrained
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "BucketSpec",
    "Comm",
    "FlexShardModule",
    "MixedPrecisionPolicy",
    "Owned",
    "Placement",
    "PretrainedKeys",
    "RaggedShard",
    "Shard",
    "ShardedPieces",
    "collectives",
    "flex_shard",
    "full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "load_pretrained",
    "optim",
    "save_checkpoint",
    "shard_sizes",
]
