"""One bucket's life: its sharded parameters, the one gather that unshards them
and the one reduce-scatter that hands back their gradients.

States: SHARDED -> UNSHARDING -> UNSHARDED -> SHARDED. The bucket holds the
sharded params (its storage), installs params on the modules and keeps the state;
its gather (gather.py, `BucketGather`) and its gradient path (grad_reduce.py,
`GradReduce`) own their own fields. Unsharded parameters are made by `_Unshard`
(below), an autograd Function: its forward is the bucket's gather, its backward
packs the bucket's unsharded grads and defers the launch of their reduce-scatter
until the node has returned; the model's ReduceQueue finishes it and the bucket's
GradRoute (grad_reduce.py) hands the sharded gradients to `.grad`. A gather may be launched
early (`start_gather`, prefetch) and consumed by the next unshard.
"""

from __future__ import annotations

import enum
import operator
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn as nn

from ..compat import accumulates_into_grad, tensor_version
from ..config import MixedPrecisionPolicy, OffloadPolicy
from ..planning.bucket_plan import hooks_needed, plan_bucket_layouts
from ..planning.layout import SlotPlan
from ..planning.tensor_parallel import TPSpec
from .comm import Comm, DeviceContexts, DeviceSite, HostContext, check_takes_uneven, in_backward
from .counters import BucketCounters
from .gather import BucketGather
from .held import HeldParams
from .grad_reduce import GradReduce, GradRoute, ReduceQueue, Reduction
from .offload import Offload
from .sharded_grad import NormGroups, wrap_grads
from ..wrap.identity import adopt, mark_stale
from .storage import BucketStorage, moved_param
from .unsharded import Forward


class SlotWiring(NamedTuple):
    """What a running bucket knows of one slot beyond its plan, set once by
    flex_shard (`Bucket.wire`): where the param is registered, its TP spec and
    how its grad's norm completes."""

    aliases: tuple = ()  # every (module, attr) registering it (tied names included)
    tp: Optional[TPSpec] = None  # a DTensor param's TPSpec (planning/tensor_parallel.py)
    norms: Optional[NormGroups] = None  # a trainable slot's (sharded_grad.py)


class BucketState(enum.Enum):
    SHARDED = "sharded"  # modules hold sharded parameters, no gather in flight
    UNSHARDING = "unsharding"  # the gather runs (a prefetched one is the gather's inflight)
    UNSHARDED = "unsharded"  # modules hold unsharded parameters


class Bucket:
    """The sharded parameters of one BucketSpec and their collectives."""

    def __init__(self, name: str, slots: Sequence[SlotPlan], trainable: Sequence[bool],
                 mp: MixedPrecisionPolicy, reshard_after_forward,
                 group, rank: int, world_size: int, comm: Comm, device,
                 devices: Optional[DeviceContexts] = None, *,
                 replicate_group=None, replicate_size: int = 1, subgroups=None,
                 divide_factor: Optional[float] = None,
                 offload_policy: Optional[OffloadPolicy] = None) -> None:
        self.name, self.slots, self.mp = name, tuple(slots), mp
        # group, rank, world_size: the shard group. Under HSDP the reduced
        # shards are then all-reduced across replicate_group (None: no replicas).
        self.group, self.rank, self.world_size, self.comm = group, rank, world_size, comm
        self.replicate_group, self.replicate_size = replicate_group, replicate_size
        self.subgroups = subgroups  # mesh.Subgroups of the shard group (int reshard)
        self.mesh = None  # its DeviceMesh (its own or the model's; None without a process group)
        self.on_sub_mesh = False  # its own mesh has fewer ranks than the model's (experts)
        # Planned once: no setter changes what the layouts depend on.
        layouts = plan_bucket_layouts(slots, trainable, mp, world_size,
                                      offload=offload_policy is not None)
        check_takes_uneven(comm, name, any(layouts.gather.uneven), any(layouts.reduce.uneven))
        # CPU offload: the storage lives in host memory, `device` is the compute device.
        self.offload = None if offload_policy is None else Offload(offload_policy, device)
        self.storage = BucketStorage(layouts.storage, slots, rank,
                                     device if self.offload is None else self.offload.storage_device)
        if self.offload is not None:
            self.storage.replace_buffer(self.offload.to_host(self.storage.buffer))
        self.grad_slots = [i for i, t in enumerate(trainable) if t]
        self.params = [nn.Parameter(v, requires_grad=t) for v, t in zip(self.storage.views, trainable)]
        self.state = BucketState.SHARDED
        self.counters = BucketCounters()
        self.devices = devices or DeviceContexts()  # streams, shared by a model's buckets
        self.site = DeviceSite(self.storage, self.offload, self.devices)
        self.grads = GradReduce(layouts.reduce, slots, self.grad_slots, rank, world_size, group,
                                comm, self.counters, self.site, replicate_group=replicate_group,
                                replicate_size=replicate_size, divide_factor=divide_factor,
                                offload=self.offload)
        self.gather = BucketGather(
            layouts, self.storage, slots, rank, world_size, group, comm, self.counters, self.site,
            reshard_after_forward=reshard_after_forward, offload=self.offload,
            subgroups=subgroups)
        self.reduce_queue = ReduceQueue()  # flex_shard shares one queue across buckets
        self.wiring: tuple = tuple(SlotWiring() for _ in self.slots)  # per slot (see wire)
        self.has_tp = False  # a slot is a DTensor param: forward installs DTensors
        self.held: Optional[HeldParams] = None  # what module.unshard() holds (held.py)
        self._installed_for_backward = False  # see install_for_backward
        self._installed: tuple = ()  # what _install last put on the modules, per alias
        self.used_in_nested_runner = False  # a param is used inside another bucket's module
        self.above_owners = False  # its runner is above the module running all its params
        self.hold_handle = None  # the UnshardHandle of an unwaited module.unshard(async_op=True)
        self.grad_route = GradRoute()  # where this forward's reduced grads enter autograd
        # False at world size 1 without a cast or offload when every piece has the full
        # shape (the sharded params are the full ones); flex_shard sets its wrap plan's
        # value, which also counts DTensor slots and a bucket mesh smaller than the model's
        self.needs_hooks = hooks_needed(slots, mp, world_size, replicate_size,
                                        offload_policy is not None, False)

    @property
    def compute_device(self) -> torch.device:
        """Where the unsharded params and the collectives live: the storage's
        device, or the compute device of an offloaded bucket."""
        return self.site.compute_device

    @property
    def device_ctx(self) -> HostContext:
        """Streams and events of the compute device."""
        return self.site.ctx

    def assert_state(self, *states: BucketState) -> None:
        if self.state not in states:
            raise AssertionError(f"bucket {self.name!r} is {self.state}, expected {states}")

    def check_apply(self, fn) -> None:
        """Refuse an nn.Module._apply `fn` that would change a param's dtype."""
        for slot in self.slots:
            probe = fn(torch.empty(0, dtype=slot.dtype, device=self.compute_device))
            if probe.dtype != slot.dtype:
                raise NotImplementedError(
                    f"parameter {slot.fqn!r} (bucket {self.name!r}) would change dtype from "
                    f"{slot.dtype} to {probe.dtype}; flex_shard fixes parameter dtypes at wrap "
                    "time: convert the module before flex_shard, or compute in another dtype "
                    "with MixedPrecisionPolicy(param_dtype=...)")

    def apply_to_storage(self, fn) -> None:
        """Move the storage as nn.Module._apply's `fn` moves tensors (to_empty,
        .to(device)); the sharded params become views of the new buffer (new
        nn.Parameter objects, as nn.Module makes for incompatible tensors)."""
        self.assert_state(BucketState.SHARDED)
        self.grads.move(fn)
        offload, old = self.offload, self.storage.buffer
        buffer = fn(old) if offload is None else offload.move(fn, old)
        if buffer is old:
            return
        self.storage.replace_buffer(buffer)
        grad_fn = fn if offload is None else offload.to_host  # offloaded grads stay on the host
        self.params = [moved_param(p, v, grad_fn) for p, v in zip(self.params, self.storage.views)]
        self.grad_route.clear()  # its _Deliver node takes the old params
        self.gather.drop_unsharded()  # made on the old compute device

    def load_full(self, fqn_to_tensor) -> None:
        """Copy this rank's piece of each full tensor into the sharded storage."""
        with torch.no_grad():
            for slot, view in zip(self.slots, self.storage.views):
                full = fqn_to_tensor(slot.fqn)
                view.copy_(slot.placement.shard(full.to(view.device), self.rank, self.world_size))

    def adopt(self, originals: Sequence[torch.Tensor]) -> None:
        """After load_full: each slot's original Parameter object becomes its
        sharded param in place (wrap/identity.py), or, where it cannot, is
        marked so that an optimizer stepping it raises."""
        for i, (slot, original) in enumerate(zip(self.slots, originals)):
            kept = adopt(original, self.params[i])
            if kept is None:
                mark_stale(original, slot.fqn)
            else:
                self.params[i] = kept

    def unshard(self, new_tensors: bool = False, refill_in_backward: bool = False) -> list:
        """Gather the bucket: unsharded parameters linked to the sharded ones by
        autograd; new tensors if `new_tensors` (module.unshard()), else the params
        made once where they can be (unsharded.py). `refill_in_backward`: this
        forward's backward refills them (then the gather's take_opened() is its Forward)."""
        self.assert_state(BucketState.SHARDED, BucketState.UNSHARDED)
        self.check_requires_grad()
        self.state = BucketState.UNSHARDING
        try:
            # _grad_anchor() may renew the route: it runs before forward reads its Delivery.
            outs = _Unshard.apply(self, self._grad_anchor(), new_tensors, refill_in_backward)
        finally:
            self.state = BucketState.SHARDED
        self.state = BucketState.UNSHARDED
        return list(outs)

    def hold(self, outs: list) -> None:
        """module.unshard(): install `outs` as the unsharded params and keep them
        (the HeldParams reference keeps the gather output alive) until release()."""
        self.assert_state(BucketState.UNSHARDED)
        self.gather.drop_forward_buffers()
        self.install(outs)
        installed = [[m._parameters.get(a) for m, a in w.aliases] for w in self.wiring]
        # Read after the gather's and install's own writes; the sharded params are
        # views of the buffer: an in-place step bumps its version.
        self.held = HeldParams(outs, installed, tensor_version(self.storage.buffer))

    def release(self) -> list:
        """module.reshard(): the sharded params back on the modules. Returns the
        FQNs of held params written in place since hold(): those writes are dropped."""
        with torch.no_grad():
            written = self.held.written([w.aliases for w in self.wiring], self.gather.wire.formats,
                                        self._own_piece, self.storage.buffer)
        self.install_sharded()
        self.held = None
        self.mark_resharded()
        return [self.slots[i].fqn for i in written]

    def _own_piece(self, i: int, full: torch.Tensor) -> tuple:
        """(this rank's piece of slot i's full tensor `full`, its shard)."""
        return self.slots[i].placement.shard(full, self.rank, self.world_size), self.storage.views[i]

    def check_held(self) -> None:
        """Refuse to run a forward on held params the shards no longer match."""
        if self.held is not None and self.held.storage_version != tensor_version(self.storage.buffer):
            raise RuntimeError(
                f"bucket {self.name!r}: its sharded params changed (an optimizer step?) while "
                "module.unshard() held them unsharded; call module.reshard() before changing "
                "the params, then module.unshard() again")

    def check_viewed(self, index: Optional[int] = None) -> None:
        """Refuse sharded params (or the one at `index`) that no longer view their
        pieces of the buffer (`p.data = t`, `p.set_(t)`): the gather reads the buffer,
        so the step would train values the optimizer no longer writes. One pass of
        cached pointers: cheap enough for every forward."""
        ptrs = self.storage.ptrs
        if index is not None:
            if self.params[index].data_ptr() == ptrs[index]:
                return
        elif list(map(torch.Tensor.data_ptr, self.params)) == ptrs:
            return
        else:
            index = next(i for i, p in enumerate(self.params) if p.data_ptr() != ptrs[i])
        slot, param = self.slots[index], self.params[index]
        fqn = slot.fqn
        if param.dtype != slot.dtype:
            raise NotImplementedError(
                f"parameter {fqn!r} (bucket {self.name!r}) was converted to {param.dtype} "
                "after flex_shard (module.half(), .to(dtype), .apply(...) on a submodule); "
                f"flex_shard keeps it {slot.dtype} in its bucket's storage. "
                "Convert the model before flex_shard, or compute in another dtype with "
                "MixedPrecisionPolicy(param_dtype=...)")
        raise ValueError(
            f"parameter {fqn!r} (bucket {self.name!r}) no longer views its bucket's storage: its "
            "tensor was swapped after flex_shard (p.data = ..., p.set_(...)), so the gather "
            "would not see its values and the step would train the old ones. Write values in "
            "place instead: `with torch.no_grad(): p.copy_(shard)` for this rank's shard, or "
            f"load a full tensor: model.load_state_dict({{{fqn!r}: full_tensor}}, strict=False)")

    def check_requires_grad(self) -> None:
        """Freezing a param after flex_shard is fine (its grad is left out, see
        _Unshard); unfreezing one the bucket has no gradient room for is not."""
        trainable = set(self.grad_slots)
        for i, (slot, param) in enumerate(zip(self.slots, self.params)):
            if param.requires_grad and i not in trainable:
                raise ValueError(
                    f"parameter {slot.fqn!r} (bucket {self.name!r}) changed requires_grad to "
                    "True after flex_shard; it was frozen when wrapped, so the bucket's gradient "
                    "layout has no room for it: set requires_grad before calling flex_shard "
                    "(freezing a param after flex_shard is fine)")

    def check_frozen_pending(self) -> None:
        """Refuse a synced backward where a param frozen since the no-sync micro-batches
        has their grads pending: PyTorch steps it with them, the reduce would drop them
        (autograd gives a frozen param no .grad). The ranks freeze alike
        (RankAgreement), so every rank raises here."""
        grads = self.grads
        if not grads.requires_gradient_sync or grads.pending_grads is None:
            return
        lost = [self.slots[grads.grad_slots[j]].fqn for j in sorted(grads.pending_slots)
                if not self.params[grads.grad_slots[j]].requires_grad]
        if lost:
            raise ValueError(
                f"parameters {lost} (bucket {self.name!r}) were frozen (requires_grad_(False)) "
                "between no-sync micro-batches that gave them grads and the synced one: "
                "flexshard would drop their accumulated grads where PyTorch steps them. "
                "Change requires_grad between optimizer steps, not between micro-batches")

    # The modules registering the params (tied aliases included).

    def wire(self, wiring: Sequence[SlotWiring]) -> None:
        """Take each slot's wiring (flex_shard, once) and install the sharded params
        on every alias."""
        if len(wiring) != len(self.slots):
            raise AssertionError(f"bucket {self.name!r}: {len(wiring)} wirings for "
                                 f"{len(self.slots)} slots")
        self.wiring = tuple(wiring)
        self.has_tp = any(w.tp is not None for w in self.wiring)
        self.install_sharded()

    def install(self, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        """Point every alias of each slot at the given unsharded tensor (a DTensor
        again for a TP slot; None unregisters)."""
        if self.has_tp:
            tensors = [t if w.tp is None or t is None else w.tp.to_param(t)
                       for w, t in zip(self.wiring, tensors)]
        self._install(tensors)

    def _install(self, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        for wiring, tensor in zip(self.wiring, tensors):
            for module, attr in wiring.aliases:
                # Straight into _parameters: setattr would refuse the unsharded
                # params, plain tensors (autograd outputs), in a Parameter's place.
                module._parameters[attr] = tensor
        self._installed = tuple(t for w, t in zip(self.wiring, tensors) for _ in w.aliases)

    def check_installed(self) -> None:
        """Refuse a forward where a module no longer holds what this bucket put on
        it: torch.func.functional_call (torch.nn.utils.stateless) swaps tensors into
        the modules' _parameters for one call, and the gather would put the model's
        own over them. An identity check per alias: cheap enough for every forward."""
        now = [m._parameters.get(a) for w in self.wiring for m, a in w.aliases]
        if all(map(operator.is_, now, self._installed)):
            return
        slots = [i for i, w in enumerate(self.wiring) for _ in w.aliases]
        i = next(i for i, held, put in zip(slots, now, self._installed) if held is not put)
        raise RuntimeError(
            f"parameter {self.slots[i].fqn!r} (bucket {self.name!r}) was replaced on its "
            "module for this forward (torch.func.functional_call, torch.nn.utils.stateless, "
            "or a write to module._parameters): flex_shard gathers the bucket's own params "
            "over the ranks, so the forward would compute with them, not with the tensors "
            "passed. Change the params themselves (in place under torch.no_grad(), or "
            "fs.load_full_state_dict), or run the functional call on an unwrapped model "
            "loaded from fs.full_state_dict(model)")

    def install_sharded(self) -> None:
        """Put the sharded params back on the modules."""
        self._install(self.params)
        self._installed_for_backward = False

    def install_for_backward(self, tensors: Sequence[torch.Tensor]) -> None:
        """The params a forward computed with (refilled, or a non-resharding bucket's
        tensors) on the modules while the block's backward runs, for a forward
        recomputed there without the hooks (hooks._Refill); the sharded ones return
        when backward is done with them (backward_done)."""
        if self.held is None and self.state is BucketState.SHARDED:
            self.install(tensors)
            self._installed_for_backward = True

    def new_anchor(self) -> None:
        """Start a new route for this bucket's grads into autograd (at the
        start of each forward; see grad_reduce.py)."""
        self.grad_route.renew(self.reduce_queue, self.params, bool(self.grad_slots),
                              self.compute_device)

    def _grad_anchor(self) -> torch.Tensor:
        """The input tying the unsharded params to this bucket's reduction."""
        return self.grad_route.anchor_for_unshard(self.reduce_queue, self.params,
                                                  bool(self.grad_slots), self.compute_device)

    def awaits_backward(self) -> bool:
        """Whether a forward's backward is still to come (its graph alive): the
        params made once wait for it to refill them."""
        unsharded = self.gather.unsharded
        return unsharded is not None and unsharded.awaiting_backward()

    # What the backward's autograd nodes change (_Unshard): through these
    # methods, never by writing the fields.

    def backward_ended(self) -> None:
        """A backward pass ended (a ReduceQueue listener): the new sharded grads take
        full norms (sharded_grad.py), and the bucket lets go of what backward held
        (an int reshard's kept slice too, if backward never used it)."""
        wrap_grads(self.params, [w.norms for w in self.wiring])
        self.backward_done()

    def backward_done(self, forward: Optional[Forward] = None) -> None:
        """Backward no longer needs the refilled params nor the int reshard's
        slice: `forward`'s (its unshard node ran backward), or any forward's (the
        pass ended). The params made once are freed unless another forward's
        backward is still to come (which would gather them again) or the modules
        hold them."""
        self.gather.drop_forward_buffers()
        unsharded = self.gather.unsharded
        made_once = unsharded is not None and self.state is BucketState.SHARDED
        if made_once and forward is not None:
            unsharded.forwards.discard(forward)
            if unsharded.awaiting_backward():
                return
        if self._installed_for_backward:
            self.install_sharded()
        if made_once:
            self.free_unsharded()

    # The params made once (gather.py, unsharded.py): a forward's backward refills them.

    def refill(self, forward: Forward) -> bool:
        """Before the backward of `forward`'s block: its params hold the values it
        gathered (True when they were gathered now)."""
        unsharded = self.gather.unsharded
        if unsharded is not forward.params:
            raise RuntimeError(
                f"bucket {self.name!r}: its unsharded params were remade between forward and "
                "backward (a device move); move the model between steps, after backward")
        if unsharded.filled and unsharded.version == forward.version:
            return False
        self.check_unchanged_since(forward.version)
        self.reduce_queue.watch_backward()  # the pass ends by freeing them
        with torch.no_grad():
            self.gather.gather()
        return True

    def check_unchanged_since(self, version: int) -> None:
        """Backward is about to refill the params a forward gathered at storage
        `version`: refuse when they changed since."""
        if tensor_version(self.storage.buffer) != version:
            raise RuntimeError(
                f"bucket {self.name!r}: its sharded params changed between forward and "
                "backward (an optimizer step or an in-place write?); backward regathers them "
                "and needs the values forward used: change the params after backward")

    def free_unsharded(self) -> None:
        """Reshard the params made once (their storages freed), unless held or
        inside a backward that builds a graph of its own (create_graph=True: a
        gradient penalty), whose backward reads them: a later pass frees them."""
        if self.held is None and not (torch.is_grad_enabled() and in_backward()):
            self.gather.free_unsharded()

    def mark_resharded(self) -> None:
        self.assert_state(BucketState.UNSHARDED, BucketState.SHARDED)
        self.state = BucketState.SHARDED

    # The gather (gather.py owns its fields and steps).

    def set_reshard_after_forward(self, value) -> None:
        """The setter's part in the bucket (between steps): the gather follows."""
        self.assert_state(BucketState.SHARDED)
        self.gather.follow_reshard(value)

    def prefetch(self) -> bool:
        """Launch the gather ahead of its forward (hooks.py), unless the modules
        hold unsharded params or the bucket runs no hooks."""
        return self.held is None and self.needs_hooks and self.start_gather()

    def start_gather(self, new_tensors: bool = False) -> bool:
        """Launch the gather now (prefetch), unless in flight or not sharded;
        `new_tensors`: not into the params made once (module.unshard(), see unshard)."""
        if self.state is not BucketState.SHARDED:
            return False
        return self.gather.start(new_tensors)



class _Unshard(torch.autograd.Function):
    """Forward: the bucket's gather. Backward: the bucket's reduce-scatter."""

    @staticmethod
    def forward(ctx, bucket: "Bucket", anchor: torch.Tensor, new_tensors: bool,
                refill_in_backward: bool):
        # The route's Delivery of this forward (None under no_grad): a later forward's
        # new route must not receive this graph's grads.
        ctx.bucket, ctx.delivery = bucket, bucket.grad_route.delivery
        ctx.set_materialize_grads(False)
        outs = bucket.gather.gather(None, new_tensors)
        # What this graph's backward needs of the params made once (unsharded.py):
        # held by the graph, so a forward never backpropagated stops counting.
        ctx.forward = bucket.gather.open_forward() if refill_in_backward else None
        # frozen now (requires_grad_(False) after the wrap included): no grad is computed.
        # A new alias each: a param made once keeps the grad_fn of the last forward that
        # trained it, and marking it non-differentiable would leave that old node in the
        # graph (its backward run again, an extra reduce-scatter a step).
        outs = [o.detach() if not p.requires_grad else o for o, p in zip(outs, bucket.params)]
        frozen = [o for o, p in zip(outs, bucket.params) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # The reduce-scatter runs while the rest of backward does; the queue
        # delivers the sharded grads into .grad (at the latest when backward ends).
        bucket = ctx.bucket
        # Every grad is known: the block's backward is done with its refilled params;
        # dropped before the reduce buffers are made, so the two never coexist.
        bucket.backward_done(ctx.forward)  # and the int reshard's kept slice
        _refuse_unreducible(bucket)  # before any of this pass's reduce work
        bucket.reduce_queue.watch_backward()
        bucket.reduce_queue.make_room()
        bucket.check_frozen_pending()
        packed = bucket.grads.pack(grads)
        if packed is not None:
            # Launched once this backward has returned and autograd has let go of the
            # unsharded grads, so they never sit beside the collective's buffers.
            bucket.reduce_queue.defer(Reduction(bucket.grads, packed, ctx.delivery))
        return None, bucket.grad_route.anchor_grad(bucket.compute_device), None, None


def _refuse_unreducible(bucket: Bucket) -> None:
    """Backward passes whose grads of the params cannot be what autograd promises:
    differentiable ones (create_graph=True: the reduction is no autograd op), and
    torch.autograd.grad inside a no-sync accumulation (it would add them to the
    pending sum, grad_reduce.py, and return none)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"a backward with create_graph=True reached the params of bucket {bucket.name!r}: "
            "flex_shard reduces their gradients over the ranks outside autograd, so those "
            "gradients cannot be differentiated again (a penalty on the weights' gradients, a "
            "Hessian-vector product or second-order MAML would lose that term). "
            "create_graph=True with respect to inputs only works (a penalty on input "
            "gradients); compute second-order terms in the params on an unwrapped model")
    if bucket.grads.requires_gradient_sync:
        return
    trains = [p for p in bucket.params if p.requires_grad]
    if trains and not accumulates_into_grad(trains[0]):
        raise RuntimeError(
            f"torch.autograd.grad with respect to the params of bucket {bucket.name!r} "
            "inside a no-sync accumulation (set_requires_gradient_sync(False)): flex_shard "
            "would add this backward's gradients to the accumulated sum that the next synced "
            "backward reduces, and has no reduced gradient to return. Call autograd.grad on "
            "the params with gradient sync on, or use loss.backward()")
