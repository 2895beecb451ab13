"""What flex_shard made of a model: a ShardingPlan of one BucketPlan per
bucket, printable as a table (`describe`)."""

from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

from ..runtime.state import get_state


class BucketPlan(NamedTuple):
    """One bucket as flex_shard built it."""

    name: str
    module: str  # FQN of the module whose forward runs it ('' = root, None = no hooks)
    params: tuple  # FQNs
    shapes: tuple  # full shapes
    placements: tuple  # bound Placement per param
    dtypes: tuple  # storage dtype per param
    gather_dtypes: tuple  # dtype on the wire / of the unsharded param
    local_bytes: tuple  # per rank: bytes of its pieces (no padding)
    unsharded_bytes: int  # bytes of the unsharded params (gather dtype)
    padding_bytes: int  # bytes a gather moves beyond the pieces (alignment, uneven ranks)
    reshard_after_forward: bool
    gathers_per_step: int  # all-gathers in one forward + backward (shard group)
    reduces_per_step: int  # reduce-scatters in one backward (shard group)
    all_reduces_per_step: int = 0  # HSDP: all-reduces of the reduced shards (replicate group)


class ShardingPlan(NamedTuple):
    """describe(model): the buckets in BucketSpec order; str() is a table.
    world_size is the shard group's; under HSDP replicate_size replicas of it."""

    world_size: int
    buckets: tuple
    replicate_size: int = 1

    @property
    def mesh_shape(self) -> tuple:
        """(replicas, shard size): (1, world_size) for a 1-D mesh."""
        return (self.replicate_size, self.world_size)

    @property
    def gathers_per_step(self) -> int:
        return sum(b.gathers_per_step for b in self.buckets)

    @property
    def reduces_per_step(self) -> int:
        return sum(b.reduces_per_step for b in self.buckets)

    @property
    def all_reduces_per_step(self) -> int:
        return sum(b.all_reduces_per_step for b in self.buckets)

    def __str__(self) -> str:
        return _table(self)


def describe(module: nn.Module) -> ShardingPlan:
    """What flex_shard made of `module`: per bucket its module, parameters,
    placements, dtypes, bytes and collectives per training step (one forward
    and one backward through every bucket; a bucket that reshards after forward
    regathers in backward, unless autograd saved none of its params in the last
    forward, as for an embedding's weight)."""
    state = get_state(module)
    names = {id(m): n for n, m in module.named_modules()}
    runners = {id(b): h.module for h in state.hooks for b in h.buckets}
    rows = []
    for bucket in state.buckets:
        runner = runners.get(id(bucket))
        regather = bucket.reshard_after_forward and bucket.saved_in_forward is not False
        rows.append(_bucket_plan(bucket, state.world_size,
                                 None if runner is None else names.get(id(runner), ""), regather))
    return ShardingPlan(state.world_size, tuple(rows), state.replicate_size)


def _bucket_plan(bucket, world_size: int, module_name, regather: bool) -> BucketPlan:
    storage, gather = bucket.storage.layout, bucket.gather_layout
    collective = module_name is not None and world_size > 1
    replicated = module_name is not None and bucket.replicate_group is not None
    return BucketPlan(
        name=bucket.name, module=module_name,
        params=tuple(s.fqn for s in bucket.slots),
        shapes=tuple(tuple(s.shape) for s in bucket.slots),
        placements=tuple(s.placement for s in bucket.slots),
        dtypes=tuple(s.dtype for s in bucket.slots),
        gather_dtypes=tuple(r.dtype for r in gather.regions),
        local_bytes=tuple(sum(r.nbytes[rank] for r in storage.regions) for rank in range(world_size)),
        unsharded_bytes=gather.ideal_bytes,
        padding_bytes=gather.wire_bytes - gather.ideal_bytes,
        reshard_after_forward=bucket.reshard_after_forward,
        gathers_per_step=(1 + regather) if collective else 0,
        reduces_per_step=1 if collective and bucket.grad_slots else 0,
        all_reduces_per_step=1 if replicated and bucket.grad_slots else 0)


_COLUMNS = ("bucket", "module", "params", "dtype", "local bytes/rank", "unsharded", "padding",
            "reshard", "gathers", "reduces")


def _table(plan: ShardingPlan) -> str:
    rows = [_COLUMNS]
    for b in plan.buckets:
        dtypes = ",".join(sorted({str(d).replace("torch.", "") for d in b.gather_dtypes}))
        local = f"{min(b.local_bytes):,}..{max(b.local_bytes):,}"
        module = "-" if b.module is None else (b.module or "<root>")
        rows.append((b.name, module, str(len(b.params)), dtypes, local, f"{b.unsharded_bytes:,}",
                     f"{b.padding_bytes:,}", "yes" if b.reshard_after_forward else "no",
                     str(b.gathers_per_step), str(b.reduces_per_step)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for b in plan.buckets:
        lines.append(f"{b.name}:")
        for fqn, shape, pl, dt in zip(b.params, b.shapes, b.placements, b.dtypes):
            lines.append(f"  {fqn}  {tuple(shape)}  {pl!r}  {str(dt).replace('torch.', '')}")
    lines.append(f"world size {plan.world_size}: {plan.gathers_per_step} all-gathers and "
                 f"{plan.reduces_per_step} reduce-scatters per step")
    if plan.replicate_size > 1:
        lines[-1] = (f"HSDP mesh {plan.mesh_shape} (replicate, shard): per step "
                     f"{plan.gathers_per_step} all-gathers and {plan.reduces_per_step} "
                     f"reduce-scatters within a shard group of {plan.world_size}, "
                     f"{plan.all_reduces_per_step} all-reduces across {plan.replicate_size} "
                     "replicas")
    return "\n".join(lines)
