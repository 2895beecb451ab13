"""Halo exchange: the boundary rows each rank needs from its neighbours, with autograd.

A graph (or grid) whose nodes are partitioned over a model group in contiguous,
possibly uneven blocks (`sizes[r]` nodes on rank r) computes each node from its
neighbours; a neighbour on another rank is a *halo* row. `HaloPlan` is built once
from the graph: which of its rows each rank sends to which rank, and how many it
receives from each. `halo_exchange(x, plan)` then moves the rows in one
all-to-all per call; its backward sends the halo rows' gradients back and adds
them at the rows they came from (a row sent to several ranks sums their grads).

Received rows come rank by rank, in increasing global node id within a rank, so
`torch.cat([x, halo])` holds the local rows then the halo, and
`plan.local_index(ids)` maps global node ids to rows of that concatenation.
"""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple, Optional, Sequence

import torch
from torch.profiler import record_function

from ..runtime.comm import Comm
from .uneven import (_Agreement, _checked, _control_device, _group, _Group, _offsets, _sizes,
                     traced_from_2_13)


class HaloPlan(NamedTuple):
    """Who sends which rows to whom, for one rank; built once, used every step."""

    rank: int
    sizes: tuple  # nodes per rank of the partition
    send_index: tuple  # per destination rank: a LongTensor of local rows to send it
    recv_ids: tuple  # per source rank: a LongTensor of the global ids received from it
    send_rows: torch.Tensor  # send_index concatenated: the rows each exchange picks, in order
    flow: tuple = (0, 0)  # digests of the (source, target, global ids) this rank sends and
    #                       receives: summed over the ranks they match where the plans agree

    @property
    def send_counts(self) -> list:
        return [int(t.numel()) for t in self.send_index]

    @property
    def recv_counts(self) -> list:
        return [int(t.numel()) for t in self.recv_ids]

    @classmethod
    def from_edges(cls, edge_index: torch.Tensor, sizes: Sequence[int], group=None, *,
                   comm: Optional[Comm] = None, check: bool = True) -> "HaloPlan":
        """The plan of a graph: `edge_index` (2, E) holds global node ids, row 0
        the sources and row 1 the targets of messages, the same on every rank;
        rank r owns nodes sum(sizes[:r]) .. sum(sizes[:r+1]) - 1 and needs every
        remote source of an edge into one of its nodes. No collective, except
        the one check (skipped by `check=False`) that every rank has the same
        sizes and edges."""
        name = "HaloPlan.from_edges"
        g = _group(name, group, comm)

        def checked():
            sizes_ = _sizes(name, sizes, g, what=": the nodes each rank owns")
            edges = _check_edges(edge_index, sum(sizes_))
            return (sizes_, edges), _Agreement({"sizes": sizes_, "edges": (
                edges.shape[1], _checksum(edges))}, (1,), hint=_WHOLE_GRAPH)

        (sizes, edges), _ = _checked(name, g, torch.empty(0, dtype=torch.long,
                                                      device=_control_device(g)), checked, check)
        owner = torch.bucketize(edges, torch.tensor(_offsets(sizes)[1:]), right=True)
        start = _offsets(sizes)[g.rank]
        send = tuple(_needed(edges, owner, g.rank, dst) - start for dst in range(g.size))
        recv = tuple(_needed(edges, owner, src, g.rank) for src in range(g.size))
        return cls(g.rank, sizes, send, recv, torch.cat(send), _flow(g.rank, send, start, recv))

    @classmethod
    def from_send_index(cls, send_index: Sequence[Sequence[int]], sizes: Sequence[int],
                        group=None, *, comm: Optional[Comm] = None) -> "HaloPlan":
        """The plan from explicit lists: `send_index[j]` are the local rows this
        rank sends to rank j (any order; it is kept). One small all-to-all tells
        each rank which global ids it receives, and checks the ranks agree."""
        name = "HaloPlan.from_send_index"
        g = _group(name, group, comm)

        def checked():
            sizes_ = _sizes(name, sizes, g, what=": the nodes each rank owns")
            send_ = _check_send_index(send_index, sizes_[g.rank], g.size)
            return (sizes_, send_), _Agreement({"sizes": sizes_})

        (sizes, send), _ = _checked(name, g, torch.empty(0, device=_control_device(g)), checked,
                                    True)
        start = _offsets(sizes)[g.rank]
        recv = tuple(_exchange_ids([t + start for t in send], g))
        return cls(g.rank, sizes, send, recv, torch.cat(send), _flow(g.rank, send, start, recv))

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `torch.cat([x, halo])` holding the global node `ids` (each
        one this rank's own or received); ValueError naming an id it lacks."""
        start, own = _offsets(self.sizes)[self.rank], self.sizes[self.rank]
        halo = torch.cat(self.recv_ids)
        table = torch.full((sum(self.sizes),), -1, dtype=torch.long)
        table[start:start + own] = torch.arange(own)
        table[halo] = own + torch.arange(halo.numel())
        ids = torch.as_tensor(ids, dtype=torch.long)
        inside = (ids >= 0) & (ids < table.numel())
        rows = torch.where(inside, table[ids.clamp(0, table.numel() - 1)], -1)
        if (rows < 0).any():
            missing = ids[rows < 0][:5].tolist()
            raise ValueError(f"HaloPlan.local_index: node ids {missing} are neither rank "
                             f"{self.rank}'s nor in its halo; build the plan from the edges "
                             "that use them")
        return rows


@traced_from_2_13
def halo_exchange(x: torch.Tensor, plan: HaloPlan, group=None, *, comm: Optional[Comm] = None,
                  include_local: bool = False, check_sizes: bool = True) -> torch.Tensor:
    """The halo rows `plan` says this rank receives (rank by rank), from each
    sender's `x` (its own rows along dim 0); differentiable: the backward adds
    each halo row's gradient at the row it was sent from. One all-to-all, after
    the ranks' agreement on the plan's sizes, x's other dims and dtype (one small
    all-gather, as the other collectives' `check_sizes`; False skips it).

    `include_local=True` returns `torch.cat([x, halo])` (the rows `plan.local_index`
    numbers) built in one buffer: the halo is received in place, and the backward
    adds the halo's gradients into x's slice of the output's gradient instead of
    returning a second, mostly zero, gradient for x."""
    name = "halo_exchange"
    if not isinstance(check_sizes, bool):
        raise TypeError(f"halo_exchange: check_sizes must be a bool, got {check_sizes!r}")
    g = _group(name, group, comm)

    def checked():  # x is a tensor here (_checked); a bad x or plan raises on every rank
        if not isinstance(plan, HaloPlan):
            raise TypeError(f"halo_exchange: plan must be a HaloPlan, got {type(plan).__name__}")
        if plan.rank != g.rank or len(plan.sizes) != g.size:
            raise ValueError(f"halo_exchange: the plan was built for rank {plan.rank} of "
                             f"{len(plan.sizes)} ranks, and this is rank {g.rank} of the "
                             f"{g.size} of the group given; pass the group the plan was built on")
        if x.dim() == 0 or x.shape[0] != plan.sizes[g.rank]:
            raise ValueError(f"halo_exchange: x has {x.shape[0] if x.dim() else 0} rows on rank "
                             f"{g.rank} but the plan gives it {plan.sizes[g.rank]} nodes; pass "
                             "this rank's own rows (dim 0) of the partition the plan was built on")
        return None, _Agreement({"sizes": plan.sizes}, (0,), plan.flow)

    _, x = _checked(name, g, x, checked, check_sizes)
    return _Halo.apply(x, plan, g, bool(include_local))


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: HaloPlan, g: _Group, include_local: bool):
        ctx.args = (plan, g, x.shape[0], include_local)
        local = x.shape[0] if include_local else 0
        out = x.new_empty((local + sum(plan.recv_counts), *x.shape[1:]))
        if local:
            out[:local].copy_(x)
        index = plan.send_rows.to(x.device)  # a no-op where x lives on the host
        _move(x.index_select(0, index), out[local:], plan.send_counts, plan.recv_counts, g)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _HaloGrad.apply(grad, *ctx.args), None, None, None


class _HaloGrad(torch.autograd.Function):
    """The exchange's adjoint: the halo rows' gradients sent back and added at
    the rows they came from. Linear, so its own adjoint is the exchange: a
    second backward (create_graph=True) runs `_Halo` again."""

    @staticmethod
    def forward(ctx, grad: torch.Tensor, plan: HaloPlan, g: _Group, rows: int,
                include_local: bool):
        ctx.args = (plan, g, include_local)
        local = rows if include_local else 0
        back = grad.new_empty((sum(plan.send_counts), *grad.shape[1:]))
        _move(grad[local:].contiguous(), back, plan.recv_counts, plan.send_counts, g)
        index = plan.send_rows.to(grad.device)
        out = grad[:rows].clone() if include_local else grad.new_zeros((rows, *grad.shape[1:]))
        return out.index_add_(0, index, back)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _Halo.apply(grad, *ctx.args), None, None, None, None


def _move(rows: torch.Tensor, out: torch.Tensor, send: list, recv: list, g: _Group) -> None:
    """Rows in destination order -> `out` (contiguous), the received rows in source
    order: one all-to-all."""
    if g.size == 1:
        out.copy_(rows)
        return
    width = math.prod(rows.shape[1:])
    with record_function("FlexShard::halo_exchange"):
        g.comm.all_to_all(out.view(-1), rows.reshape(-1), [n * width for n in recv],
                          [n * width for n in send], g.group)


def _needed(edges: torch.Tensor, owner: torch.Tensor, src: int, dst: int) -> torch.Tensor:
    """Sorted global ids of rank `src`'s nodes that rank `dst` needs (none if src == dst)."""
    if src == dst:
        return torch.empty(0, dtype=torch.long)
    used = (owner[0] == src) & (owner[1] == dst)
    return torch.unique(edges[0][used])


_WHOLE_GRAPH = ("every rank must pass the same sizes and the whole graph's edge_index (each "
                "edge's ids global); a rank that knows only the rows it sends builds its plan "
                "with HaloPlan.from_send_index")


def _flow(rank: int, send: Sequence[torch.Tensor], start: int, recv: Sequence[torch.Tensor]) -> tuple:
    """(digest of what this rank sends, of what it receives): a crc of each
    (source, target, global ids in order), summed over the ranks it pairs with."""
    def crc(src: int, dst: int, ids: torch.Tensor) -> int:
        return zlib.crc32(repr((src, dst, ids.tolist())).encode())
    return (sum(crc(rank, dst, t + start) for dst, t in enumerate(send) if t.numel()),
            sum(crc(src, rank, t) for src, t in enumerate(recv) if t.numel()))


def _checksum(edges: torch.Tensor) -> int:
    """An int that differs between different edge lists (the same in every
    process, unlike hash() of their bytes)."""
    flat = edges.flatten()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.long) * 2654435761 % (1 << 31)
    return int(((flat + 1) * weights).sum())


def _exchange_ids(sent_ids: list, g: _Group) -> list:
    """What each rank receives: the ids every sender sends it (counts, then ids)."""
    if g.size == 1:
        return [torch.empty(0, dtype=torch.long)]
    device = _control_device(g)
    counts = torch.tensor([t.numel() for t in sent_ids], dtype=torch.long, device=device)
    recv_counts = torch.empty_like(counts)
    with record_function("FlexShard::halo_plan"):
        g.comm.all_to_all(recv_counts, counts, [1] * g.size, [1] * g.size, g.group)
        recv = recv_counts.tolist()
        ids = torch.empty(sum(recv), dtype=torch.long, device=device)
        g.comm.all_to_all(ids, torch.cat(sent_ids).to(device), recv, counts.tolist(), g.group)
    return list(ids.cpu().split(recv))


def _check_edges(edge_index, nodes: int) -> torch.Tensor:
    if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 \
            or edge_index.shape[0] != 2 or edge_index.dtype.is_floating_point:
        raise ValueError("HaloPlan.from_edges: edge_index must be an integer tensor of shape "
                         f"(2, E) (sources, targets), got {getattr(edge_index, 'shape', edge_index)}")
    edges = edge_index.long().cpu()
    if edges.numel() and (edges.min() < 0 or edges.max() >= nodes):
        raise ValueError(f"HaloPlan.from_edges: edge_index holds node ids outside 0..{nodes - 1} "
                         f"(the sum of sizes); got ids {edges.min().item()}..{edges.max().item()}")
    return edges


def _check_send_index(send_index, rows: int, world: int) -> tuple:
    if len(send_index) != world:
        raise ValueError(f"HaloPlan.from_send_index: send_index has {len(send_index)} lists, "
                         f"one per rank of the group ({world}) is needed (empty ones included)")
    given = [torch.as_tensor(list(s) if not isinstance(s, torch.Tensor) else s)
             for s in send_index]
    for j, t in enumerate(given):  # a cast would truncate 0.7 to row 0
        if t.is_floating_point() and not torch.equal(t, t.round()):
            raise ValueError(f"HaloPlan.from_send_index: send_index[{j}] holds row numbers that "
                             f"are not whole: {t[t != t.round()][:5].tolist()}; pass ints")
    out = tuple(t.to(torch.long).flatten() for t in given)
    for j, t in enumerate(out):
        if t.numel() and (t.min() < 0 or t.max() >= rows):
            raise ValueError(f"HaloPlan.from_send_index: send_index[{j}] holds rows outside this "
                             f"rank's 0..{rows - 1}: {t[(t < 0) | (t >= rows)][:5].tolist()}")
    return out
