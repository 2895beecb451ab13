"""Where a bucket's data path runs: collectives on process groups, the device's
streams and events, and autograd's engine. Knows nothing of modules or parameters.

A bucket calls its Comm for every collective, so tests and benchmarks can
inject one that counts, delays or fails them (wrapping the real ones).

`Comm` runs torch.distributed's collectives as they are, on any backend. On
gloo flex_shard takes `GlooComm` (gloo.py) instead, a Comm whose large
gathers and reduces run rooted: chosen from the process group's backend
(`comm_for`), so no other code knows which backend runs.

`hidden_from_checkpoint` keeps these collectives out of selective activation
checkpointing's dispatch modes, which replay ops by call index; `in_backward`
tells a forward from a recompute (or any hook) inside backward.

Streams and events. A bucket runs its data path on side streams ordered by
events (design.md, "Streams and buffers"): the copy-in (cast) before its
all-gather on `copy_in`, the all-gather on `gather`, gradient packing, the
reduce-scatter and the divide/cast of its output on `reduce`. The compute stream
is whatever stream is current when the bucket is called (a forward may run on
any stream), and it only ever waits on events, never on the whole device.
`HostContext` (CPU, meta) runs everything in program order, so its streams are
names and its events are None; `CudaContext` has real streams. Tests subclass
HostContext to record the ordering; the runtime never asks which one it has.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..compat import (SAC_MODES as _SAC_MODES, all_gather_single, coalescing_manager,
                      current_graph_task_id, get_dispatch_stack_at, len_torch_dispatch_stack,
                      pop_mode as _pop_mode, push_mode as _push_mode, reduce_scatter_single)


def _op(op: Optional[dist.ReduceOp]) -> dict:
    """The `op` keyword for a c10d collective: none for SUM, torch's default."""
    return {} if op is None else {"op": op}


def has_uneven(uneven: Optional[tuple]) -> bool:
    """Whether a groups collective's `uneven` names any uneven pair."""
    return uneven is not None and any(sizes is not None for sizes in uneven)


def group_parts(buffer: torch.Tensor, spans: tuple, ranks: int = 1) -> list:
    """`buffer` cut into its gather groups' parts (one split; `spans`: the groups'
    (start, stop) byte ranges of a segment, BucketLayout.spans), for `ranks`
    consecutive ranks: a rank's segment (ranks=1: the gather input, the reduce
    output), an int reshard's kept slice, or the gathered buffer (ranks=world
    size). The buffer may be typed: its element size scales the byte offsets."""
    if len(spans) == 1:
        return [buffer]
    size = buffer.element_size()
    return list(buffer.split([(stop - start) * ranks // size for start, stop in spans]))


class Comm:
    """The collectives flexshard issues, each over a whole flat buffer."""

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group,
                   async_op: bool = False) -> Optional[dist.Work]:
        """Rank-major gather of equal-sized `input`s into `output`."""
        return all_gather_single(output, input, group=group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group,
                       async_op: bool = False,
                       op: Optional[dist.ReduceOp] = None) -> Optional[dist.Work]:
        """Reduce rank-major `input`s by `op` (None: SUM; AVG where `averages`)
        and give rank r segment r in `output`. `input` may be used as scratch."""
        # SUM is torch's default, left unnamed: torch 2.11's dynamo cannot trace a
        # ReduceOp default (the activation collectives trace this call)
        return reduce_scatter_single(output, input, group=group, async_op=async_op,
                                     **_op(op))

    def all_gather_groups(self, outputs: list, inputs: list, group,
                          async_op: bool = False, uneven: Optional[tuple] = None):
        """One rank-major gather per (output, input) pair, launched as one coalesced
        collective (a bucket's gather groups, planning/layout.py); one pair is
        `all_gather` itself. `uneven`: per pair None, or each rank's element count
        of an uneven gather: rank r's input (its first count r elements) lands
        after the previous ranks' in the output. Returns a work to wait on when
        `async_op`."""
        if has_uneven(uneven):
            return self._gather_uneven(outputs, inputs, group, async_op, uneven)
        if len(outputs) == 1:
            return self.all_gather(outputs[0], inputs[0], group, async_op=async_op)
        with coalescing_manager(group, async_ops=async_op) as launched:
            for output, input in zip(outputs, inputs):
                all_gather_single(output, input, group=group)
        return launched if async_op else None

    def _gather_uneven(self, outputs: list, inputs: list, group, async_op: bool,
                       uneven: tuple):
        """all_gather_groups with uneven pairs: each one broadcast per rank, rank r
        the source of its own piece (an uneven all_gather as NCCL runs it, a
        ncclBroadcast per rank in one group; gloo and "fake" refuse uneven lists),
        in the coalescing manager of the even pairs' all-gathers. The caller's
        copy-in usually wrote a rank's piece in place (its input is that piece)."""
        rank, pieces = dist.get_rank(group), []
        for output, input, sizes in zip(outputs, inputs, uneven):
            if sizes is not None:
                split = output.split(sizes)  # one op: every rank's piece, back to back
                if sizes[rank] and split[rank].data_ptr() != input.data_ptr():
                    split[rank].copy_(input[:sizes[rank]])
                pieces += [(piece, k) for k, piece in enumerate(split) if sizes[k]]
        # NCCL: with the device named, torch groups the broadcasts with the fast-path
        # all-gathers (one ncclGroupStart/End); elsewhere they run as launched, waited below
        device = outputs[0].device if outputs[0].device.type == "cuda" else None
        with coalescing_manager(group, device=device, async_ops=async_op) as launched:
            works = [dist.broadcast(piece, group=group, group_src=k, async_op=True)
                     for piece, k in pieces]
            for output, input, sizes in zip(outputs, inputs, uneven):
                if sizes is None:
                    all_gather_single(output, input, group=group)
        works = ([] if device is not None else works) + ([launched] if async_op else [])
        return finish(Works(works), async_op)

    def reduce_scatter_groups(self, outputs: list, inputs: list, group,
                              async_op: bool = False,
                              op: Optional[dist.ReduceOp] = None,
                              uneven: Optional[tuple] = None):
        """`reduce_scatter` per (output, input) pair, launched as one coalesced
        collective (see all_gather_groups). `uneven`: per pair None, or each
        rank's element count of an uneven reduce: the input is the ranks' pieces
        back to back and rank r's reduced piece lands in the first count r
        elements of its output."""
        if has_uneven(uneven):
            return self._reduce_uneven(outputs, inputs, group, async_op, op, uneven)
        if len(outputs) == 1:
            return self.reduce_scatter(outputs[0], inputs[0], group, async_op=async_op,
                                       **_op(op))
        with coalescing_manager(group, async_ops=async_op) as launched:
            for output, input in zip(outputs, inputs):
                reduce_scatter_single(output, input, group=group, **_op(op))
        return launched if async_op else None

    def reduce_scatter_uneven(self, output: torch.Tensor, input: torch.Tensor, sizes: tuple,
                              group, async_op: bool = False,
                              op: Optional[dist.ReduceOp] = None) -> Optional[dist.Work]:
        """Reduce `input`, the ranks' pieces back to back (`sizes` elements each), by
        `op` and give rank r its piece in the first sizes[r] elements of `output`."""
        mine = output[:sizes[dist.get_rank(group)]]
        return dist.reduce_scatter(mine, list(input.split(sizes)), group=group,
                                   async_op=async_op, **_op(op))

    def _reduce_uneven(self, outputs: list, inputs: list, group, async_op: bool,
                       op: Optional[dist.ReduceOp], uneven: tuple):
        """reduce_scatter_groups with uneven pairs: each one reduce_scatter of a list
        of the ranks' pieces (views of the input; one op on every backend: NCCL runs
        it as a group of reduces, gloo and "fake" take it as it is), launched before
        the even pairs' coalesced reduce-scatter."""
        works, even = [], []
        for output, input, sizes in zip(outputs, inputs, uneven):
            if sizes is None:
                even.append((output, input))
                continue
            works.append(self.reduce_scatter_uneven(output, input, sizes, group, async_op=True,
                                                    **_op(op)))
        if even:
            works.append(self.reduce_scatter_groups([o for o, _ in even], [i for _, i in even],
                                                    group, async_op=True, op=op))
        return finish(Works(works), async_op)

    def averages(self, group) -> bool:
        """Whether reduce_scatter takes ReduceOp.AVG on `group` (NCCL does;
        gloo does not, so a bucket pre-divides and sums there). torch's "fake"
        backend takes any op and moves nothing: it stands in for NCCL in the
        fake-world benchmark, so it takes NCCL's path (FSDP2 averages there too)."""
        return group is not None and dist.get_backend(group) in (dist.Backend.NCCL, "fake")

    def all_reduce(self, tensor: torch.Tensor, group, op: Optional[dist.ReduceOp] = None) -> None:
        """In-place all-reduce by `op` (None: SUM): norms, plan fingerprints, and
        under HSDP the reduced gradient shards across the replicate group."""
        dist.all_reduce(tensor, group=group, **_op(op))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list,
                   input_split_sizes: list, group) -> None:
        """Flat all-to-all: rank r sends its `input_split_sizes[j]` elements in
        segment j to rank j and receives `output_split_sizes[j]` from rank j
        (sizes may differ and be 0)."""
        dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group)


def check_takes_uneven(comm: Comm, bucket: str, gathers: bool, reduces: bool) -> None:
    """At wrap time: a bucket with uneven groups passes `uneven=` to its Comm's
    group collectives, so a user's Comm overriding one must accept it."""
    for needed, name in ((gathers, "all_gather_groups"), (reduces, "reduce_scatter_groups")):
        method = getattr(type(comm), name)
        if needed and method is not getattr(Comm, name) and \
                "uneven" not in inspect.signature(method).parameters:
            raise TypeError(
                f"bucket {bucket!r} has uneven groups (a large RaggedShard param split "
                f"unevenly, or whole tensors on ranks of unequal bytes), so flexshard calls "
                f"{type(comm).__name__}.{name}(..., uneven=sizes); that override takes no "
                f"`uneven` argument: accept uneven=None and pass it on to fs.Comm.{name} "
                "(or leave the method to fs.Comm)")


class Works:
    """Several launched collectives as one handle: `wait()` waits for each (a None
    among them: one that ran to completion, as a Comm may run its collectives),
    then runs `then` once (gloo's rooted reduce: the host's copy out of its buffer)."""

    def __init__(self, works: Sequence, then: Optional[Callable[[], None]] = None) -> None:
        self.works, self.then = [work for work in works if work is not None], then

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


def finish(works: Works, async_op: bool) -> Optional[Works]:
    """`works` to wait on when `async_op`, else waited for here (None)."""
    if async_op:
        return works
    works.wait()
    return None


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return current_graph_task_id() != -1


@contextmanager
def hidden_from_checkpoint():
    """Run a gather's ops outside selective-checkpoint dispatch modes.

    Under the user's selective activation checkpointing (torchtitan's "op" AC),
    torch replays ops by (op, call index), so the forward and the recompute
    must issue the same ops. A gather may be launched early (prefetch) in one
    and on demand in the other, so it never shows to those modes; other
    dispatch modes (CommDebugMode, user modes) still see it.
    """
    depth = len_torch_dispatch_stack()
    stack = [get_dispatch_stack_at(i) for i in range(depth)]
    if not any(isinstance(m, _SAC_MODES) for m in stack):
        yield
        return
    for _ in stack:
        _pop_mode()
    kept = [m for m in stack if not isinstance(m, _SAC_MODES)]
    for m in kept:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for m in stack:
            _push_mode(m)


# Streams and events.

class HostContext:
    """Program order: every stream is the one CPU thread; record/wait do nothing."""

    copy_in: Any = "copy_in"
    gather: Any = "gather"
    reduce: Any = "reduce"
    # Reduce-scatters left in flight while the next bucket's backward runs. On a
    # host, none: the collective runs on the backend's threads, on the cores the
    # backward computes on, so overlapping it bought 2-7% of wall time, while its
    # input (and gloo's input-sized copy) sat beside the next block's grads and
    # regathered params, above FSDP2's peak (design.md, "Streams and buffers").
    reduces_in_flight: int = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> Any:
        """The compute stream: the one current now."""
        return "compute"

    def on(self, stream: Any):
        """Run the block's ops on `stream`."""
        return nullcontext()

    def record(self, stream: Optional[Any] = None) -> Any:
        """An event marking everything queued so far on `stream` (default: current)."""
        return None

    def wait(self, event: Any, stream: Optional[Any] = None) -> None:
        """Make `stream` (default: current) wait for `event`; never the host."""

    def adopt(self, tensor: torch.Tensor, stream: Any) -> None:
        """`tensor`, allocated while another stream was current, is now used by
        `stream`: keep the allocator from reusing it before `stream` is done."""

    def synchronize(self, event: Any) -> None:
        """Make the host wait for `event` (before it reads what a device copied
        into host memory: CPU offload's sharded grads)."""


class CudaContext(HostContext):
    """One CUDA device: three side streams made once, events per use."""

    reduces_in_flight = 1  # the reduce stream overlaps the next block's backward

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # High priority for the gather side, as its consumer (the next block's
        # forward) waits on it; the reduce side has slack until backward ends.
        self.copy_in = torch.cuda.Stream(device, priority=-1)
        self.gather = torch.cuda.Stream(device, priority=-1)
        self.reduce = torch.cuda.Stream(device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def on(self, stream: Any):
        return torch.cuda.stream(stream)

    def record(self, stream: Optional[Any] = None) -> Any:
        event = torch.cuda.Event()
        event.record(stream if stream is not None else self.current())
        return event

    def wait(self, event: Any, stream: Optional[Any] = None) -> None:
        (stream if stream is not None else self.current()).wait_event(event)

    def adopt(self, tensor: torch.Tensor, stream: Any) -> None:
        # The one deliberate record_stream: a gather launched under one compute
        # stream and consumed under another (design.md, "the one exception").
        tensor.record_stream(stream)

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


class DeviceContexts:
    """One context per device a model's buckets live on, shared by its buckets
    (so they share streams). A bucket moved by to_empty() finds its new one."""

    def __init__(self) -> None:
        self._by_device: dict = {}

    def get(self, device: torch.device) -> HostContext:
        if device not in self._by_device:
            cls = CudaContext if device.type == "cuda" else HostContext
            self._by_device[device] = cls(device)
        return self._by_device[device]

    def set(self, device: torch.device, context: HostContext) -> None:
        """Use `context` for `device` (tests: a recording context)."""
        self._by_device[device] = context


class DeviceSite:
    """Where one bucket computes, looked up at each call (a move changes it): the
    compute device (the storage's, or an offloaded bucket's compute device), its
    context in the model's shared `contexts`, and the storage's device."""

    def __init__(self, storage, offload, contexts: DeviceContexts) -> None:
        self.storage, self.offload, self.contexts = storage, offload, contexts

    @property
    def compute_device(self) -> torch.device:
        return self.storage_device if self.offload is None else self.offload.compute_device

    @property
    def storage_device(self) -> torch.device:
        return self.storage.buffer.device

    @property
    def ctx(self) -> HostContext:
        """Streams and events of the compute device."""
        return self.contexts.get(self.compute_device)


@contextmanager
def on_stream(context: HostContext, stream: Any, after: Any):
    """Run the block on `stream` once it waited for the event `after`."""
    with context.on(stream):
        context.wait(after, stream)
        yield
