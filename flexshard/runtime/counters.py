"""What a bucket moved and copied: the counters tests, describe() and the
benchmarks read."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class BucketCounters:
    """Bytes a bucket moved and copied, since the counters were last reset."""

    gathers: int = 0
    reduces: int = 0
    prefetches: int = 0  # gathers launched ahead of use (counted in gathers too)
    discarded_prefetches: int = 0  # prefetched gathers dropped unused
    gather_wire_bytes: int = 0
    gather_ideal_bytes: int = 0
    reduce_wire_bytes: int = 0
    reduce_ideal_bytes: int = 0
    all_reduces: int = 0  # HSDP: all-reduces of reduced shards across the replicate group
    all_reduce_bytes: int = 0
    post_forward_gathers: int = 0  # int reshard: gathers within a post-forward group (in gathers)
    copy_in_bytes: int = 0
    copy_out_bytes: int = 0
    h2d_bytes: int = 0  # CPU offload: storage bytes staged to the compute device
    d2h_bytes: int = 0  # CPU offload: sharded grad bytes copied back to host memory

    def reset(self) -> None:
        """Every counter back to 0, in place (the gather and the gradient path share it)."""
        for f in fields(self):
            setattr(self, f.name, f.default)
