"""Ranks that disagree fail fast: every rank's bucket plan is reduced to a
fingerprint and compared across ranks before any bucket is built.

Ranks whose plans differ (a model built with rank-dependent sizes, different
bucket patterns, a placement callable that looks at the rank, ...) would
otherwise hang in a collective of mismatched size or train silently wrong.

Agreement costs one small collective: an all-reduce MAX of the plan digest and
its negation, which come back equal iff every rank has the same digest. Only
on a mismatch, two more small collectives let every rank say what differs:
an all-gather of one digest per bucket and field (finds the first differing
bucket and field, and which ranks agree) and an all-reduce carrying the text
of that field from two ranks that disagree (finds the first differing line).
"""

from __future__ import annotations

import hashlib
import itertools
import re
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from .bucket_plan import wire_formats

_WORDS = 2  # 62-bit words per digest
_ABSENT = -1  # digest of a bucket a rank does not have
_TEXT_BYTES = 4096  # bytes of a field's text sent to explain a mismatch


class BucketFingerprint(NamedTuple):
    """What every rank must agree on about one bucket: per field, lines of text
    (one line per parameter for per-parameter fields)."""

    name: tuple
    parameters: tuple
    shapes: tuple
    dtypes: tuple
    trainable: tuple
    placements: tuple
    local_shapes: tuple
    reshard_after_forward: tuple
    mp_policy: tuple
    wire_formats: tuple  # each param's, as its policy chose it on this rank
    mesh_shape: tuple  # (replicas, shard size) of the bucket's mesh


_FIELDS = BucketFingerprint._fields


def _text(value) -> str:
    """repr without object addresses, so equal values read the same on every rank."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def bucket_fingerprint(name: str, slots: Sequence, trainable: Sequence[bool],
                       reshard_after_forward, mp_policy,
                       mesh_shape: tuple = (1, 1)) -> BucketFingerprint:
    """The fingerprint of one planned bucket (slots are layout.SlotPlan)."""

    def per_param(values) -> tuple:
        return tuple(f"{s.fqn}: {_text(v)}" for s, v in zip(slots, values))

    return BucketFingerprint(
        name=(name,),
        parameters=tuple(s.fqn for s in slots),
        shapes=per_param(tuple(s.shape) for s in slots),
        dtypes=per_param(s.dtype for s in slots),
        trainable=per_param(trainable),
        placements=per_param(s.placement for s in slots),
        local_shapes=per_param([tuple(x) for x in s.local_shapes] for s in slots),
        reshard_after_forward=(_text(reshard_after_forward),),
        mp_policy=(_text(mp_policy),),
        wire_formats=per_param(wire_formats(slots, mp_policy, mesh_shape[1])),
        mesh_shape=(_text(tuple(mesh_shape)),),
    )


def check_ranks_agree(plan, comm, mesh_groups) -> None:
    """flex_shard's check, after planning and before building any bucket: raise
    on every rank if the ranks planned different buckets (`plan`: plan.WrapPlan).
    `comm` (a runtime Comm, passed in) runs the collectives over `mesh_groups`'
    mesh_group (every rank of the mesh)."""
    prints = [bucket_fingerprint(b.spec.label, b.slots, b.trainable, b.reshard_after_forward,
                                 b.mp_policy, b.mesh_shape)
              for b in plan.buckets]
    # Over the whole mesh: under HSDP the replicas of a shard rank must agree too.
    g = mesh_groups
    check_plans_agree(prints, comm, g.mesh_group, g.mesh_rank, g.mesh_size, _mesh_device(g.mesh))


def _mesh_device(mesh) -> torch.device:
    """Where the mesh's collectives take tensors (the current GPU for a GPU mesh)."""
    if mesh is None or mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type,
                        torch.get_device_module(mesh.device_type).current_device())


def _digest(lines: Sequence[str]) -> list:
    """_WORDS non-negative 62-bit integers hashing `lines` (negation cannot overflow)."""
    raw = hashlib.blake2b("\n".join(lines).encode(), digest_size=8 * _WORDS).digest()
    return [int.from_bytes(raw[8 * i:8 * i + 8], "little") >> 2 for i in range(_WORDS)]


def _plan_digest(plan: Sequence[BucketFingerprint]) -> list:
    return _digest([repr(tuple(b)) for b in plan]) + [len(plan)]


def check_plans_agree(plan: Sequence[BucketFingerprint], comm, group, rank: int,
                      world_size: int, device: torch.device) -> None:
    """Raise ValueError on every rank if the ranks' plans differ; a no-op at world size 1."""
    if world_size == 1:
        return
    mine = torch.tensor(_plan_digest(plan), dtype=torch.int64, device=device)
    both = torch.cat([mine, -mine])
    comm.all_reduce(both, group, op=dist.ReduceOp.MAX)
    highest, lowest = both[:mine.numel()], -both[mine.numel():]
    if torch.equal(highest, lowest):
        return
    table = _gather_field_digests(plan, int(highest[-1]), comm, group, world_size, device)
    bucket, field = _first_difference(table)
    column = table[:, bucket, field]
    same = [r for r in range(world_size) if torch.equal(column[r], column[rank])]
    refs = (0, next(r for r in range(world_size) if not torch.equal(column[r], column[0])))
    texts = _share_texts(_lines(plan, bucket, field), rank, refs, comm, group, device)
    other = refs[1] if refs[0] in same else refs[0]
    raise ValueError(_describe(plan, bucket, field, rank, same, other, texts[refs.index(other)]))


def _field_digests(plan: Sequence[BucketFingerprint], rows: int) -> torch.Tensor:
    """[rows, fields, words] digests; rows past this rank's buckets are _ABSENT."""
    table = torch.full((rows, len(_FIELDS), _WORDS), _ABSENT, dtype=torch.int64)
    for b, bucket in enumerate(plan):
        table[b] = torch.tensor([_digest(lines) for lines in bucket], dtype=torch.int64)
    return table


def _gather_field_digests(plan, rows: int, comm, group, world_size: int,
                          device) -> torch.Tensor:
    """Every rank's field digests: [world_size, rows, fields, words] (on the CPU)."""
    mine = _field_digests(plan, rows).to(device)
    out = torch.empty((world_size, *mine.shape), dtype=torch.int64, device=device)
    comm.all_gather(out.view(-1).view(torch.uint8), mine.view(-1).view(torch.uint8), group)
    return out.cpu()


def _first_difference(table: torch.Tensor) -> tuple:
    """(bucket, field) of the first entry whose digest is not the same on every rank."""
    differs = (table != table[:1]).any(dim=-1).any(dim=0)  # [rows, fields]
    if not differs.any():
        raise AssertionError("plan digests differ but no bucket field does")
    bucket = int(differs.any(dim=1).int().argmax())
    return bucket, int(differs[bucket].int().argmax())


def _lines(plan: Sequence[BucketFingerprint], bucket: int, field: int) -> tuple:
    if bucket >= len(plan):
        return (f"(no bucket {bucket}: {len(plan)} buckets in all)",)
    return plan[bucket][field]


def _share_texts(lines, rank: int, refs: tuple, comm, group, device) -> list:
    """The texts of ranks refs[0] and refs[1] (each cut at _TEXT_BYTES), on every rank."""
    buf = torch.zeros((len(refs), _TEXT_BYTES), dtype=torch.int32)
    raw = "\n".join(lines).encode()[:_TEXT_BYTES]
    for i, ref in enumerate(refs):
        if ref == rank:
            buf[i, :len(raw)] = torch.tensor(list(raw), dtype=torch.int32)
    buf = buf.to(device)
    comm.all_reduce(buf, group, op=dist.ReduceOp.SUM)  # one sender per row
    return [bytes(row[row != 0].tolist()).decode(errors="replace") for row in buf.cpu()]


def _describe(plan, bucket: int, field: int, rank: int, same: list, other: int,
              their_text: str) -> str:
    """Name the bucket, the field and its first differing line."""
    where = (f"{plan[bucket].name[0]!r} on rank {rank}" if bucket < len(plan)
             else f"absent on rank {rank}")
    mine = "\n".join(_lines(plan, bucket, field)).encode()[:_TEXT_BYTES].decode(errors="replace")
    pairs = itertools.zip_longest(mine.split("\n"), their_text.split("\n"), fillvalue="(nothing)")
    first = next(((a, b) for a, b in pairs if a != b), None)
    detail = (f"rank {rank} has {first[0]!r} where rank {other} has {first[1]!r}" if first
              else f"the first difference lies past the first {_TEXT_BYTES} bytes")
    return (f"flex_shard: the ranks' bucket plans differ at bucket {bucket} ({where}): field "
            f"{_FIELDS[field]!r} differs: {detail}. Rank(s) {same} agree with rank "
            f"{rank}. Every rank must wrap the same model with the same buckets, placements "
            "and policies; look for rank-dependent model sizes or arguments")
