"""flexshard: bucketed, placement-pluggable parameter sharding for PyTorch."""

from .api import FlexShardModule, flex_shard
from .clip import clip_grad_norm_
from .comm import Comm
from .config import BucketSpec, MixedPrecisionPolicy
from .placements import Placement, Shard
from .plan import BucketPlan, ShardingPlan, describe, plan_buckets
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "BucketPlan",
    "BucketSpec",
    "Comm",
    "FlexShardModule",
    "MixedPrecisionPolicy",
    "Placement",
    "Shard",
    "ShardingPlan",
    "clip_grad_norm_",
    "describe",
    "flex_shard",
    "full_state_dict",
    "load_full_state_dict",
    "plan_buckets",
]
