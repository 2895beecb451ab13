"""A bucket's unsharded params, made once per gather layout and refilled in place.

FSDP2's design: the gather output, the fused copy-out's buffers (planning/fused.py),
a quantized gather's decode buffer (placements/quantized.py, `decodes_into`) and
the unsharded params as views of them are made on the bucket's first gather
and kept. Each gather writes into them; resharding frees their storages
(`resize_(0)`: the tensors, and every view of them autograd saved, stay) and the
next gather reallocates them. No view is made per gather.

So resharding after forward needs no saved-tensor hooks: autograd keeps what it
saved, over freed storage, and a hook on the block's forward outputs refills it
before the block's backward runs (runtime/hooks.py). Autograd's version check
does not see the refill: the copy-out writes under `preserve_versions`, and the
gather output's version is set back once its collective is waited for. Each
grad-enabled forward that backward may reach is a `Forward` here (the sharded
storage version it gathered, held by its graph's unshard node): backward refills
the version a forward needs or refuses a stale one, and the storages are freed
once no forward awaiting backward needs them.

Any other format's param is made by its first decode and renewed by each later
one (`WireFormat.refill`): a tensor subclass's (torchao's float8 weight) over the
gather output through FSDP2's fsdp_post_all_gather(out=), any other decoded anew
and copied into the first one's tensor. So every resharding bucket refills params
made once; a bucket that keeps its params until backward gathers new tensors,
which autograd frees once unneeded (runtime/gather.py, in_place).

`PostForwardShard`: under an int reshard_after_forward N (FSDP2's "reshard to a
smaller group"), what a rank keeps of a bucket's forward gather for backward.
The shard group's S ranks form S/N post-forward groups of N consecutive ranks.
Rank r, index i = r mod N in its group, keeps segments i*S/N .. (i+1)*S/N - 1
of each gather group's block of the gather output; the group's all-gather of
those slices, rank-major per gather group, is the whole gather output again, so
backward's regather stays within N ranks.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Optional

import torch

from ..compat import preserve_versions, tensor_version
from ..planning.bucket_plan import LayoutPlans
from ..planning.layout import BucketLayout
from .comm import group_parts
from .wires import column_copies, column_full, split_views


class Forward:
    """One grad-enabled forward of a bucket: the params made once it gathered into
    and the version of the sharded storage it gathered (its backward needs those)."""

    __slots__ = ("params", "version", "__weakref__")

    def __init__(self, params: "UnshardedParams", version: int) -> None:
        self.params, self.version = params, version


def _runs(plans: LayoutPlans):
    """The fused copy-out of a resharding bucket: params view the gather output
    where the layout keeps views (no padding is pinned past forward)."""
    return (plans.copy_out.beside_views if plans.keeps_views
            else plans.copy_out.every_cast)


def _decoded(plans: LayoutPlans) -> dict:
    """{param index: its batch} of the params whose format decodes into a buffer
    made once (a quantized gather's: placements/quantized.py)."""
    return {i: batch for batch in plans.wires.batches if batch.decodes_into
            for i in batch.members}


def _refilled(plans: LayoutPlans, decoded: dict) -> list:
    """The params of the other formats: made by their first decode, renewed by each
    later one (WireFormat.refill: a tensor subclass's in place, else decoded anew
    and copied into the first one's tensor)."""
    return [i for i, w in enumerate(plans.wires) if not w.cast and i not in decoded]


def _copied(plans: LayoutPlans, columns: dict) -> list:
    """The cast params neither viewing the gather output nor in a fused run: each
    copied by its own copy plan (planning/copyplan.py) into a tensor made once."""
    return [i for i, w in enumerate(plans.wires) if w.cast and w.region not in columns
            and not (plans.keeps_views and w.copies[0].span is not None)]


class UnshardedParams:
    """The gather output, the copy-out buffers and the params over them (see the
    module docstring); made with their storages freed."""

    def __init__(self, layout: BucketLayout, plans: LayoutPlans, world_size: int,
                 device: torch.device, rank: int) -> None:
        self.gathered = torch.empty(layout.wire_bytes, dtype=torch.uint8, device=device)
        # what each gather group's collective writes, made once as the params are, and
        # the gather inputs (this rank's range of each group: several ranges of the output
        # with several groups) with the copy-in's destinations in them, so a gather makes
        # no view of its own (a slice and a split per gather, 5 ops, on every rank whose
        # segment is one range: every Owned bucket)
        self.gathered_parts = group_parts(self.gathered, layout.spans, world_size)
        self.send_parts = self.copy_in_dst = None
        # a format that encodes writes its segment offsets: it gets a segment of its own
        if not plans.same_bytes and not plans.wires.encodes:
            self.send_parts = [part.view(world_size, -1)[rank] for part in self.gathered_parts]
            self.copy_in_dst = split_views(self.gathered, plans.copy_in.in_output)
        runs = _runs(plans)
        self._copies, self._columns = (column_copies(self.gathered, runs, world_size) if runs.runs
                                       else ((), {}))
        columns, decoded = self._columns, _decoded(plans)
        own, self._refilled = _copied(plans, columns), _refilled(plans, decoded)
        self.params = [None if i in decoded or i in own or i in self._refilled else
                       column_full(columns[w.region], w.copies[0].shape) if w.region in columns
                       else w.copies[0].full(self.gathered) for i, w in enumerate(plans.wires)]
        # a tensor of its own per such param, refilled by its copy plan
        copied = [plans.wires[i].copies[0] for i in own]
        self._own = [(plan, torch.empty(plan.shape, dtype=plan.dtype, device=device))
                     for plan in copied]
        for i, (_, out) in zip(own, self._own):
            self.params[i] = out
        # each decoding batch's buffer, its params views of it (refilled by its decode)
        self._wires, self._decodes = plans.wires, []
        for batch in {id(b): b for b in decoded.values()}.values():
            out, views = batch.make_out(plans.wires, device)
            self._decodes.append((batch, out))
            for i, view in zip(batch.members, views):
                self.params[i] = view
        outs = [out for _, out in self._decodes] + [out for _, out in self._own]
        self.copied_bytes = sum(t.numel() * t.element_size() for t in
                                list(columns.values()) + outs)
        # the gather output stays only while a param views it
        self.views_gathered = any(w.region not in columns for i, w in enumerate(plans.wires)
                                  if i not in decoded and i not in own)
        flats = [copy.chunks[0] for copy in self._copies] + outs
        self._versioned = tuple([self.gathered] + flats)
        self._storages = [(t.untyped_storage(), t.untyped_storage().nbytes())
                          for t in self._versioned]
        self.version = None  # the sharded storage version the buffers hold; None: freed
        self.forwards: weakref.WeakSet = weakref.WeakSet()  # awaiting backward
        self.free()

    @property
    def filled(self) -> bool:
        return self.version is not None

    def allocate(self) -> None:
        """Reallocate the gather output: a gather is about to write it, and until
        its copy-out the params hold no version. The copy-out's buffers wait for
        the copy-out (a prefetched gather holds only its output, as a new one would)."""
        self.version = None
        self._allocate(self._storages[:1])

    @staticmethod
    def _allocate(storages) -> None:
        for storage, nbytes in storages:
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)

    def copy_out(self, version: int) -> list:
        """The fused copy-out of the gathered buffer into the params' buffers
        (unseen by autograd's version counters); the buffers now hold `version`."""
        self._allocate(self._storages[1:])
        with preserve_versions(self._versioned):
            for copy in self._copies:
                copy.run()
            for plan, out in self._own:
                plan.full_into(self.gathered, out)
            for batch, out in self._decodes:
                batch.decode(self._wires, self.gathered, self._columns, out)
            self._refill()
        self.version = version
        return list(self.params)

    def _refill(self) -> None:
        """The other formats' params: made by the first decode, renewed after. A
        param over a storage of its own (not the gather output's, not a column's)
        joins the storages freed on reshard and reallocated before each refill."""
        for i in self._refilled:
            wire = self._wires[i]
            fulls = wire.fulls(self.gathered, self._columns)
            if self.params[i] is not None:
                wire.format.refill(fulls, wire.meta, self.params[i])
                continue
            param = self.params[i] = wire.format.decode(fulls, wire.meta)
            known = {storage.data_ptr() for storage, _ in self._storages}
            if type(param) is torch.Tensor and param.untyped_storage().data_ptr() not in known:
                self._versioned += (param,)
                self._storages.append((param.untyped_storage(), param.untyped_storage().nbytes()))

    def free_gathered(self) -> None:
        """Free the gather output once copied out (and an int reshard's slice cut
        from it), unless a param views it."""
        if not self.views_gathered:
            self._storages[0][0].resize_(0)

    def free(self) -> None:
        for storage, _ in self._storages:
            if storage.nbytes():
                storage.resize_(0)
        self.version = None

    def allocated_bytes(self) -> int:
        """Bytes its storages hold now (0 when freed)."""
        return sum(storage.nbytes() for storage, _ in self._storages)

    def awaiting_backward(self) -> bool:
        """Whether a forward whose graph is alive still waits for its backward."""
        return len(self.forwards) > 0


class PostForwardShard(NamedTuple):
    """This rank's 1/N of a forward's gather output, kept for backward."""

    send: torch.Tensor  # its S/N segments of the gather output (gather layout), per group
    group: Any  # the N consecutive shard ranks backward all-gathers within
    version: int  # storage version at forward: a later write makes it stale
    ranks: int  # S/N: how many ranks' segments `send` holds


def keep_slice(gathered: torch.Tensor, layout: BucketLayout, rank: int, n: int, group,
               storage: torch.Tensor) -> PostForwardShard:
    """The slice of `gathered` rank `rank` keeps in its post-forward group of `n`: of
    each gather group's block, the S/N segments of that group's share (one copy)."""
    ranks = layout.world_size // n
    first = (rank % n) * ranks
    parts = [block.view(layout.world_size, -1)[first:first + ranks].reshape(-1)
             for block in group_parts(gathered, layout.spans, layout.world_size)]
    kept = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
    return PostForwardShard(kept, group, tensor_version(storage), ranks)


def usable(shard: Optional[PostForwardShard], storage: torch.Tensor) -> Optional[PostForwardShard]:
    """`shard` while the sharded params are still those it was cut from."""
    if shard is None or shard.version != tensor_version(storage):
        return None
    return shard
