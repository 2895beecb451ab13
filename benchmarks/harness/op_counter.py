"""OpCounter and GraphCounter: the ops a step dispatches, the bytes copies write.

Counting what a step dispatches: every aten op by name, the views among them,
collectives, and the bytes copy-family ops write, per op and per library region
(the FlexShard::* or FSDP::* record_function range open when it ran); inside
compiled graphs too (GraphCounter). The fake world's `--counts` and `count_step`
read them."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .meters import is_collective, nbytes

# Ops that write a copy of bytes held elsewhere: casts, packs and unpacks, clones,
# gathers by index. FSDP2's fsdp::* are custom ops whose inner copies a dispatch
# mode does not see, so they count as one op with the bytes they write.
COPY_OPS = frozenset({
    "aten::copy_", "aten::_to_copy", "aten::_foreach_copy_", "aten::_foreach_copy",
    "aten::cat", "aten::stack", "aten::_chunk_cat", "aten::split_with_sizes_copy",
    "aten::clone", "aten::index", "aten::index_select", "aten::index_put",
    "aten::index_put_", "aten::_index_put_impl_", "aten::index_copy", "aten::index_copy_",
    "aten::narrow_copy", "aten::slice_scatter", "aten::select_scatter",
    "aten::as_strided_scatter", "aten::constant_pad_nd",
    # their functional forms and the backward of a slice (a graph's: see GraphCounter)
    "aten::copy", "aten::slice_backward", "aten::select_backward",
    "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat",
})
_NOT_WORK = ("profiler::",)  # record_function's enter/exit markers: no kernel, no bytes
LIBRARY_LABELS = ("FlexShard::", "FSDP::")  # the record_function ranges ops are attributed to
OUTSIDE = "(no library label)"  # the model's own ops, and any library work left unlabelled


def is_view(func) -> bool:
    """Whether every output of `func` aliases an input (a view: no kernel, no bytes)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def written_bytes(func, args, kwargs, out) -> int:
    """Bytes `func` wrote: its mutated arguments (in-place and out= ops), else its
    outputs; all_gather_copy_in writes only its first output (the copy-in slice of
    the gather buffer it returns as well)."""
    name = func._schema.name
    if name == "fsdp::all_gather_copy_in":
        return nbytes(out[0])
    written = [a.name for a in func._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    if written:
        bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
        targets = [bound.get(n) for n in written]
    else:
        targets = [out]
    return sum(nbytes(t) for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor))


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched under it by name (record_function markers left
    out), the views among them, collectives, and the bytes copy-family ops write;
    and per region, the innermost FlexShard::* or FSDP::* record_function range
    open when the op ran (OUTSIDE: none open), ops and copied bytes.

    An op on a tensor subclass (DTensor, torchao's float8 weight) counts once, at
    the subclass: the ops it runs inside are not seen (as FSDP2's custom ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.views: Counter = Counter()
        self.copy_bytes: Counter = Counter()
        self.region_ops: Counter = Counter()
        self.region_bytes: Counter = Counter()
        self._open: dict = {}  # thread -> labels of its open ranges (None: not a library's)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if name.startswith(_NOT_WORK):
            self._track_range(name, args, out)
            return out
        region = next((r for r in reversed(self._stack()) if r), OUTSIDE)
        self.ops[name] += 1
        self.region_ops[region] += 1
        if is_view(func):
            self.views[name] += 1
        if name in COPY_OPS:
            n = written_bytes(func, args, kwargs, out)
            self.copy_bytes[name] += n
            self.region_bytes[region] += n
        return out

    def _stack(self) -> list:
        return self._open.setdefault(threading.get_ident(), [])

    def _track_range(self, name: str, args, out) -> None:
        """record_function ranges nest per thread (context managers): enter pushes, exit pops."""
        if name == "profiler::_record_function_enter_new":
            label = args[0].split(" (")[0]  # FSDP2 appends " (module fqn)": one row per kind
            self._stack().append(label if label.startswith(LIBRARY_LABELS) else None)
        elif name == "profiler::_record_function_exit" and self._stack():
            self._stack().pop()


class Counts(NamedTuple):
    """One forward+backward of one side, counted by OpCounter."""

    ops: int  # every dispatched op
    non_view_ops: int  # less the views (on a GPU: about the kernels launched)
    copy_ops: int  # copy-family ops
    copy_bytes: int  # bytes they wrote
    collectives: int
    by_op: dict  # name -> (count, copy bytes)
    by_region: dict  # FlexShard::* / FSDP::* range (or OUTSIDE) -> (ops, copy bytes)
    engine_copy_bytes: int  # copy bytes inside the library's labelled regions (not OUTSIDE)

    @classmethod
    def of(cls, counter: OpCounter) -> "Counts":
        by_op = {n: (c, counter.copy_bytes.get(n, 0)) for n, c in counter.ops.most_common()}
        by_region = {r: (c, counter.region_bytes.get(r, 0))
                     for r, c in counter.region_ops.most_common()}
        return cls(sum(counter.ops.values()),
                   sum(counter.ops.values()) - sum(counter.views.values()),
                   sum(c for n, c in counter.ops.items() if n in COPY_OPS),
                   sum(counter.copy_bytes.values()),
                   sum(c for n, c in counter.ops.items() if is_collective(n)), by_op, by_region,
                   sum(b for r, b in counter.region_bytes.items() if r != OUTSIDE))


class GraphCounter:
    """A torch.compile backend (AOTAutograd, graphs run as eager aten ops, no
    fusion) that runs OpCounter inside its compiled graphs while `counting`:
    a dispatch mode entered outside would make dynamo run the frames eagerly,
    one entered in the graph sees its ops as an eager step's are seen. What it
    counts is before inductor's fusion: an upper bound on a fused graph's ops
    and bytes."""

    def __init__(self) -> None:
        self.counter: Optional[OpCounter] = None

    def backend(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def compile_graph(gm, example_inputs):
            def run(*args):
                if self.counter is None:
                    return gm(*args)
                with self.counter:
                    return gm(*args)
            return make_boxed_func(run)

        return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph)

    def count(self, step: Callable[[], object]) -> Counts:
        self.counter = OpCounter()
        try:
            step()
            return Counts.of(self.counter)
        finally:
            self.counter = None
