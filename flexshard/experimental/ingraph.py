"""Experimental: a block's bucket gather traced into its compiled graph.

The default under torch.compile keeps the gather in flexshard's eager hooks
around the compiled block (runtime/compiled.py). `compile_gather_in_graph`
is the alternative issue 15 asks to measure against it: the block is compiled
together with its buckets' all-gathers, expressed with torch's functional
collectives over the bucket's gather layout, and the block computes with views
(or copy-outs) of the gather output made by the same copy plans the eager path
uses. Reshard after forward is then selective activation checkpointing that the
compiler applies (AOTAutograd's partitioner): the compiled region runs inside
`torch.utils.checkpoint` with a policy that recomputes the gather and the ops
that turn its output into unsharded params, and saves everything else, so
backward regathers instead of keeping the unsharded params.

Gradients: the functional all-gather's backward is a reduce-scatter that sums
over the group; `_DivideGrad` divides the sharded grad by the bucket's
`gradient_divide_factor` (the mean, as the eager reduction), and autograd
accumulates it into the sharded params' `.grad` directly (no `_Unshard`, no
ReduceQueue: the reduce-scatter runs inside the compiled backward, synchronously).

Measured against the hooks variant in benchmarks/RESULTS.md ("torch.compile");
design.md says which is the default and why.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from ..compat import (FUNCTIONAL_COLLECTIVES_NAMESPACE, TRACES_COLLECTIVE_FUNCTIONS,
                      functional_all_gather_autograd)
from ..runtime.bucket import Bucket
from ..planning.wire_plan import plan_param_wires
from ..runtime.state import get_state

# aten ops that turn a gather output into unsharded params (besides views): the
# send's concatenation and gaps, copy-outs, casts. Recomputed like the gather:
# recomputing one of them elsewhere in the block only moves what is saved to its input.
_GATHER_OPS = frozenset({"cat", "clone", "index", "_to_copy", "new_zeros", "zeros",
                         "_unsafe_view", "view", "reshape", "slice", "as_strided", "alias"})


def recompute_gather_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpoint policy: recompute the gather, keep the rest."""
    if getattr(op, "namespace", None) == FUNCTIONAL_COLLECTIVES_NAMESPACE:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if getattr(op, "is_view", False) or op.overloadpacket.__name__ in _GATHER_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


class _DivideGrad(torch.autograd.Function):
    """Identity forward; backward divides the grad by `factor` (the mean of the
    summed reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.factor, None


class TracedGather:
    """One bucket's gather as traceable ops: this rank's sharded params into
    the gather input, one functional all-gather, the copy plans' unsharded params."""

    def __init__(self, bucket: Bucket) -> None:
        _check_supported(bucket)
        layout = self.layout = bucket.gather_layout
        self.dtype = layout.regions[0].dtype if layout.regions else torch.float32
        size = self.dtype.itemsize
        self.segment = layout.segment_bytes // size  # elements of one rank's segment
        # (start, numel) of this rank's piece of each slot in its segment, in elements
        self.pieces = [(reg.offsets[bucket.rank] // size, reg.nbytes[bucket.rank] // size)
                       for reg in layout.regions]
        self.order = sorted(range(len(self.pieces)), key=lambda i: self.pieces[i][0])
        self.wires = plan_param_wires(layout, bucket.gather.wire, bucket.rank)
        self.group, self.factor = bucket.group, bucket.grads.gradient_divide_factor
        self.all_gather = functional_all_gather_autograd()  # its name differs by torch release

    def gather_input(self, sharded: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's segment: its pieces at their offsets, zeros in the gaps."""
        parts, pos = [], 0
        for i in self.order:
            start, numel = self.pieces[i]
            if start > pos:
                parts.append(sharded[i].new_zeros(start - pos, dtype=self.dtype))
            parts.append(sharded[i].reshape(-1).to(self.dtype))
            pos = start + numel
        if pos < self.segment:
            parts.append(sharded[0].new_zeros(self.segment - pos, dtype=self.dtype))
        return torch.cat(parts)

    def unsharded(self, sharded: Sequence[torch.Tensor]) -> list:
        """The unsharded params, made inside the graph that calls this."""
        send = _DivideGrad.apply(self.gather_input(sharded), self.factor)
        # one gather per gather group (planning/layout.py); backward: reduce-scatter, sum
        parts = [self.all_gather(part, 0, self.group) for part in self.layout.group_parts(send)]
        gathered = parts[0] if len(parts) == 1 else torch.cat(parts)
        return [wire.traced(gathered) for wire in self.wires]


def _check_supported(bucket: Bucket) -> None:
    """NotImplementedError for what the experimental in-graph gather leaves out."""
    layout = bucket.gather_layout
    missing = [what for what, bad in (
        # 2.11's compiled training through it differs from eager (measured, CPU)
        ("torch before 2.13", not TRACES_COLLECTIVE_FUNCTIONS),
        ("world size 1", bucket.world_size == 1),
        ("CPU offload", bucket.offload is not None),
        ("HSDP (a replicate group)", bucket.replicate_size > 1),
        ("an int reshard_after_forward", bucket.post_forward_size is not None),
        ("DTensor (tensor-parallel) params", any(bucket.tp_specs or ())),
        ("a mixed precision policy", bucket.mp != type(bucket.mp)()),
        ("params of several dtypes", len({reg.dtype for reg in layout.regions}) > 1),
        ("a wire format other than the param itself", not bucket.gather.wire.plain),
    ) if bad]
    if missing:
        raise NotImplementedError(
            f"compile_gather_in_graph (experimental) does not support {', '.join(missing)} "
            f"(bucket {bucket.name!r}): compile the block with block.compile() instead, "
            "which keeps the gather in flexshard's hooks")


class _Body(nn.Module):
    """The block's own forward, under a name functional_call can substitute
    params in (the block's `forward` attribute is the compiled entry)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return type(self.block).forward(self.block, *args, **kwargs)


def _alias_names(block: nn.Module, bucket: Bucket) -> list:
    """Per slot, the names under `_Body` of every (module, attr) registering it."""
    names = {id(m): n for n, m in block.named_modules(remove_duplicate=False)}
    out = []
    for aliases in bucket.aliases:
        out.append([".".join(filter(None, ("block", names[id(m)], attr))) for m, attr in aliases])
    return out


def _block_hooks(model: nn.Module, block: nn.Module):
    """flexshard's ModuleHooks on `block`."""
    hooks = [h for h in get_state(model).hooks if h.module is block]
    if len(hooks) != 1:
        raise ValueError(f"compile_gather_in_graph: {type(block).__name__} is not the running "
                         "module of a flexshard bucket (pass a block that has its own BucketSpec)")
    return hooks[0]


def _detach_hooks(model: nn.Module, hooks) -> None:
    """Remove flexshard's eager hooks from their block: the compiled region gathers."""
    state = get_state(model)
    for handle in hooks.handles:
        handle.remove()
    hooks.queue.listeners.remove(hooks.reshard_kept)
    state.hooks.remove(hooks)
    if state.root_hooks is not None:  # no grad route: autograd delivers into .grad itself
        state.root_hooks.buckets = [b for b in state.root_hooks.buckets
                                    if b not in hooks.buckets]


def compile_gather_in_graph(model: nn.Module, block: nn.Module, **compile_kwargs) -> None:
    """Experimental: compile `block` (a running module of `model`, flex_shard's
    result) with its buckets' gathers inside the graph; reshard after forward
    is the compiler's selective recompute of the gather. Call it after
    flex_shard (and after any to() / to_empty(), which re-create the sharded
    params it captures) and before training. `compile_kwargs` go to torch.compile."""
    hooks = _block_hooks(model, block)
    buckets = hooks.buckets
    gathers = [TracedGather(b) for b in buckets]  # raises before anything changed
    _detach_hooks(model, hooks)
    names = [_alias_names(block, b) for b in buckets]
    reshard = any(b.reshard_after_forward for b in buckets)
    body = _Body(block)

    def region(params, args, kwargs):
        # `params` is passed in (not read from modules) so they are graph inputs
        # whatever names functional_call substitutes over.
        fulls = {}
        for gather, slots, sharded in zip(gathers, names, params):
            for aliases, full in zip(slots, gather.unsharded(sharded)):
                fulls.update(dict.fromkeys(aliases, full))
        return torch.func.functional_call(body, fulls, args, kwargs)

    def run(params, *args, **kwargs):
        if not (reshard and torch.is_grad_enabled()):
            return region(params, args, kwargs)
        context = functools.partial(create_selective_checkpoint_contexts, recompute_gather_policy)
        return checkpoint(region, params, args, kwargs, use_reentrant=False, context_fn=context)

    compiled = torch.compile(run, **compile_kwargs)
    params = [list(b.params) for b in buckets]
    block.forward = functools.partial(compiled, params)  # what the block's __call__ runs
