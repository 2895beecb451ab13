"""flexshard: bucketed, placement-pluggable parameter sharding for PyTorch."""

from . import collectives, optim
from .api import FlexShardModule, flex_shard
from .checkpoint import load_checkpoint, save_checkpoint
from .clip import clip_grad_norm_
from .comm import Comm
from .config import BucketSpec, MixedPrecisionPolicy
from .pieces import ShardedPieces
from .placements import Owned, Placement, RaggedShard, Shard, shard_sizes
from .plan import BucketPlan, ShardingPlan, describe, plan_buckets
from .pretrained import PretrainedKeys, load_pretrained
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "BucketPlan",
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
    "ShardingPlan",
    "clip_grad_norm_",
    "collectives",
    "describe",
    "flex_shard",
    "full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "load_pretrained",
    "optim",
    "plan_buckets",
    "save_checkpoint",
    "shard_sizes",
]
