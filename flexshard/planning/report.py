"""The plan of a sharded model: a ShardingPlan of one BucketPlan per bucket,
printable as a table. Built from a wrapped model (dry_run/describe.py) or, for
a mesh one does not have, by the dry run (planning/dry_run_plan.py); both go through
`bucket_plan`, from the layouts a Bucket uses."""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from ..placements.subclass import SubclassGather
from ..placements.wire import Cast
from .bucket_plan import BucketLayouts


class BucketPlan(NamedTuple):
    """One bucket as flex_shard builds it. Per-rank tuples are over the ranks of
    one shard group (every replica holds the same). Wire bytes are the bytes of
    each collective's buffer, as BucketCounters counts them (padding included):
    an all-gather's output, a reduce-scatter's input, an all-reduce's buffer."""

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
    reshard_after_forward: object  # bool, or int N: backward gathers within N shard ranks
    gathers_per_step: int  # all-gathers in one forward + backward (shard dim)
    regather_ranks: int  # ranks backward's regather spans: S, N for an int reshard, 0 if none
    reduces_per_step: int  # reduce-scatters in one backward (shard dim)
    storage_bytes: tuple  # per rank: its storage buffer (its pieces, aligned; padded to the
    #                       segment unless that is over 1/16 padding: BucketLayout.storage_bytes)
    grad_bytes: tuple  # per rank: its sharded grads (trainable pieces, in the param dtype)
    gather_wire_bytes: int  # per step, shard dim: every all-gather's output
    reduce_wire_bytes: int  # per step, shard dim: the reduce-scatter's input
    all_reduces_per_step: int  # gradient all-reduces in one backward (replicate dim)
    all_reduce_bytes: int  # per step, replicate dim: the all-reduced reduce output (largest rank)
    wire_formats: tuple = ()  # WireFormat per param (Cast: sent as itself, in its gather dtype)
    gather_groups: int = 1  # collectives per gather (launched as one): planning/layout.py
    solo: tuple = ()  # per param: gathered alone, its unsharded param a view of its output
    #                   (a Cast's, where the bucket hands out views)
    copy_out_bytes: int = 0  # per gather: the unsharded params that are no view (copied out)
    all_reduce_rank_bytes: tuple = ()  # per shard rank: all_reduce_bytes of that rank

    @property
    def quantized(self) -> int:
        """Params sent in a format other than a cast (QuantizedGather's)."""
        return sum(not isinstance(f, Cast) for f in self.wire_formats)


class ShardingPlan(NamedTuple):
    """The buckets in BucketSpec order on a (replicate, shard) mesh; str() is a table."""

    world_size: int
    buckets: tuple
    mesh_shape: tuple  # (R, S): R replicas of S-rank shard groups; a 1-D world is (1, S)

    @property
    def replicate_size(self) -> int:
        return self.mesh_shape[0]

    @property
    def shard_size(self) -> int:
        return self.mesh_shape[1]

    @property
    def gathers_per_step(self) -> int:
        return sum(b.gathers_per_step for b in self.buckets)

    @property
    def reduces_per_step(self) -> int:
        return sum(b.reduces_per_step for b in self.buckets)

    @property
    def all_reduces_per_step(self) -> int:
        return sum(b.all_reduces_per_step for b in self.buckets)

    @property
    def param_bytes(self) -> tuple:
        """(min, max) over ranks: bytes of the storage buffers (the sharded params)."""
        return _min_max([b.storage_bytes for b in self.buckets])

    @property
    def grad_bytes(self) -> tuple:
        """(min, max) over ranks: bytes of the sharded grads."""
        return _min_max([b.grad_bytes for b in self.buckets])

    @property
    def adamw_bytes(self) -> tuple:
        """(min, max) over ranks: AdamW's exp_avg and exp_avg_sq, each shaped and
        typed like the sharded param (torch.optim.AdamW's default); the per-param
        `step` scalars (4 bytes each, on the CPU unless capturable/fused) are left out."""
        low, high = self.grad_bytes
        return (2 * low, 2 * high)

    @property
    def shard_wire_bytes(self) -> int:
        """Per step on the shard dim: all-gathers plus reduce-scatters."""
        return sum(b.gather_wire_bytes + b.reduce_wire_bytes for b in self.buckets)

    @property
    def replicate_wire_bytes(self) -> int:
        """Per step on the replicate dim: the gradient all-reduces of the rank that
        all-reduces most (Owned's heaviest rank differs from bucket to bucket, so
        the buckets' own largest ranks summed would overstate every rank)."""
        return _min_max([b.all_reduce_rank_bytes for b in self.buckets])[1]

    def summary(self) -> str:
        """The model's totals: per-rank bytes and collectives per step."""
        return _summary(self)

    def table(self, per_param: bool = True) -> str:
        """One row per bucket, then (with `per_param`) each bucket's parameters, then
        the summary; str() is `table()`."""
        return _table(self, per_param)

    def __str__(self) -> str:
        return _table(self, True)


def bucket_plan(name: str, slots: Sequence, layouts: BucketLayouts, trainable: Sequence[bool],
                reshard: bool, module_name, regather: bool, mesh_shape: tuple) -> BucketPlan:
    """A bucket's record from its bound slots and layouts; `module_name` is None
    when no hook runs it, `regather` whether backward gathers it again."""
    replicas, shards = mesh_shape
    storage, reduce, wire = layouts.storage, layouts.reduce, layouts.wire
    gather = layouts.gather_for(reshard)
    views = gather.hands_out_views(reshard)  # what the gather hands out (else copies)
    hooked, grads = module_name is not None, any(trainable)
    gathers = (1 + bool(regather)) if hooked and shards > 1 else 0
    regather_ranks = 0 if gathers < 2 else (shards if isinstance(reshard, bool) else reshard)
    reduces = 1 if hooked and shards > 1 and grads else 0
    all_reduces = 1 if hooked and replicas > 1 and grads else 0
    return BucketPlan(
        name=name, module=module_name,
        params=tuple(s.fqn for s in slots),
        shapes=tuple(tuple(s.shape) for s in slots),
        placements=tuple(s.placement for s in slots),
        dtypes=tuple(s.dtype for s in slots),
        gather_dtypes=tuple(r.dtype for r in gather.regions),
        local_bytes=tuple(sum(r.nbytes[rank] for r in storage.regions) for rank in range(shards)),
        unsharded_bytes=sum(math.prod(s.shape) * _unsharded_dtype(f, gather.regions[k].dtype).itemsize
                            for s, f, k in zip(slots, wire.formats, wire.first)),
        padding_bytes=gather.wire_bytes - gather.ideal_bytes,
        reshard_after_forward=reshard,
        gathers_per_step=gathers, regather_ranks=regather_ranks, reduces_per_step=reduces,
        storage_bytes=tuple(storage.storage_bytes(rank) for rank in range(shards)),
        grad_bytes=tuple(sum(r.nbytes[rank] for r, t in zip(storage.regions, trainable) if t)
                         for rank in range(shards)),
        gather_wire_bytes=gathers * gather.wire_bytes,
        reduce_wire_bytes=reduces * reduce.wire_bytes,
        all_reduces_per_step=all_reduces,
        all_reduce_bytes=all_reduces * max(reduce.output_bytes(r) for r in range(shards)),
        all_reduce_rank_bytes=tuple(all_reduces * reduce.output_bytes(r) for r in range(shards)),
        wire_formats=wire.formats, gather_groups=len(gather.spans) if shards > 1 else 0,
        solo=tuple(len(gather.spans) > 1 and isinstance(f, Cast) and views
                   and sum(r.group == gather.regions[k].group for r in gather.regions) == 1
                   for f, k in zip(wire.formats, wire.first)),
        copy_out_bytes=_copy_out_bytes(slots, wire, gather, views))


def _copy_out_bytes(slots: Sequence, wire, gather, views: bool) -> int:
    """Per gather: what the params that are no view of the gathered buffer take.
    A Cast param (and a subclass's parts) copies its regions that are no view, or
    every one where the bucket hands out no views (BucketLayout.hands_out_views:
    the root's, a bucket that keeps its params over heavy padding); a param a
    format decodes (QuantizedGather's) is that too (its parts joined whole where
    they are no view), then a new tensor of its decoded bytes."""
    total = 0
    for i, (slot, fmt) in enumerate(zip(slots, wire.formats)):
        decoded = not isinstance(fmt, (Cast, SubclassGather))
        total += sum(sum(gather.regions[k].nbytes) for k in wire.regions(i)
                     if (not views and not decoded) or gather.gathered_range(k) is None)
        if decoded:
            dtype = _unsharded_dtype(fmt, gather.regions[wire.first[i]].dtype)
            total += math.prod(slot.shape) * dtype.itemsize
    return total


def _unsharded_dtype(fmt, first_part: torch.dtype) -> torch.dtype:
    """What a format decodes to: its `out_dtype` (a quantized format), else its first part's."""
    return getattr(fmt, "out_dtype", first_part)


def _min_max(per_bucket: Sequence[tuple]) -> tuple:
    per_rank = [sum(col) for col in zip(*per_bucket)] or [0]
    return (min(per_rank), max(per_rank))


def human(n: int) -> str:
    """Bytes in binary units, three significant digits: '3.74 GiB', '1020 GiB'."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{n} B"


def _span(pair: tuple) -> str:
    low, high = pair
    return human(low) if low == high else f"{human(low)}..{human(high)}"


def _summary(plan: ShardingPlan) -> str:
    replicas, shards = plan.mesh_shape
    gather = sum(b.gather_wire_bytes for b in plan.buckets)
    reduce = sum(b.reduce_wire_bytes for b in plan.buckets)
    in_groups = sum(1 for b in plan.buckets
                    if not isinstance(b.reshard_after_forward, bool) and b.regather_ranks)
    groups = f" ({in_groups} within post-forward groups)" if in_groups else ""
    return "\n".join([
        f"world size {plan.world_size} as mesh (replicate {replicas}, shard {shards}): "
        f"{plan.gathers_per_step} all-gathers{groups} and {plan.reduces_per_step} reduce-scatters "
        f"per step on the shard dim, {plan.all_reduces_per_step} all-reduces on the replicate dim",
        f"per rank: params {_span(plan.param_bytes)}, grads {_span(plan.grad_bytes)}, "
        f"AdamW state {_span(plan.adamw_bytes)}",
        f"wire bytes per step: shard dim {human(plan.shard_wire_bytes)} (all-gather "
        f"{human(gather)}, reduce-scatter {human(reduce)}), replicate dim "
        f"{human(plan.replicate_wire_bytes)} (all-reduce)"])


_COLUMNS = ("bucket", "module", "params", "dtype", "storage/rank (B)", "local/rank (B)",
            "unsharded (B)", "padding (B)", "reshard", "gathers", "reduces", "all-reduces",
            "shard wire (B/step)", "replicate wire (B/step)")  # exact counts: the unit in the header


def _row(b: BucketPlan) -> tuple:
    dtypes = ",".join(sorted({str(d).replace("torch.", "") for d in b.gather_dtypes}))
    local, storage = _range(b.local_bytes), _range(b.storage_bytes)
    module = "-" if b.module is None else (b.module or "<root>")
    params = str(len(b.params)) + (f" ({b.quantized} quantized)" if b.quantized else "")
    return (b.name, module, params, dtypes, storage, local,
            f"{b.unsharded_bytes:,}", f"{b.padding_bytes:,}",
            _reshard_text(b.reshard_after_forward), _gathers_text(b),
            str(b.reduces_per_step), str(b.all_reduces_per_step),
            f"{b.gather_wire_bytes + b.reduce_wire_bytes:,}", f"{b.all_reduce_bytes:,}")


def _range(per_rank: tuple) -> str:
    low, high = min(per_rank), max(per_rank)
    return f"{low:,}" if low == high else f"{low:,}..{high:,}"


def _reshard_text(reshard) -> str:
    if isinstance(reshard, bool):
        return "yes" if reshard else "no"
    return f"to {reshard}"


def _gathers_text(b: BucketPlan) -> str:
    """'2', or '2 (1 in 2 ranks)' when backward regathers within a post-forward group."""
    if isinstance(b.reshard_after_forward, bool) or not b.regather_ranks:
        return str(b.gathers_per_step)
    return f"{b.gathers_per_step} (1 in {b.regather_ranks} ranks)"


def _table(plan: ShardingPlan, per_param: bool) -> str:
    rows = [_COLUMNS] + [_row(b) for b in plan.buckets]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for b in plan.buckets if per_param else ():
        lines.append(f"{b.name}: {b.gather_groups} collective(s) per gather, copy-out "
                     f"{human(b.copy_out_bytes)} per gather")
        formats = b.wire_formats or (None,) * len(b.params)
        solo = b.solo or (False,) * len(b.params)
        for fqn, shape, pl, dt, fmt, alone in zip(b.params, b.shapes, b.placements, b.dtypes,
                                                  formats, solo):
            sent = "" if fmt is None or isinstance(fmt, Cast) else f"  sent as {fmt!r}"
            own = "  gathered alone (a view)" if alone else ""
            lines.append(f"  {fqn}  {tuple(shape)}  {pl!r}  {str(dt).replace('torch.', '')}"
                         f"{sent}{own}")
    lines.append(_summary(plan))
    return "\n".join(lines)
