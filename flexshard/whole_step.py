"""fs.compile: a flex_shard model compiled whole, its gathers and gradient
reductions inside the graph.

Each running module's forward becomes: gather its buckets (runtime/traced.py),
then run its own forward with the unsharded params substituted
(torch.func.functional_call). Under reshard after forward that runs inside a
selective activation checkpoint that recomputes the gather in backward and
leaves the rest to the partitioner, so the compiled backward regathers instead
of keeping the unsharded params (the memory meaning of eager's reshard). The
module tree, its names and the sharded params stay as they are: checkpoints,
the optimizer, clip and the dry run see the same model.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from .compat import COMPILED_CALL_IMPL, side_effects_once_under_checkpoint
from .runtime.hooks import ModuleHooks, _cast_floating
from .runtime.sharded_grad import wrap_grads
from .runtime.state import get_state
from .runtime.traced import TracedBucket, recompute_gather_policy, unsharded


class _Body(nn.Module):
    """A running module's own forward, under a name functional_call substitutes
    params in (the module's `forward` attribute is the traced one)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


class TracedForward:
    """A running module's forward with its buckets gathered in the graph."""

    def __init__(self, hooks: ModuleHooks, nested: bool) -> None:
        module = hooks.module
        # raises before any change
        self.gathers = [TracedBucket(b, kept=nested) for b in hooks.buckets]
        self.buckets = hooks.buckets
        names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
        self.names = [[[".".join(filter(None, ("module", names[id(m)], attr))) for m, attr in slot]
                       for slot in (w.aliases for w in b.wiring)] for b in hooks.buckets]
        self.body, self.mp = _Body(module), hooks.mp
        # what inspect.signature(module.forward) says (HF Trainer picks its columns by it)
        self.__signature__ = inspect.signature(module.forward)
        # A module holding other running modules keeps its params to backward, as
        # FSDP2's root does: its backward starts right after its forward ends.
        self.reshard = not nested and any(b.gather.reshard_after_forward for b in hooks.buckets)
        self.policy = functools.partial(recompute_gather_policy,
                                        frozenset(g.regather_group for g in self.gathers))

    def region(self, params, casts, args, kwargs):
        fulls = {}
        for gather, names, sharded, cast8 in zip(self.gathers, self.names, params, casts):
            for aliases, full in zip(names, unsharded(gather, sharded, cast8)):
                fulls.update(dict.fromkeys(aliases, full))
        return torch.func.functional_call(self.body, fulls, args, kwargs, tie_weights=False)

    def __call__(self, *args, **kwargs):
        # read each call (graph inputs): to() and to_empty() make new sharded params
        params = [list(b.params) for b in self.buckets]
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.mp.param_dtype)
        # torchao's float8 weights cast before the checkpoint: saved, not recomputed
        casts = [gather.cast_float8(sharded) for gather, sharded in zip(self.gathers, params)]
        if self.reshard and torch.is_grad_enabled():
            context = functools.partial(create_selective_checkpoint_contexts, self.policy)
            out = checkpoint(self.region, params, casts, args, kwargs, use_reentrant=False,
                             context_fn=context)
        else:
            out = self.region(params, casts, args, kwargs)
        return _cast_floating(out, self.mp.output_dtype)


def compile(model: nn.Module, *, fullgraph: bool = False, cudagraphs: bool = False,
            **compile_kwargs) -> nn.Module:
    """Compile `model` (flex_shard's result) whole, in place: each bucket's
    all-gather and its grads' reduce-scatter are in the compiled graph (forward
    and backward), with the buckets' boundaries, placements and wire formats
    as wrapped. `fullgraph=True` raises on any graph break; `cudagraphs=True`
    runs the compiled step under CUDA graphs (inductor's "reduce-overhead"
    mode; CUDA only, static shapes). Other keyword arguments go to
    torch.compile. Returns `model`, whose names, params and state dict are
    unchanged. Eager flex_shard is untouched: this is opt-in."""
    state = get_state(model)
    _check_compile_args(model, state, cudagraphs, compile_kwargs)
    runners = {id(h.module) for h in state.hooks}
    forwards = [TracedForward(h, _holds_runner(h.module, runners)) for h in state.hooks]
    agreement = state.root_hooks.agreement if state.root_hooks is not None else None
    stray = _detach_hooks(state)
    for hooks, forward in zip(state.hooks, forwards):
        hooks.module.forward = forward
    state.hooks, state.whole_step = [], True
    _wrap_grads_when_accumulated(state)
    model.compile(fullgraph=fullgraph, **_compile_kwargs(compile_kwargs, cudagraphs))
    compiled = getattr(model, COMPILED_CALL_IMPL)
    gathers = [g for f in forwards for g in f.gathers]
    setattr(model, COMPILED_CALL_IMPL,
            functools.partial(_compiled_call, compiled, stray, agreement, state.buckets, gathers))
    return model


def _compiled_call(compiled, stray, agreement, buckets, gathers, *args, **kwargs):
    """The compiled model's call, traced with each block's Python side effects
    applied once (compat.side_effects_once_under_checkpoint). The root's checks
    that its bucket's modules (an embedding, an output head) run inside its
    forward (`StrayCallHooks`) are off during the call, on between calls, as
    eager's root hooks arm them; the ranks' frozen sets and setters are compared
    first, as eager's root hook does (RankAgreement), and a param unfrozen that was
    frozen when wrapped is refused, as eager's gather refuses it. The gathers'
    index positions follow the params to a new device (to(), to_empty())."""
    if torch.is_grad_enabled():
        if agreement is not None:
            agreement.check()
        for bucket in buckets:
            bucket.check_requires_grad()
    for gather in gathers:
        gather.follow_device()
    if stray is not None:
        stray.disarm()
    try:
        with side_effects_once_under_checkpoint():
            return compiled(*args, **kwargs)
    except Exception as err:
        if _nested_checkpoint_side_effect(err):
            raise RuntimeError(
                "fs.compile: dynamo failed on a block's Python side effect inside an "
                "activation checkpoint nested in the one that reshards it after forward (a "
                "torch bug of dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint). A block "
                "under your own activation checkpoint (checkpoint_wrapper, "
                "torch.utils.checkpoint) that sets a module attribute in forward (self.aux = "
                "..., a counter, a cache) cannot be compiled whole while its bucket reshards "
                "after forward: give it reshard_after_forward=False (flex_shard or its "
                "BucketSpec), compile the blocks instead (block.compile()), or return the "
                "value from forward") from err
        if _float_under_checkpoint(err):
            raise RuntimeError(
                "fs.compile: dynamo failed on a Python float argument whose value changed "
                "between calls (a temperature, a schedule) inside the activation checkpoint "
                "that reshards a block after forward (a torch bug: such a float becomes "
                "symbolic, which dynamo cannot lift out of a checkpoint). Pass it as a tensor "
                "(torch.tensor(value)), compile with dynamic=False, or give that block's "
                "bucket reshard_after_forward=False") from err
        raise
    finally:
        if stray is not None:
            stray.arm()


def _nested_checkpoint_side_effect(err: Exception) -> bool:
    """Whether `err` is dynamo's internal error for a side effect under nested
    checkpoints (torch 2.13: the output node names a node of another graph)."""
    return (type(err).__name__ == "InternalTorchDynamoError"
            and "does not belong to this Graph" in str(err))


def _float_under_checkpoint(err: Exception) -> bool:
    """Whether `err` is dynamo's internal error for a float that became symbolic
    inside a checkpointed region (torch 2.13)."""
    return "lift_tracked_freevar_to_input should not be called on root" in str(err)


def _compile_kwargs(compile_kwargs: dict, cudagraphs: bool) -> dict:
    """torch.compile's keyword arguments. Under inductor, `mode` becomes its options
    (torch.compile takes one or the other), CUDA graphs one of them, and the
    reduce-scatters' order pass (runtime/reduce_order.py) the post-grad pass,
    unless the caller set one."""
    kwargs = dict(compile_kwargs)
    if kwargs.get("backend", "inductor") != "inductor":
        return {**kwargs, "mode": "reduce-overhead"} if cudagraphs else kwargs
    from .compat import inductor_mode_options
    from .runtime.reduce_order import ChainReduces

    mode = "reduce-overhead" if cudagraphs else kwargs.pop("mode", None)
    options = {**(inductor_mode_options(mode) if mode else {}), **(kwargs.pop("options", None) or {})}
    options.setdefault("post_grad_custom_post_pass", ChainReduces())
    return {**kwargs, "options": options}


def _wrap_grads_when_accumulated(state) -> None:
    """Each new sharded grad a ShardedGrad (full norms), as eager's end of backward
    makes them: torch's clip_grad_norm_ on model.parameters() stays global."""
    for bucket in state.buckets:
        for i in bucket.grad_slots:
            spec = bucket.wiring[i].norms
            if spec is not None:
                param, trains = bucket.params[i], bucket.params[i].requires_grad
                param.requires_grad_(True)  # frozen since the wrap: its hook for when it trains
                param.register_post_accumulate_grad_hook(functools.partial(_wrap_grad, spec=spec))
                param.requires_grad_(trains)


def _wrap_grad(param: torch.Tensor, spec) -> None:
    wrap_grads([param], [spec])


def _holds_runner(module: nn.Module, runners: set) -> bool:
    return any(id(m) in runners for m in module.modules() if m is not module)


def _check_compile_args(model, state, cudagraphs: bool, compile_kwargs: dict) -> None:
    if getattr(state, "whole_step", False):
        raise RuntimeError("fs.compile: this model is compiled already; call it once")
    if any(getattr(h.module, "_compiled_call_impl", None) is not None for h in state.hooks):
        raise ValueError("fs.compile: a block of this model was compiled with block.compile(); "
                         "compile either the blocks or the whole model, not both")
    if cudagraphs and "mode" in compile_kwargs:
        raise ValueError(f"fs.compile: cudagraphs=True sets mode='reduce-overhead'; drop "
                         f"mode={compile_kwargs['mode']!r} or cudagraphs")
    offloaded = [b.name for b in state.buckets if b.offload is not None]
    if cudagraphs and offloaded:
        raise ValueError(f"fs.compile: cudagraphs=True cannot capture the copies from host "
                         f"memory of bucket {offloaded[0]!r} (offload_policy): drop cudagraphs, "
                         "or the offload for that bucket (BucketSpec(offload_policy=False))")
    if cudagraphs and any(b.compute_device.type != "cuda" for b in state.buckets):
        raise ValueError("fs.compile: cudagraphs=True needs the params on a CUDA device")
    for setter, flag in (("set_requires_gradient_sync", "requires_gradient_sync"),
                         ("set_requires_all_reduce", "requires_all_reduce")):
        if not all(getattr(b.grads, flag) for b in state.buckets):
            raise RuntimeError(
                f"fs.compile: the model is under {setter}(False), which the compiled step "
                f"does not follow (every compiled backward reduces): call {setter}(True) and "
                "finish that accumulation with an eager backward first")
    if any(b.held is not None for b in state.buckets):
        raise RuntimeError("fs.compile: the model is held unsharded (model.unshard()); call "
                           "model.reshard() first")


def _detach_hooks(state):
    """flexshard's eager hooks off the modules: the compiled graph gathers and
    reduces. Returns the root's stray-call checks (disarmed), or None."""
    for hooks in state.hooks:
        for handle in hooks.handles:
            handle.remove()
        hooks.queue.listeners.remove(hooks.reshard_kept)
    root = state.root_hooks
    if root is not None:
        for handle in root.handles:
            handle.remove()
        stray, root.stray = root.stray, None
        if stray is not None:
            stray.disarm()
        state.root_hooks = None
        return stray
    return None
