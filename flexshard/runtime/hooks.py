"""The modules' hooks, and the prefetch they drive.

A module that runs buckets gets a forward pre-hook (unshard its buckets) and a
forward hook (reshard them, and hook its outputs so backward refills what was
resharded before the block's backward runs). Each unshard tells the `Prefetcher`,
which launches the gathers expected next.

Prefetch. Forward and backward each follow an ExecutionOrder, re-recorded by any pass
that changes it. Each time a bucket unshards, the next `depth` buckets of
that order get their all-gather launched asynchronously, so it flies while
this bucket's module computes. At most `depth` prefetched gathers are alive
at once: one the order no longer expects is dropped before a new one is
launched, and whatever is left unused is dropped when the pass ends.

When a pass deviates from the recorded order, nothing more is launched in
it, and the gathers already in flight are kept until the pass ends: a bucket
that still comes later consumes its own, so no bucket gathers twice for one
use; one that never comes costs one unused gather. Every rank takes the same
decisions as long as every rank runs the same modules in the same order,
which the collectives need anyway.

The prefetcher asks a bucket for two things only: `prefetch()` launches its
gather if it takes one, `gather.discard()` drops it unused.

The order buckets unshard in (`ExecutionOrder`) is re-recorded whenever a pass
changes it, and a cursor follows it. One ExecutionOrder is kept for forward and
one for backward (where the recompute regathers). The first pass records; a
later pass follows the recorded order and names the buckets that come next,
which the prefetcher launches early. A pass that unshards a bucket other than
the one expected (a layer skipped on some steps, train/eval branches, a reversed
route) has deviated: it names no more buckets until it ends, and the order it
actually ran becomes the recorded order for the next pass. So a prediction is
only ever made while the pass has matched the recorded order so far.
"""

from __future__ import annotations

import enum
import functools
import zlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..compat import (COMPILED_CALL_IMPL, COMPILED_ORIG_MOD, current_graph_task_id,
                      top_saved_tensors_default_hooks, tree_map)
from .bucket import Bucket, BucketState
from .comm import in_backward
from .compiled import EagerCompiledBlocks, run_eagerly


def saves_kept_elsewhere() -> bool:
    """Whether the innermost saved-tensor hooks keep no tensor as it is: torch's
    activation checkpoint (its recompute gathers again) or save_on_cpu (copies).
    Then a forward's params made once are not refilled for its backward."""
    top = top_saved_tensors_default_hooks(False)
    if top is None:
        return False
    name = getattr(top[0], "__qualname__", "")
    return name.startswith(("_checkpoint_hook.", "save_on_cpu."))


def recomputes_without_hooks(module) -> bool:
    """Whether `module` checkpoints its own forward inside its call (transformers'
    layers after `model.gradient_checkpointing_enable()`): backward then runs that
    forward again without the module's hooks, with whatever params the modules hold.
    A module gathering above its params' module (`Bucket.above_owners`) may do the
    same through a child (a wrapper whose forward checkpoints the block)."""
    return getattr(module, "gradient_checkpointing", False) is True and module.training


def module_compiled(module) -> bool:
    """Whether `module.compile()` was called on `module`."""
    return getattr(module, COMPILED_CALL_IMPL, None) is not None


def outside_inference_mode(fn):
    """`fn` run with inference mode off (grad stays off) when called inside it: the
    buffers and params a bucket makes on its first gather outlive that forward, and
    made as inference tensors they would refuse the version checks of every later
    step (an evaluation under torch.inference_mode() before the first training step)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)
    return run


def _cast_floating(tree, dtype):
    if dtype is None:
        return tree

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


class ModuleHooks:
    """Unshard `buckets` before `module`'s forward and reshard them after."""

    def __init__(self, module: nn.Module, buckets: Sequence[Bucket],
                 prefetcher: Prefetcher, eager_compiled: EagerCompiledBlocks,
                 wrappers: Sequence[nn.Module] = ()) -> None:
        self.module, self.buckets = module, list(buckets)
        self.wrappers = list(wrappers)  # activation checkpoint wrappers around `module`
        # gathers above its params' module: a wrapper that may checkpoint it
        self.above_owners = any(b.above_owners for b in self.buckets)
        self.prefetcher, self.queue = prefetcher, self.buckets[0].reduce_queue
        self.queue.listeners.append(self.reshard_kept)  # runs when each backward pass ends
        self.mp = self.buckets[0].mp
        self._post_ran = True  # post_forward ran since the last pre_forward
        self._forwards: list = []  # (bucket, unsharded.Forward) of this forward, for backward
        self.eager_compiled = eager_compiled  # says once when a .compile()d block ran eagerly
        self._compile_checked = False  # a forward of the compiled module was checked
        self.handles = [
            # eager even inside a compiled module: a graph break at each (runtime/compiled.py);
            # first, so the user's pre-hooks (weight_norm's) see the unsharded params
            module.register_forward_pre_hook(run_eagerly(self.pre_forward), with_kwargs=True,
                                             prepend=True),
            module.register_forward_hook(run_eagerly(self.post_forward), with_kwargs=True),
            module.register_forward_hook(run_eagerly(self.after_forward_always), with_kwargs=True,
                                         always_call=True),
        ]

    @outside_inference_mode
    def pre_forward(self, module, args, kwargs):
        self._post_ran = False
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.mp.param_dtype)
        for bucket in self.buckets:
            if bucket.hold_handle is not None:  # module.unshard(async_op=True) not waited yet
                bucket.hold_handle.wait()
        if in_backward():  # a recompute: the pass must end by resharding what it gathers
            self.queue.watch_backward()
        handled = torch.is_grad_enabled() and not in_backward()
        # Backward refills the params made once that this forward's graph holds; not
        # under an activation checkpoint or save_on_cpu, which keep none of them.
        refill_in_backward = handled and not saves_kept_elsewhere()
        self._forwards = []
        # A non-resharding bucket's tensors are kept for its backward only where the
        # module may rerun its forward there without this module's hooks
        self._recomputed = handled and (self.above_owners or recomputes_without_hooks(module))
        for bucket in self.buckets:
            bucket.check_installed()  # (a block called by itself: the root's check missed it)
            if bucket.held is not None:  # module.unshard() holds it unsharded
                bucket.check_held()
                continue
            outs = bucket.unshard(refill_in_backward=refill_in_backward)
            bucket.install(outs)
            # An int reshard keeps 1/N of the gather for backward (also under the user's
            # activation checkpoint, whose recompute then gathers within the N ranks).
            bucket.gather.keep_post_forward_shard(handled and bool(bucket.gather.reshard_after_forward))
            forward = bucket.gather.take_opened()
            # what its backward refills (the params made once, unsharded.py) and puts
            # back on the modules
            if forward is not None or self._recomputed:
                self._forwards.append((bucket, forward, outs))
            self.prefetcher.unsharded(bucket)
        if handled:
            self._launch_after_backward(args, kwargs)
        return args, kwargs

    def _launch_after_backward(self, args, kwargs) -> None:
        """The block's backward is over when the grad_fn of one of its inputs is
        about to run: a pre-hook there launches the reductions its _Unshard nodes
        packed and deferred (grad_reduce.py), after autograd let go of their grads."""
        nodes: dict = {}

        def collect(t):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                nodes[id(t.grad_fn)] = t.grad_fn
            return t

        tree_map(collect, (args, kwargs))
        for node in nodes.values():
            node.register_prehook(self._launch_deferred)

    def _launch_deferred(self, grad_outputs) -> None:
        self.queue.launch_deferred()

    @outside_inference_mode
    def post_forward(self, module, args, kwargs, output):
        self._post_ran = True
        keep = torch.is_grad_enabled() and not in_backward()
        for bucket in self.buckets:
            if bucket.held is not None or (keep and bucket.used_in_nested_runner
                                           and not bucket.gather.reshard_after_forward):
                continue  # kept unsharded until backward ends (see reshard_kept)
            bucket.install_sharded()
            bucket.mark_resharded()
            # the params made once: freed now, refilled before the block's backward;
            # a recompute's stay for the backward that follows it
            if not in_backward() and (not keep or bucket.gather.reshard_after_forward):
                bucket.free_unsharded()
        forwards, self._forwards = self._forwards, []
        if keep and forwards:
            _refill_before_backward(output, _Refill(self.prefetcher, self.queue, forwards))
        if keep and not self._compile_checked and self._compiled():
            self._compile_checked = self.eager_compiled.check(
                [b.name for b in self.buckets], (args, kwargs), output, bool(self.wrappers))
        return _cast_floating(output, self.mp.output_dtype)

    def _compiled(self) -> bool:
        """The block or a wrapper around it was compiled (.compile(), torch.compile)."""
        return module_compiled(self.module) or any(
            module_compiled(w) or getattr(w, COMPILED_ORIG_MOD, None) is not None
            for w in self.wrappers)

    def after_forward_always(self, module, args, kwargs, output):
        """Runs after every forward, also one that raised (always_call). After a
        normal forward post_forward already ran and this does nothing; when the
        forward or a pre-hook raised, post_forward did not run: reshard here so
        the module stays usable."""
        if self._post_ran:
            return
        self._post_ran = True
        self._forwards = []
        # a recompute cut short (a checkpoint's early stop) keeps what it recomputed
        self._reshard(free=not in_backward())

    def reshard_kept(self) -> None:
        """When backward ends: reshard the buckets that kept their unsharded
        params since forward. A bucket that does not reshard after forward but
        whose params are also used inside another bucket's module (a shared
        module, a tied param) stays on the modules until then, so that module's
        recompute in backward reads the unsharded tensor it computed with."""
        self._reshard()

    def _reshard(self, free: bool = True) -> None:
        """Sharded params back on the modules for every unsharded bucket not held;
        with `free`, the storages of the params made once too."""
        for bucket in self.buckets:
            if bucket.held is None and bucket.state is BucketState.UNSHARDED:
                bucket.install_sharded()
                bucket.mark_resharded()
            if free:
                bucket.free_unsharded()


class _Refill:
    """A tensor hook on a forward's outputs: the first output grad that arrives in a
    backward pass (in each pass through a retained graph), before the block's
    backward reads what autograd saved, refills each bucket's params made once
    with the values that forward used (Bucket.refill), and the
    next buckets' gathers are prefetched. The reductions the blocks after it
    deferred go first (their backward is over: see _launch_after_backward).
    The modules then hold the params the forward computed with until the block's
    backward is done, as after FSDP2's pre-backward unshard: a checkpoint's recompute
    in backward (of a child module, of the block under a wrapper, of transformers'
    layers) runs without the block's hooks and reads what they hold. A resharding
    bucket's (refilled) always; a non-resharding bucket's tensors, which this hook
    keeps, only under a wrapper or transformers' layers (ModuleHooks._recomputed).
    The root's buckets: StrayCallHooks gathers them again for a recompute."""

    def __init__(self, prefetcher: Prefetcher, queue, forwards: list) -> None:
        self.prefetcher, self.queue, self.forwards = prefetcher, queue, forwards
        self.task = None

    def __call__(self, grad):
        task = current_graph_task_id()  # once per backward pass (retain_graph: each pass)
        if task != self.task:
            self.task = task
            self.queue.launch_deferred()
            for bucket, forward, outs in self.forwards:
                if forward is not None and bucket.refill(forward):
                    self.prefetcher.unsharded(bucket)
                bucket.install_for_backward(outs)
        return None


def _refill_before_backward(output, refill: _Refill) -> None:
    """Hook `refill` on every output that backward may reach. With none, no
    backward reads this forward's saves through the module (FSDP2's rule too)."""
    def hook(t):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(refill)
        return t

    tree_map(hook, output)


def check_call(state, site: str, *sigs: int) -> list:
    """Before `site` gathers the model: no tensor was swapped under a param (it would
    gather the old values), then RankAgreement.check_call, if the model has one:
    each of `sigs` as (max, min) over the ranks ([] where none was asked)."""
    for bucket in state.buckets:
        bucket.check_viewed()
    root = state.root_hooks
    if root is not None and root.agreement is not None:
        return root.agreement.check_call(site, *sigs)
    return []


class RootHooks:
    """Mark where the wrapped module's forward starts (new grad routes, prefetch)
    and ends."""

    def __init__(self, module: nn.Module, prefetcher: Prefetcher, queue, buckets,
                 agreement: Optional[RankAgreement] = None) -> None:
        self.module, self.prefetcher, self.queue = module, prefetcher, queue
        self.agreement = agreement
        self.stray: Optional[StrayCallHooks] = None  # armed between forwards
        self.all_buckets = list(buckets)
        self.buckets = [b for b in buckets if b.needs_hooks]
        self.handles = [
            # prepend: before the ModuleHooks of the root's own bucket, which must
            # unshard with this forward's new grad route.
            module.register_forward_pre_hook(run_eagerly(self.pre_forward), prepend=True),
            module.register_forward_hook(run_eagerly(self.post_forward), always_call=True),
        ]

    def pre_forward(self, module, args):
        for bucket in self.all_buckets:  # before any collective: each rank raises alike
            bucket.check_viewed()
            bucket.check_installed()  # before the prefetch gathers over functional_call's
        if self.agreement is not None and not in_backward():
            if torch.is_grad_enabled():
                self.agreement.check()
            else:
                self.agreement.check_eval()
        if self.stray is not None:
            self.stray.disarm()
        if not in_backward():
            self.queue.abandon_backward()
            # Made before anything else of this forward, the routes' _Deliver nodes
            # run last in backward (grad_reduce.py, step 4).
            for bucket in self.buckets:
                bucket.new_anchor()
        self.prefetcher.begin_forward()

    def post_forward(self, module, args, output):
        self.prefetcher.end_forward()
        if self.stray is not None:
            self.stray.arm()


class StrayCallHooks:
    """A forward pre-hook on each module (the root's own excepted) holding params
    of a bucket the root's forward gathers: an embedding, the final norm, an
    output head called outside the model's forward (a loss that applies the
    head itself) would compute with this rank's shards, so it raises instead.
    Armed between the root's forwards only (RootHooks disarms them at its
    pre-forward): a compiled model's forward never sees them."""

    def __init__(self, root: nn.Module, buckets: Sequence[Bucket], names: dict) -> None:
        self.checks = []  # (module, hook)
        for bucket in buckets:
            modules = {id(m): m for w in bucket.wiring for m, _ in w.aliases}
            # a module holding a param tied to another module's (either end): no bucket
            # of its own can gather it, the root's forward does
            tied = {id(m) for w in bucket.wiring if len({id(m) for m, _ in w.aliases}) > 1
                    for m, _ in w.aliases}
            self.checks += [(m, functools.partial(_check_gathered, bucket, names[id(m)],
                                                  id(m) in tied))
                            for m in modules.values() if m is not root]
        self.handles: list = []
        self.arm()

    def arm(self) -> None:
        if not self.handles:
            self.handles = [m.register_forward_pre_hook(check) for m, check in self.checks]

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _check_gathered(bucket: Bucket, name: str, tied: bool, module, args) -> None:
    if bucket.state is not BucketState.SHARDED or bucket.held is not None:
        return
    if in_backward():  # an activation checkpoint recomputes the module: gather again
        bucket.reduce_queue.watch_backward()  # the pass's end reshards it (reshard_kept)
        bucket.install(bucket.unshard())
        return
    fix = (f"give it a bucket of its own (fs.BucketSpec('{name}.*') in flex_shard's buckets, "
           "beside specs that place every other parameter: it then gathers by itself), or "
           "call model.unshard() first" if not tied else
           "or call model.unshard() before and model.reshard() after (around generate() of "
           "an encoder-decoder model); a bucket of its own cannot gather it, as it holds a "
           "parameter tied to another module's")
    raise RuntimeError(
        f"module {name!r} ran outside the model's forward, which gathers its bucket "
        f"{bucket.name!r}: its parameters are this rank's shards there. Call it inside the "
        f"forward, {fix}")


# The prefetcher and the order it follows.

class OrderState(enum.Enum):
    EMPTY = "empty"  # between passes, nothing recorded yet
    RECORDED = "recorded"  # between passes, an order is recorded
    RECORDING = "recording"  # a pass runs with nothing to follow: it is recorded
    FOLLOWING = "following"  # a pass runs and has matched the recorded order so far
    DEVIATED = "deviated"  # a pass left the recorded order: no predictions until it ends


class ExecutionOrder:
    """A recorded sequence of buckets (a bucket may appear several times)."""

    def __init__(self) -> None:
        self.state = OrderState.EMPTY
        self.buckets: tuple = ()
        self.changes = 0  # passes whose order differed from the recorded one
        self._ran: list = []  # the buckets the running pass unsharded, in order

    def begin_pass(self) -> None:
        """A pass starts: follow the recorded order, or record one."""
        self.state = OrderState.FOLLOWING if self.buckets else OrderState.RECORDING
        self._ran = []

    def end_pass(self) -> None:
        """A pass ended: the order it ran is what the next pass follows (the
        same as before, unless it deviated or stopped short)."""
        if self.state in (OrderState.EMPTY, OrderState.RECORDED):
            return  # no pass was running
        ran, self._ran = tuple(self._ran), []
        if ran and ran != self.buckets:  # a pass that unsharded nothing keeps the order
            self.changes += bool(self.buckets)
            self.buckets = ran
        self.state = OrderState.RECORDED if self.buckets else OrderState.EMPTY

    @property
    def deviated(self) -> bool:
        return self.state is OrderState.DEVIATED

    def visit(self, bucket, depth: int) -> list:
        """`bucket` unshards now; returns the up to `depth` buckets expected
        next: none outside a pass, while recording, or once the pass deviated."""
        if self.state in (OrderState.EMPTY, OrderState.RECORDED):
            return []  # a module run outside the root's forward: no pass to follow
        position = len(self._ran)
        self._ran.append(bucket)
        if self.state is not OrderState.FOLLOWING:
            return []
        if position >= len(self.buckets) or self.buckets[position] is not bucket:
            self.state = OrderState.DEVIATED
            return []
        return list(self.buckets[position + 1:position + 1 + depth])


class Prefetcher:
    """Execution orders of one model and the gathers launched ahead of use."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
        self.forward = ExecutionOrder()
        self.backward = ExecutionOrder()
        self._launched: list = []  # buckets whose gather was prefetched, unconsumed
        self._backward_pass = False  # a backward pass is being followed

    def begin_forward(self) -> None:
        """The root module's forward starts (not a recompute inside backward)."""
        if not in_backward():
            if self._backward_pass:  # a backward that raised never ended
                self.end_backward()
            self.forward.begin_pass()

    def end_forward(self) -> None:
        if not in_backward():
            self.forward.end_pass()
            self._drop(self._launched)

    def unsharded(self, bucket) -> None:
        """`bucket` was just unsharded: launch the gathers expected next."""
        if bucket in self._launched:  # its unshard just consumed the prefetched gather
            self._launched.remove(bucket)
        if in_backward():
            self._follow_backward()
        order = self.backward if in_backward() else self.forward
        expected = order.visit(bucket, self.depth)
        if order.deviated:
            return  # launch nothing more this pass; what flies may still be used
        self._drop([b for b in self._launched if b not in expected])
        for b in expected[:self.depth]:
            if b is not bucket and b.prefetch():
                self._launched.append(b)

    def drop_all(self) -> None:
        """Drop every prefetched gather (explicit reshard, device moves)."""
        self._drop(self._launched)

    def _follow_backward(self) -> None:
        if not self._backward_pass:
            self._backward_pass = True
            self.backward.begin_pass()

    def end_backward(self) -> None:
        """The outermost backward pass ended (a ReduceQueue listener)."""
        if self._backward_pass:
            self.backward.end_pass()
        self._drop(self._launched)
        self._backward_pass = False

    def _drop(self, buckets) -> None:
        for b in list(buckets):
            b.gather.discard()
            self._launched.remove(b)
