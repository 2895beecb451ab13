"""flexshard for torchtitan 0.3.0: `flex_shard` in place of `fully_shard` for its decoders.

Select it the way torchtitan selects its own experiments::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module flexshard.integrations.torchtitan --config flexshard_llama3_debugmodel \\
        --flex_shard.placement owned

`--module` imports `flexshard.integrations.torchtitan.config_registry`,
`--config` names one of its functions.
"""

from .config import FlexShardConfig
from .parallelize import llama_buckets, parallelize_decoder, parallelize_llama
from .pipeline import FlexShardStage, pipeline_decoder

__all__ = ["FlexShardConfig", "FlexShardStage", "llama_buckets", "parallelize_decoder",
           "parallelize_llama", "pipeline_decoder"]
