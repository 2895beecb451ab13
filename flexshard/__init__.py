"""flexshard: bucketed, placement-pluggable parameter sharding for PyTorch."""

from . import collectives, optim
from .api import FlexShardModule, flex_shard
from .checkpoint.files import load_checkpoint, save_checkpoint
from .checkpoint.pieces import ShardedPieces
from .checkpoint.pretrained import PretrainedKeys, load_pretrained
from .checkpoint.optimizer_state import full_optimizer_state_dict
from .checkpoint.state_dict import full_state_dict, load_full_state_dict
from .clip import clip_grad_norm_
from .grads import full_grads, grad_norms
from .config import BucketSpec, MixedPrecisionPolicy, OffloadPolicy
from .placements import (BlockQuantized, Cast, Owned, Placement, QuantizedGather, RaggedShard,
                         Shard, WireFormat, WirePart, WirePolicy, shard_sizes)
from .dry_run.plan_buckets import plan_buckets
from .dry_run.describe import describe
from .planning.report import BucketPlan, ShardingPlan
from .runtime.comm import Comm
from .runtime.gloo import GlooComm
from .whole_step import compile

__all__ = [
    "BlockQuantized",
    "BucketPlan",
    "BucketSpec",
    "Cast",
    "Comm",
    "FlexShardModule",
    "GlooComm",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Owned",
    "Placement",
    "PretrainedKeys",
    "QuantizedGather",
    "RaggedShard",
    "Shard",
    "WireFormat",
    "WirePart",
    "WirePolicy",
    "ShardedPieces",
    "ShardingPlan",
    "clip_grad_norm_",
    "collectives",
    "compile",
    "describe",
    "flex_shard",
    "full_grads",
    "full_optimizer_state_dict",
    "full_state_dict",
    "grad_norms",
    "load_checkpoint",
    "load_full_state_dict",
    "load_pretrained",
    "optim",
    "plan_buckets",
    "save_checkpoint",
    "shard_sizes",
]
