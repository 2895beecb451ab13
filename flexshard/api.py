"""flex_shard(): validate the user's request, plan the buckets, wrap the module."""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .compat import DDP_IGNORED_NAMES
from .checkpoint.materialize import apply_to_buckets, init_parameters
from .checkpoint.optimizer_state import OptimizerHooks
from .checkpoint.state_dict import StateDictHooks
from .checkpoint.unset_buffers import UnsetBuffers, meta_buffers
from .config import BucketSpec, MixedPrecisionPolicy, OffloadPolicy, check_reshard
from .placements.contract import Placement
from .placements.shard import Shard
from .planning.assign import alias_names, assign_params, checkpoint_wrappers, default_buckets
from .planning.fingerprint import check_ranks_agree
from .planning.options import (check_modules, check_options, check_params, check_specs,
                               resolve_reshard)
from .planning.plan import WrapPlan, plan_wrap, shard_dim_note
from .planning.tensor_parallel import (check_dtensor_params, restore_params, slot_specs,
                                       to_local_params)
from .runtime.bucket import Bucket, BucketState, SlotWiring
from .runtime.comm import Comm, DeviceContexts
from .runtime.compiled import EagerCompiledBlocks
from .runtime.gloo import comm_for
from .runtime.explicit_unshard import reshard_explicitly, unshard_explicitly
from .runtime.hooks import ModuleHooks, Prefetcher, RootHooks, StrayCallHooks
from .runtime.rank_agreement import RankAgreement
from .wrap.mesh import MeshGroups, Subgroups, files_group, mesh_groups, single_process
from .runtime.grad_reduce import ReduceQueue
from .wrap.registration import RegistrationGuard
from .runtime.sharded_grad import norm_groups
from .runtime.state import FlexShardState, attach_state, find_state, get_state
from .wrap.generation import synced_generate
from .wrap.refused_methods import refused_methods
from .wrap.teardown import destroy_gloo_group_at_exit


class FlexShardModule:
    """Mixin a wrapped module becomes an instance of (like FSDP2's FSDPModule)."""

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        """nn.Module's, except that while `unshard()` holds buckets their sharded
        params stand under their names (the optimizer's, whose .grad backward
        fills: clipping, logging, freezing and in-place writes reach them), not the
        unsharded tensors the modules hold for forward."""
        held = _held_params(find_state(self))
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield name, held.get(id(param), param)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """When False, backward accumulates unreduced gradients and issues no
        gradient collective; the next synced backward reduces the sum."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync expects a bool, got {requires_gradient_sync!r}")
        for bucket in _eager_state(self, "set_requires_gradient_sync").buckets:
            bucket.grads.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """HSDP gradient accumulation: when False, backward reduce-scatters within
        the shard group and keeps the reduced shards summed per bucket, with no
        all-reduce across replicas and no grads delivered; the next backward with
        True all-reduces that sum once (FSDP2's set_requires_all_reduce). Without
        replicas it changes nothing."""
        if not isinstance(requires_all_reduce, bool):
            raise TypeError(f"set_requires_all_reduce expects a bool, got {requires_all_reduce!r}")
        for bucket in _eager_state(self, "set_requires_all_reduce").buckets:
            bucket.grads.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by `factor` instead of the number of ranks (the
        mean; replicas included under HSDP); 1.0 sums them, for losses already
        normalised over all ranks (as torchtitan's)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"set_gradient_divide_factor expects a number, got {factor!r}")
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be > 0, got {factor!r}; "
                             "use 1.0 to sum gradients or the world size to average them")
        buckets = _eager_state(self, "set_gradient_divide_factor").buckets
        held = [b.name for b in buckets if b.grads.partial_reduced is not None]
        if held and float(factor) != buckets[0].grads.gradient_divide_factor:
            raise ValueError(f"set_gradient_divide_factor: bucket(s) {held} hold reduced "
                             "gradients whose all-reduce set_requires_all_reduce(False) deferred, "
                             "scaled for the current factor; change the factor before the first "
                             "micro-batch or after the backward that all-reduces")
        for bucket in buckets:
            bucket.grads.gradient_divide_factor = float(factor)

    def set_reshard_after_forward(self, reshard_after_forward) -> None:
        """Whether every bucket frees its unsharded params after its module's
        forward (and regathers them in backward); the root bucket included. An
        int N keeps them sharded over groups of N consecutive shard ranks,
        where backward gathers (N must divide every bucket's shard group)."""
        check_reshard(reshard_after_forward, "set_reshard_after_forward: ")
        buckets = _eager_state(self, "set_reshard_after_forward").buckets
        values = [resolve_reshard(reshard_after_forward, b.world_size, b.name) for b in buckets]
        _check_between_steps(buckets, "set_reshard_after_forward")
        for bucket, value in zip(buckets, values):
            bucket.set_reshard_after_forward(value)  # re-plans what depends on it
            if bucket.gather.post_forward_size is not None:
                bucket.subgroups.of(bucket.rank, value)  # made now, by every member

    def set_prefetch_depth(self, depth: int) -> None:
        """How many buckets ahead (in recorded execution order) to launch
        gathers for, in forward and backward; 0 disables prefetching."""
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"set_prefetch_depth expects an int, got {depth!r}")
        if depth < 0:
            raise ValueError(f"set_prefetch_depth expects depth >= 0, got {depth}; "
                             "use 0 to disable prefetching")
        state = _eager_state(self, "set_prefetch_depth")
        state.prefetcher.drop_all()
        state.prefetcher.depth = depth

    def __deepcopy__(self, memo):
        raise TypeError(
            f"copy.deepcopy of a flex_shard-ed {type(self).__name__} is not supported: its "
            "buckets hold process groups and its params are this rank's shards. Deep-copy the "
            "model before flex_shard and wrap both alike (ema = copy.deepcopy(model); "
            "fs.flex_shard(model); fs.flex_shard(ema)); the copies' params are then the same "
            "shards, and an EMA updates them in place: with torch.no_grad(): "
            "torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)")

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"pickling a flex_shard-ed {type(self).__name__} (torch.save(model)) is not "
            "supported: its buckets hold process groups and its params are this rank's shards. "
            "Save its weights instead: torch.save(fs.full_state_dict(model), path) on rank 0, or "
            "fs.save_checkpoint(directory, model, optimizer, step) for a resumable checkpoint")

    def _apply(self, fn, recurse=True):
        """nn.Module._apply (to_empty, to, cuda, ...): the buckets' storage moves
        as one buffer each and the sharded params are re-viewed into it."""
        state = find_state(self)
        if state is None:
            return super()._apply(fn, recurse)
        were_meta = meta_buffers(self)
        apply_to_buckets(state, fn, lambda: super(FlexShardModule, self)._apply(fn, recurse))
        state.unset_buffers.track(self, were_meta)  # to_empty(): checked at the next forward
        return self

    def init_parameters(self, init_fn=None) -> None:
        """Initialise the sharded params and the buffers after to_empty(), one
        module at a time: each module's own params are materialised at full size,
        initialised by `init_fn(module)` (default: its reset_parameters()), and
        this rank keeps its piece; what `init_fn` writes to the module's buffers
        stays. `init_fn` runs in `module.apply(init_fn)`'s order (children first;
        a child's params it touches are made full too), reset_parameters() in
        modules() order, so with every rank seeded alike the values equal the
        unsharded model's after the same calls. A Hugging Face model passes its
        own: `init_parameters(model._init_weights)` (initialised as its own
        initialize_weights() does)."""
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_parameters expects a callable init_fn(module), got {init_fn!r}")
        state = get_state(self)
        with state.registration.pause():  # it registers full-size params one module at a time
            init_parameters(self, state, init_fn)

    def unshard(self, async_op: bool = False):
        """Gather every bucket and install the unsharded params on the modules,
        where they stay (forward uses them, no reshard after forward) until
        reshard(). With async_op=True returns a handle: its wait() completes it
        (the next forward waits by itself). Gradients still reach the shards."""
        if not isinstance(async_op, bool):
            raise TypeError(f"unshard expects async_op to be a bool, got {async_op!r}")
        state = _eager_state(self, "unshard")
        return unshard_explicitly([b for b in state.buckets if b.needs_hooks], async_op)

    def reshard(self) -> None:
        """Undo unshard(): the modules hold their sharded params again (also
        those a forward without a backward left unsharded)."""
        state = _eager_state(self, "reshard")
        try:
            reshard_explicitly(state.buckets)  # raises for writes to the held params
        finally:
            for hooks in state.hooks:
                hooks.reshard_kept()


def _held_params(state: Optional[FlexShardState]) -> dict:
    """id of each unsharded tensor a held bucket installed -> its sharded param."""
    if state is None:
        return {}
    return {id(module._parameters[attr]): param
            for bucket in state.buckets if bucket.held is not None
            for param, wiring in zip(bucket.params, bucket.wiring)
            for module, attr in wiring.aliases if module._parameters.get(attr) is not None}


def _eager_state(module: nn.Module, method: str) -> FlexShardState:
    """The state of a model its eager hooks run; fs.compile's graph fixes what
    these methods change (its gathers, reductions and their schedule)."""
    state = get_state(module)
    if state.whole_step:
        raise RuntimeError(
            f"{method}: this model was compiled whole with fs.compile, whose graph holds its "
            "gathers and gradient reductions as they were at that call; call it before "
            "fs.compile (for gradient accumulation, let every backward reduce: the grads "
            "sum in .grad)")
    return state


def _check_between_steps(buckets, setter: str) -> None:
    """A setter that re-plans buckets runs between steps: every bucket sharded."""
    for bucket in buckets:
        if bucket.state is not BucketState.SHARDED or bucket.held is not None:
            raise RuntimeError(
                f"{setter}: bucket {bucket.name!r} is {bucket.state.value}; call it between "
                "training steps (after backward, or after module.reshard())")
        if bucket.awaits_backward():
            raise RuntimeError(
                f"{setter}: bucket {bucket.name!r} has a forward whose backward has not run, "
                "and that backward regathers its params as they were planned; call it "
                "between training steps, after backward (run a forward that has no backward "
                "under torch.no_grad())")


def flex_shard(module: nn.Module, mesh: Optional[DeviceMesh] = None, *,
               buckets: Optional[Sequence[BucketSpec]] = None,
               placement: Placement = Shard(0),
               mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
               reshard_after_forward: Union[bool, int] = True,
               offload_policy: Optional[OffloadPolicy] = None,
               comm: Optional[Comm] = None) -> nn.Module:
    """Shard `module`'s parameters over a 1-D mesh, bucket by bucket; a 2-D
    mesh is HSDP (dim 0 replicates, dim 1 shards, as FSDP2).

    Returns the same module, now also a FlexShardModule. Outside forward and
    backward its parameters are this rank's local shards. With an
    `offload_policy` they live in CPU memory and the forward computes on the
    device the module's parameters are on now (see fs.OffloadPolicy). DTensor
    params (tensor parallelism over other dims of the mesh `mesh` was sliced
    from) are sharded by their local tensors and are DTensors again in forward.
    """
    _check_args(module, mesh, placement, mp_policy, reshard_after_forward, offload_policy)
    if mesh is None:
        _init_from_launcher(module)
    if dist.is_available() and dist.is_initialized():
        destroy_gloo_group_at_exit()  # a clean exit without destroy_process_group (teardown.py)
    specs = default_buckets(module) if buckets is None else check_specs(buckets)
    _check_bucket_meshes(specs, mesh)
    named = dict(module.named_parameters())
    check_params(named, allow_dtensor=True)
    check_modules(module)
    check_dtensor_params(named, mesh, _bucket_mesh_of(module, named, specs))
    local = to_local_params(module, named)  # DTensor params: their TP-local tensors
    try:
        _plan_and_build(module, mesh, local, specs, placement, mp_policy,
                        reshard_after_forward, offload_policy, comm, named)
    except BaseException:
        restore_params(local)
        raise
    module.__class__ = _wrapped_class(type(module))
    return module


def _plan_and_build(module, mesh, local, specs, placement, mp_policy, reshard_after_forward,
                    offload_policy, comm, originals: dict) -> None:
    named = local.named
    _, world_size = _rank_and_world(mesh)
    plan = plan_wrap(module, named, specs, placement, mp_policy, reshard_after_forward,
                     world_size, replicas=_replicas(mesh), note=shard_dim_note(() if mesh is None else tuple(mesh.shape)),
                     offload_policy=offload_policy, dtensors=frozenset(local.specs))
    device = _param_device(named)
    mesh = mesh if mesh is not None else _default_mesh(device, world_size)
    groups = mesh_groups(mesh) if mesh is not None else single_process()
    state = _new_state(groups, comm or comm_for(groups.shard_group))
    check_ranks_agree(plan, state.comm, groups)  # over flex_shard's mesh: TP ranks may hold other shapes
    if local.specs:  # checkpoints are written by every rank of the (dp, tp) mesh
        state.files_group, state.files_rank, _ = files_group(
            mesh, [spec.mesh for spec in local.specs.values()])
    _build(module, state, plan, named, device, local.specs, originals)
    attach_state(module, state)
    state.state_dict_hooks = StateDictHooks(module, state, OptimizerHooks(state))
    state.registration = RegistrationGuard(module, state.buckets)


def _refuse_ddp(module) -> None:
    """DistributedDataParallel reads this (DDP_IGNORED_NAMES) first thing on
    every rank: it would broadcast rank 0's shards over every rank's and mix the
    shards' grads, which trains silently wrong."""
    raise TypeError(
        f"a flex_shard model ({type(module).__name__}) was handed to torch's "
        "DistributedDataParallel (directly, or by Hugging Face's Trainer / accelerate or "
        "Lightning's DDP strategy when launched on several processes): DDP would copy "
        "rank 0's shards over every rank's and average different shards' gradients. "
        "flex_shard already averages the gradients over its ranks: train the model as it "
        "is, in your own loop or torchtitan's; for replicas across nodes give flex_shard "
        "a 2-D (replicate, shard) mesh (HSDP)")


setattr(FlexShardModule, DDP_IGNORED_NAMES, property(_refuse_ddp))


@functools.cache  # one class per original class, as FSDP2 does, not one per call
def _wrapped_class(cls: type) -> type:
    return type(f"FlexShard{cls.__name__}", (FlexShardModule, cls),
                {**synced_generate(cls, _spans_ranks),  # HF generate(): wrap/generation.py
                 **refused_methods(cls, _spans_ranks)})  # wrap/refused_methods.py


def _spans_ranks(module) -> bool:
    state = find_state(module)
    return state is not None and state.mesh_size > 1


def _check_args(module, mesh, placement, mp_policy, reshard_after_forward, offload_policy) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"flex_shard expects an nn.Module, got {type(module).__name__}")
    if find_state(module) is not None or isinstance(module, FlexShardModule):
        raise ValueError(f"{type(module).__name__} is already wrapped by flex_shard; "
                         "call flex_shard once, on the root module, with all its buckets")
    for name, sub in module.named_modules():
        if name and find_state(sub) is not None:
            raise ValueError(f"submodule {name!r} is already wrapped by flex_shard; "
                             "wrap only the root module, with one BucketSpec per group")
    inside = RegistrationGuard.name_in_wrapped_model(module)
    if inside is not None:
        raise ValueError(f"{type(module).__name__} is module {inside!r} of a model already "
                         "wrapped by flex_shard (its params are shards); call flex_shard once, "
                         "on the root module, with a BucketSpec for this module's params")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh is not None and mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in flex_shard's mesh of ranks "
                         f"{mesh.mesh.flatten().tolist()}: build the mesh from every rank that "
                         "trains this model (init_device_mesh over the world), and do not call "
                         "flex_shard on ranks outside it")
    if mesh is not None and mesh.ndim not in (1, 2):
        raise ValueError(f"mesh must be 1-D (shard) or 2-D (HSDP: replicate, shard), got a "
                         f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; pass a slice such "
                         "as mesh['dp'] or mesh['dp_replicate', 'dp_shard']")
    check_options(placement, mp_policy, reshard_after_forward, offload_policy)


def _check_bucket_meshes(specs, mesh) -> None:
    """A BucketSpec's own mesh: 1-D or 2-D, holding this rank, its ranks among
    flex_shard's mesh's (the whole world when mesh is None)."""
    world = (set(mesh.mesh.flatten().tolist()) if mesh is not None
             else set(range(dist.get_world_size())) if dist.is_initialized() else {0})
    for spec in specs:
        own = spec.mesh
        if own is None:
            continue
        if own.ndim not in (1, 2):
            raise ValueError(f"bucket {spec.label!r}: its mesh must be 1-D (shard) or 2-D (HSDP: "
                             f"replicate, shard), got a {own.ndim}-D mesh of shape "
                             f"{tuple(own.shape)}; pass a slice such as mesh['ep_shard']")
        ranks = set(own.mesh.flatten().tolist())
        if not ranks <= world:
            raise ValueError(f"bucket {spec.label!r}: its mesh holds rank(s) "
                             f"{sorted(ranks - world)} outside flex_shard's mesh of ranks "
                             f"{sorted(world)}; a bucket's mesh must be a sub-mesh or flattening "
                             "of flex_shard's")
        if own.get_coordinate() is None:
            raise ValueError(f"bucket {spec.label!r}: this rank ({dist.get_rank()}) is not in its "
                             f"mesh of ranks {sorted(ranks)}; every rank wraps the same buckets, "
                             "each passing the bucket-mesh slice that holds it (e.g. "
                             "mesh['ep_shard'])")


_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # torchrun sets them


def _init_from_launcher(module: nn.Module) -> None:
    """Launched by torchrun (or a launcher setting its variables) with no
    process group: initialise the default one from the environment, as FSDP2's
    fully_shard does, with the backend of the params' device (gloo on CPU, NCCL
    on CUDA, torch's default pair otherwise), instead of each rank training
    its own replica."""
    if not dist.is_available() or dist.is_initialized():
        return
    if not all(key in os.environ for key in _LAUNCHER_ENV):
        return
    devices = {p.device.type for p in module.parameters()}
    backend = {"cpu": "gloo", "cuda": "nccl"}.get(devices.pop()) if len(devices) == 1 else None
    dist.init_process_group(backend)


def _bucket_mesh_of(module: nn.Module, named: dict, specs) -> dict:
    """FQN -> its BucketSpec's own mesh, for the params in buckets that have one."""
    members = assign_params(list(named), specs, alias_names(module))
    return {fqn: spec.mesh for spec, fqns in zip(specs, members) if spec.mesh is not None
            for fqn in fqns}


def _rank_and_world(mesh) -> tuple:
    """This rank and the size of the group that shards (mesh dim 1 under HSDP)."""
    if mesh is not None:
        return mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _param_device(named: dict) -> torch.device:
    devices = {p.device for p in named.values()}
    if len(devices) > 1:
        where = {str(d): next(f for f, p in named.items() if p.device == d) for d in devices}
        raise ValueError(f"parameters live on several devices {where}; move the module to one "
                         "device (or the meta device) before flex_shard")
    return devices.pop()


def _default_mesh(device: torch.device, world_size: int) -> Optional[DeviceMesh]:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    device_type = device.type
    if device_type == "meta":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world_size,))


def _new_state(groups: MeshGroups, comm: Comm) -> FlexShardState:
    return FlexShardState(groups.mesh, groups.shard_group, groups.shard_rank, groups.shard_size,
                          comm, replicate_group=groups.replicate_group,
                          replicate_size=groups.replicate_size, mesh_group=groups.mesh_group,
                          mesh_rank=groups.mesh_rank, mesh_size=groups.mesh_size, groups=groups,
                          unset_buffers=UnsetBuffers())


def _replicas(mesh) -> int:
    return 1 if mesh is None or mesh.ndim == 1 else mesh.size(0)


def _build(module, state, plan: WrapPlan, named: dict, device, tp_specs: dict,
           originals: dict) -> None:
    """The runtime of `plan`: buckets filled with this rank's pieces and installed
    on their modules, forward hooks on each running module and on the root.
    `tp_specs`: FQN -> TPSpec of the params that were DTensors; `originals`: FQN ->
    the user's Parameter objects, which become the sharded params where they can."""
    state.prefetcher, reduce_queue = Prefetcher(), ReduceQueue()
    devices = DeviceContexts()  # one set of streams per device, shared by the buckets
    reduce_queue.listeners.append(state.prefetcher.end_backward)
    agreement = RankAgreement(state.buckets, state.mesh_group, state.prefetcher)
    by_runner: dict = {}
    for planned in plan.buckets:
        groups = _bucket_groups(state, planned.spec.mesh)
        bucket = Bucket(planned.spec.label, planned.slots, planned.trainable, planned.mp_policy,
                        planned.reshard_after_forward, groups.shard_group, groups.shard_rank,
                        groups.shard_size, state.comm, device, devices,
                        replicate_group=groups.replicate_group,
                        replicate_size=groups.replicate_size,
                        subgroups=_subgroups(state, groups.shard_group),
                        divide_factor=state.mesh_size,
                        offload_policy=planned.offload_policy)
        bucket.mesh = groups.mesh
        bucket.on_sub_mesh = groups.shard_size * groups.replicate_size < state.mesh_size
        if bucket.gather.post_forward_size is not None:
            bucket.subgroups.of(bucket.rank, bucket.gather.post_forward_size)  # made now, by every member
        bucket.load_full(lambda fqn: named[fqn].detach())
        bucket.adopt([originals[slot.fqn] for slot in planned.slots])
        bucket.reduce_queue = reduce_queue
        bucket.used_in_nested_runner = planned.used_in_nested_runner
        bucket.above_owners = planned.above_owners
        bucket.needs_hooks = planned.needs_hooks
        tps = slot_specs(planned.slots, tp_specs) or (None,) * len(planned.slots)
        bucket.wire([SlotWiring(aliases, tp, norm_groups(bucket, i, tp, state.mesh_group,
                                                         agreement)
                                if i in bucket.grad_slots else None)
                     for i, (aliases, tp) in enumerate(zip(planned.aliases, tps))])
        state.buckets.append(bucket)
        if planned.needs_hooks:
            by_runner.setdefault(id(planned.runner), (planned.runner, []))[1].append(bucket)
    reduce_queue.listeners += [bucket.backward_ended for bucket in state.buckets]
    eager_compiled = EagerCompiledBlocks()  # one warning per model
    for runner, buckets in by_runner.values():
        state.hooks.append(ModuleHooks(runner, buckets, state.prefetcher, eager_compiled,
                                       checkpoint_wrappers(module, runner)))
    if by_runner:
        state.root_hooks = RootHooks(module, state.prefetcher, reduce_queue, state.buckets,
                                     agreement)
    if id(module) in by_runner:
        names = {id(sub): name for name, sub in module.named_modules()}
        state.root_hooks.stray = StrayCallHooks(module, by_runner[id(module)][1], names)


def _bucket_groups(state, mesh) -> MeshGroups:
    """The groups a bucket's collectives run on: its own mesh's, else flex_shard's."""
    if mesh is None:
        return state.groups
    if id(mesh) not in state.bucket_meshes:  # one set of groups per mesh
        state.bucket_meshes[id(mesh)] = (mesh, mesh_groups(mesh))
    return state.bucket_meshes[id(mesh)][1]


def _subgroups(state, shard_group) -> Subgroups:
    """One Subgroups per shard group (int reshard's post-forward groups)."""
    key = id(shard_group)
    if key not in state.subgroups:
        state.subgroups[key] = Subgroups(shard_group)
    return state.subgroups[key]
