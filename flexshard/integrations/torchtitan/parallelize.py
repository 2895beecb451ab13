"""A torchtitan parallelize function for its decoders (Llama 3, Qwen3 dense and MoE,
DeepSeek-V3) that applies flex_shard instead of fully_shard.

Same signature as torchtitan's `parallelize_llama` / `parallelize_qwen3`, so it drops
into a `ModelSpec`. The token embeddings, one bucket per TransformerBlock and a root
bucket (final norm, LM head), as torchtitan's `apply_fsdp_to_decoder` groups them; with expert
parallelism (`--parallelism.expert_parallel_degree` > 1) torchtitan's own EP plan makes
each MoE block's routed experts DTensors over `ep`, and they go in a bucket of their
own over the `efsdp` mesh (its `edp` mesh: `dp_replicate` x `efsdp` under HSDP), the
rest of the block over `fsdp`. Mixed precision and reshard-after-forward come from
torchtitan's own `training` and `parallelism` sections; the placement from
`FlexShardConfig`.
`--compile.enable` (with "model" in `--compile.components`) compiles each
TransformerBlock as torchtitan does, after activation checkpointing and before
sharding; flex_shard's hooks then run eagerly around each compiled block. With
activation checkpointing the block inside each AC wrapper is compiled, not the
wrapper; with expert parallelism a MoE block's pieces around its routed experts
(see `_CompiledBlocks`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch.nn as nn
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as titan_parallel_dims
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
from torchtitan.protocols.module import Module as TitanModule

import flexshard as fs

from ...compat import persistent_buffer_names
from ...runtime.compiled import check_cpp_compiler
from .config import FlexShardConfig


def llama_buckets(model: nn.Module, reshard_after_forward: bool, expert_mesh=None,
                  reshard_root: bool = False) -> list:
    """The buckets torchtitan's `apply_fsdp_to_decoder` makes FSDP groups of: the token
    embeddings (resharded as the blocks), one bucket per block of `model.layers`, then
    a root bucket for the rest (final norm, LM head; the embeddings too where the LM
    head shares their weight), which stays unsharded from forward to backward (backward
    needs it at once) unless `reshard_root` (torchtitan's "always" policy). With
    `expert_mesh` (expert parallelism) each MoE block's routed experts get a bucket of
    their own on it, named `layers.<i>.experts`.
    """
    named = list(model.named_parameters())  # as flex_shard names them (AC wrappers included:
    embedding = _embedding_bucket(model, named, reshard_after_forward)  # theirs drop them)
    specs = list(embedding)
    for name, block in model.layers.named_children():
        experts = _routed_experts(block) if expert_mesh is not None else None
        if experts is None:
            specs.append(fs.BucketSpec(f"layers.{name}.*", name=f"layers.{name}",
                                       reshard_after_forward=reshard_after_forward))
            continue
        expert_ids = {id(q) for q in experts.parameters()}
        own = [(fqn, p) for fqn, p in named if fqn.startswith(f"layers.{name}.")]
        inner = {fqn for fqn, p in own if id(p) in expert_ids}
        dense = [fqn for fqn, _ in own if fqn not in inner]
        specs += [fs.BucketSpec(dense, name=f"layers.{name}",
                                reshard_after_forward=reshard_after_forward),
                  fs.BucketSpec(sorted(inner), name=f"layers.{name}.experts",
                                mesh=expert_mesh, reshard_after_forward=reshard_after_forward)]
    taken = {fqn for spec in embedding for fqn in spec.patterns}
    rest = [fqn for fqn, _ in named if not fqn.startswith("layers.") and fqn not in taken]
    if rest:
        specs.append(fs.BucketSpec(rest, name="root", reshard_after_forward=reshard_root))
    return specs


def _embedding_bucket(model: nn.Module, named: list, reshard_after_forward: bool) -> list:
    """[the token embeddings' BucketSpec], or [] where there are none (a later pipeline
    stage) or the LM head shares their weight (tied: both stay in the root bucket)."""
    embeddings = getattr(model, "tok_embeddings", None)
    if embeddings is None:
        return []
    own = {id(p) for p in embeddings.parameters()}
    fqns = [fqn for fqn, p in named if id(p) in own]
    tied = any(id(p) in own for m in model.modules() if m is not embeddings
               for p in m.parameters(recurse=False))
    if not fqns or tied:
        return []
    return [fs.BucketSpec(fqns, name="tok_embeddings", reshard_after_forward=reshard_after_forward)]


def _unsupported(parallel_dims: ParallelDims, parallelism: ParallelismConfig) -> list:
    """The torchtitan options flex_shard does not compose with, as CLI flags."""
    checks = [(parallelism.enable_fsdp_symm_mem, "--parallelism.enable_fsdp_symm_mem")]
    return [flag for bad, flag in checks if bad]


def check_job(parallel_dims: ParallelDims, parallelism: ParallelismConfig) -> None:
    """Refuse, before the model is touched, what parallelize_decoder cannot honour."""
    if parallel_dims.cp_enabled:
        # measured with torch 2.13 CPU, gloo, 2 ranks: torchtitan's ScaledDotProductAttention
        # under its apply_cp_to_forward, forward + backward (tests/test_torchtitan_cp.py)
        raise NotImplementedError(
            f"--parallelism.context_parallel_degree {parallel_dims.cp}: flexshard's torchtitan "
            "parallelize does not shard over the cp mesh, because torch's context parallelism "
            "could not be run to test it: on CPU its SDPA dispatch raises NotImplementedError "
            "'Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have "
            "a sharding strategy registered' (and the math SDPA backend does not finish). Set "
            "--parallelism.context_parallel_degree 1 and give those ranks to dp_shard")
    if parallel_dims.tp > 1 and parallel_dims.dp_shard == 1:
        raise NotImplementedError(
            f"--parallelism.tensor_parallel_degree {parallel_dims.tp} with "
            "--parallelism.data_parallel_shard_degree 1: flex_shard shards the TP blocks over "
            "the fsdp mesh, which then holds 1 rank; give dp_shard 2 or more ranks (fewer to "
            "tensor_parallel_degree or data_parallel_replicate_degree), or train this layout "
            "with torchtitan's own FSDP2")
    unsupported = _unsupported(parallel_dims, parallelism)
    if unsupported:
        raise NotImplementedError(
            "flexshard's torchtitan parallelize supports data parallelism (fsdp, and "
            "dp_replicate as HSDP), tensor, expert and pipeline parallelism only; drop "
            f"{', '.join(unsupported)}")
    if parallelism.spmd_backend != "partial_dtensor":
        raise NotImplementedError(
            f"--parallelism.spmd_backend {parallelism.spmd_backend}: flex_shard's sharded "
            "parameters are plain tensors, which only torchtitan's partial_dtensor backend "
            "accepts; pass --parallelism.spmd_backend partial_dtensor (the flexshard_* "
            "experiment configs set it)")


def _check_flex_shard(flex_shard: Optional[FlexShardConfig]) -> None:
    if flex_shard is None:
        raise ValueError(
            "parallelize_decoder: flex_shard is None, so the job config's --flex_shard "
            "section (its placement) would be dropped; pass flex_shard=config.flex_shard "
            "(FlexShardTrainer does), or flex_shard=FlexShardConfig() for Shard(0)")


def parallelize_decoder(model: nn.Module, *, parallel_dims: ParallelDims,
                        training: TrainingConfig, parallelism: ParallelismConfig,
                        compile_config: CompileConfig, ac_config, dump_folder: str,
                        flex_shard: Optional[FlexShardConfig] = None) -> nn.Module:
    """Apply tensor and expert parallelism and activation checkpointing (if
    configured), then flex_shard over the fsdp mesh (routed experts over efsdp),
    to a torchtitan decoder (or one pipeline stage of it). `flex_shard` is the job
    config's `--flex_shard` section (required: a placement flag is never dropped).
    `--training.enable_cpu_offload` becomes `fs.OffloadPolicy()`.

    Gradients are summed over ranks, not averaged: torchtitan's loss is already
    divided by the global token count (FSDP2 there runs with divide factor 1 too).
    """
    check_job(parallel_dims, parallelism)
    compiled = compile_config.enable and "model" in compile_config.components
    if compiled:  # before touching the model; the device is the one torchtitan trains on
        check_cpp_compiler(titan_parallel_dims.device_type, compile_config.backend)
    _check_flex_shard(flex_shard)
    placement = flex_shard.build_placement()
    if parallel_dims.tp_enabled or parallel_dims.ep_enabled:
        model.parallelize(parallel_dims)  # torchtitan's plans: DTensor params on "tp" / "ep"
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compiled:
        # torchtitan's own per-block compile (block.compile(fullgraph=True)), before
        # sharding as torchtitan orders it; under AC of the blocks inside the wrappers,
        # under EP of each MoE block's pieces around its experts' bucket
        whole = ac_config is None and not parallel_dims.ep_enabled
        apply_compile(model if whole else _CompiledBlocks(model, parallel_dims.ep_enabled),
                      compile_config=compile_config, parallel_dims=parallel_dims)
    reshard = get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward,
                                                    parallel_dims.pp_enabled)
    mp = fs.MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                                 reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
                                 cast_forward_inputs=False)
    mesh = _dp_mesh(parallel_dims)
    on_meta = any(p.is_meta for p in model.parameters())
    buckets = llama_buckets(model, reshard, _edp_mesh(parallel_dims),
                            reshard_root=parallelism.fsdp_reshard_after_forward == "always")
    offload = fs.OffloadPolicy() if training.enable_cpu_offload else None  # FSDP2's CPUOffloadPolicy()
    model = fs.flex_shard(model, mesh, buckets=buckets, placement=placement, mp_policy=mp,
                          reshard_after_forward=reshard, offload_policy=offload)
    model.set_gradient_divide_factor(1.0)
    if on_meta:
        # torchtitan's Trainer calls model.to_empty(...) and then model.init_weights(...).
        # Its own init_weights would initialise each rank's shard with the same RNG
        # stream; this one initialises each module's parameters at full size and keeps
        # this rank's piece, as the unsharded model would be initialised.
        model.init_weights = functools.partial(init_weights, model, offloaded=offload is not None)
    return model


class _CompiledBlocks(nn.Module):
    """What apply_compile compiles when a block holds modules that will carry
    flex_shard's hooks: the largest pieces of each block with no such module inside.
    A fullgraph compile traces the calls a block makes of its submodules, hooks
    included, and our hooks run eagerly only (runtime/compiled.py). Under activation
    checkpointing that is the block inside each wrapper: the wrapper runs eagerly
    around it, and the block's gather recomputes with it under the AC. Under expert
    parallelism (`experts`) a MoE block's routed experts are a bucket of their own,
    hooked inside the block: its attention, norms, router and shared experts are
    compiled each, and the routed experts' grouped GEMMs inside their hooks; the
    block's glue and torchtitan's token dispatch (its all-to-all) run eagerly."""

    def __init__(self, model: nn.Module, experts: bool) -> None:
        super().__init__()
        pieces = {}
        for name, wrapper in model.layers.named_children():
            block = _inner_block(wrapper)
            routed = _routed_experts(block) if experts else None
            hooked = set() if routed is None else {id(routed)}
            for path, piece in _pieces(block, hooked):
                pieces["_".join([name, *path])] = piece
        self.layers = nn.ModuleDict(pieces)


def _pieces(module: nn.Module, hooked: set, path: tuple = ()):
    """(path, module) for the largest submodules of `module` (itself if it can be)
    with no module of `hooked` (ids) strictly inside them."""
    if not any(id(m) in hooked for m in list(module.modules())[1:]):
        yield path, module
        return
    for name, child in module.named_children():
        yield from _pieces(child, hooked, (*path, name))


def _inner_block(module: nn.Module) -> nn.Module:
    """The module a wrapper holds: down through modules with one child and no
    params of their own (torchtitan's AC wrapper is one such)."""
    while len(list(module.children())) == 1 and not list(module.parameters(recurse=False)):
        module = next(module.children())
    return module


parallelize_llama = parallelize_decoder  # the name torchtitan's Llama 3 spec uses


def _routed_experts(block: nn.Module):
    """A MoE block's grouped experts (torchtitan's `moe.routed_experts.inner_experts`)."""
    if not getattr(block, "moe_enabled", False):
        return None
    return block.moe.routed_experts.inner_experts


def _edp_mesh(parallel_dims: ParallelDims):
    """The routed experts' data-parallel mesh under expert parallelism (None without):
    efsdp, or (dp_replicate, efsdp) under HSDP, as torchtitan's apply_fsdp_to_decoder."""
    if not parallel_dims.ep_enabled:
        return None
    if parallel_dims.dp_replicate_enabled:
        return parallel_dims.get_mesh(["dp_replicate", "efsdp"])
    return parallel_dims.get_mesh("efsdp")


def _dp_mesh(parallel_dims: ParallelDims):
    """torchtitan's data-parallel mesh: (dp_replicate, fsdp) is HSDP (dim 0
    replicates, dim 1 shards), as torchtitan hands fully_shard; else fsdp."""
    if parallel_dims.world_size == 1:
        return None
    if parallel_dims.dp_replicate_enabled:
        return parallel_dims.get_mesh(["dp_replicate", "fsdp"])
    return parallel_dims.get_mesh("fsdp")


def _init_own_parameters(module: nn.Module) -> None:
    if isinstance(module, TitanModule):
        module._init_self_parameters()  # the module's param_init, or reset_parameters
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def init_weights(model: nn.Module, *, buffer_device=None, offloaded: bool = False, **_) -> None:
    """torchtitan's `init_weights` for a flex-sharded model (after `to_empty`): every
    module's own parameters by its `param_init`, at full size, one module at a time
    (flex_shard's `init_parameters`); then every module's buffers (RoPE caches) as
    torchtitan initialises them."""
    if offloaded and buffer_device is not None:
        # torchtitan's CPU offload calls to_empty(device="cpu") and names the compute
        # device as buffer_device: .to() moves flex_shard's compute device (and the
        # buffers) there; the offloaded storage stays in host memory
        model.to(buffer_device)
    model.init_parameters(_init_own_parameters)
    for module in model.modules():
        if isinstance(module, TitanModule):
            _init_own_buffers(module, buffer_device)


def _init_own_buffers(module: TitanModule, buffer_device) -> None:
    """The module's buffers as torchtitan's `init_states` makes them: its
    `_init_self_buffers` assigns plain tensors (RoPE caches, a MoE's expert bias),
    and a buffer that was a DTensor (Replicate over tp under tensor parallelism) is
    distributed again as it was, or the forward mixes DTensors with plain tensors."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    was = {name: (buf.device_mesh, buf.placements) for name, buf in module._buffers.items()
           if isinstance(buf, DTensor)}
    persistent = set(persistent_buffer_names(module))
    with module._preserve_buffer_spmd_types():
        module._init_self_buffers(buffer_device=buffer_device)
    for name, (mesh, placements) in was.items():
        buf = module._buffers.get(name)
        if buf is not None and not isinstance(buf, DTensor):
            module.register_buffer(name, distribute_tensor(buf, mesh, list(placements)),
                                   persistent=name in persistent)
