"""The wrap options a user passes (flex_shard's, and describe's dry run of
them), checked before anything is planned."""

from __future__ import annotations

from ..config import BucketSpec, MixedPrecisionPolicy, check_offload_policy, check_reshard
from ..placements.contract import Placement


def check_options(placement, mp_policy, reshard_after_forward, offload_policy=None) -> None:
    """flex_shard's placement, mp_policy, reshard_after_forward and offload_policy arguments."""
    if not isinstance(placement, Placement) and not callable(placement):
        raise TypeError(f"placement {placement!r} is not a Placement or a callable "
                        "(fqn, param) -> Placement; use e.g. fs.Shard(0)")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a fs.MixedPrecisionPolicy, got {mp_policy!r}")
    check_reshard(reshard_after_forward)
    check_offload_policy("flex_shard", offload_policy, allow_false=False)


def resolve_reshard(value, shard_size: int, label: str):
    """A bucket's reshard_after_forward on a shard group of `shard_size` ranks,
    as FSDP2 reads it: an int N must divide the group; N == 1 keeps the params
    (False), N == shard_size frees them (True), else N stays (post-forward
    groups of N ranks)."""
    if isinstance(value, bool):
        return value
    if shard_size % value:
        raise ValueError(f"bucket {label!r}: reshard_after_forward={value} does not divide its "
                         f"shard group of {shard_size} rank(s); pass a divisor of {shard_size} "
                         "(ranks per post-forward group), True to reshard fully or False to "
                         "keep the params unsharded")
    if value == 1:
        return False
    return True if value == shard_size else value


def check_specs(buckets) -> list:
    """flex_shard's `buckets` argument as a list of uniquely named BucketSpecs."""
    if isinstance(buckets, (str, BucketSpec)) or not hasattr(buckets, "__iter__"):
        raise TypeError(f"buckets must be a list of fs.BucketSpec, got {buckets!r}; "
                        "e.g. buckets=[fs.BucketSpec('layers.*')]")
    specs = list(buckets)
    if not specs:
        raise ValueError("buckets is empty; pass buckets=None for one bucket per block, "
                         "or at least one fs.BucketSpec")
    for i, spec in enumerate(specs):
        if not isinstance(spec, BucketSpec):
            raise TypeError(f"buckets[{i}] is {type(spec).__name__}, not a fs.BucketSpec")
    labels = [s.label for s in specs]
    for label in labels:
        if labels.count(label) > 1:
            raise ValueError(f"two buckets are named {label!r}; give each BucketSpec a unique name")
    return specs


def check_params(named: dict, allow_dtensor: bool = False) -> None:
    """The module's parameters (FQN -> tensor) can be sharded; DTensor params
    only where `allow_dtensor` (flex_shard checks them in tensor_parallel.py)."""
    from torch.distributed.tensor import DTensor

    if not named:
        raise ValueError("the module has no parameters to shard")
    for fqn, p in named.items():
        if isinstance(p, DTensor) and not allow_dtensor:
            raise NotImplementedError(
                f"parameter {fqn!r} is a DTensor; this dry run plans plain tensors only: "
                "describe the model before parallelize_module")


def check_modules(module) -> None:
    """Modules whose forward needs the param itself: an embedding with `max_norm`
    renormalises the rows it looks up in its weight in place (a flex_shard forward
    computes with a gathered copy: the write would be dropped, or autograd refuses
    it), one with `sparse=True` makes sparse grads (the reduction packs dense ones)."""
    from torch import nn

    for name, sub in module.named_modules():
        if not isinstance(sub, (nn.Embedding, nn.EmbeddingBag)):
            continue
        what = f"module {name or '(the root)'!r} ({type(sub).__name__})"
        if sub.max_norm is not None:
            raise ValueError(
                f"{what} has max_norm={sub.max_norm}: its forward renormalises the rows it "
                "looks up in its weight in place, and a flex_shard forward computes with a "
                "gathered copy of the weight, so the renormalisation would be lost. Build it "
                "with max_norm=None and clip the looked-up rows in forward instead: "
                f"e * ({sub.max_norm} / e.norm(dim=-1, keepdim=True)).clamp(max=1)")
        if sub.sparse:
            raise ValueError(
                f"{what} has sparse=True: flex_shard reduces dense gradients into each rank's "
                "shard, and cannot pack a sparse one; build it with sparse=False (its "
                "gradient is then dense, as FSDP2 needs too)")
