"""The `--flex_shard.*` section of the torchtitan command line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import flexshard as fs

PlacementName = Literal["shard", "owned", "ragged"]


@dataclass(kw_only=True, slots=True)
class FlexShardConfig:
    """How flex_shard splits each parameter over the data-parallel ranks."""

    placement: PlacementName = "shard"
    """shard: Shard(0) on every parameter, as FSDP2. owned: each parameter whole on
    one rank, owners balanced by bytes (whole-matrix optimizers such as Muon).
    ragged: RaggedShard rows, balanced to within one row (no padding)."""

    def build_placement(self) -> fs.Placement:
        """The placement this config names."""
        if self.placement == "shard":
            return fs.Shard(0)
        if self.placement == "owned":
            return fs.Owned()
        if self.placement == "ragged":
            return fs.RaggedShard()
        raise ValueError(f"--flex_shard.placement={self.placement!r}: choose one of "
                         "'shard', 'owned', 'ragged'")
