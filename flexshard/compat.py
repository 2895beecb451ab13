"""Every private torch API flexshard relies on, and every torch name that differs
between the releases it supports, resolved in one place.

flexshard leans on a few torch internals (non-reentrant checkpoint's
generator, the dispatch-mode stack, autograd's graph-task id, ...). Each is
looked up here when flexshard is imported, so a torch that renamed or removed
one fails at import with an ImportError naming the symbol and what flexshard
uses it for, never mid-training. Names torch renamed inside TORCH_RANGE
(`resolve_first`) are looked up newest spelling first, so each supported torch
runs its own current name (an old one may warn as deprecated). A torch outside the releases flexshard was written for warns once. tests/test_compat.py checks that each symbol resolves
and still behaves as flexshard expects; nothing else in flexshard touches a
private torch name.
"""

from __future__ import annotations

import importlib
import operator
import warnings

import torch

# [first, past-last) torch releases flexshard was written for: 2.13 in CI, 2.11's API
# surface by tests/test_compat.py's name-removal test, 2.11 and 2.14 run by hand.
TORCH_RANGE = ((2, 11), (2, 16))


def _release(version: str) -> tuple:
    """(major, minor) of a torch version string such as '2.13.0+cpu'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _range_text() -> str:
    (a, b), (c, d) = TORCH_RANGE
    return f"torch>={a}.{b},<{c}.{d}"


def check_torch_version(version: str = torch.__version__) -> bool:
    """Warn (once per call site) when `version` is outside TORCH_RANGE; True when inside."""
    inside = TORCH_RANGE[0] <= _release(version) < TORCH_RANGE[1]
    if not inside:
        warnings.warn(f"flexshard was written for {_range_text()} and torch is {version}; "
                      "its private torch APIs (flexshard/compat.py) resolved, but their "
                      "behaviour may have changed: run flexshard's tests/test_compat.py",
                      stacklevel=2)
    return inside


def resolve(path: str, used_for: str):
    """The object at `path` ("module:attr.attr"), or ImportError naming it."""
    module_name, _, attrs = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for attr in attrs.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"flexshard needs torch's private {path} ({used_for}), which torch "
                          f"{torch.__version__} does not have ({e}); flexshard was written for "
                          f"{_range_text()}: install such a torch, or port flexshard/compat.py"
                          ) from None
    return obj


def resolve_first(paths: tuple, used_for: str):
    """The object at the first of `paths` torch has (a renamed name: newest spelling
    first), or ImportError naming them all."""
    for path in paths:
        try:
            return resolve(path, used_for)
        except ImportError:
            pass
    raise ImportError(f"flexshard needs one of torch's {' / '.join(paths)} ({used_for}), none "
                      f"of which torch {torch.__version__} has; flexshard was written for "
                      f"{_range_text()}: install such a torch, or port flexshard/compat.py")


def _tensor_attr(attr: str, used_for: str) -> str:
    """`attr` when tensors have it, else ImportError naming it."""
    resolve(f"torch._C:TensorBase.{attr}", used_for)
    return attr


check_torch_version()

# The flat-buffer collectives (runtime/comm.py, the bucket gather and gradient
# reduce-scatter): torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor
# to all_gather_single / reduce_scatter_single and made the old names aliases that
# warn (FutureWarning); 2.11 and 2.12 have only the old ones. Same arguments.
all_gather_single = resolve_first(
    ("torch.distributed:all_gather_single", "torch.distributed:all_gather_into_tensor"),
    "to all-gather a bucket's flat buffer")
reduce_scatter_single = resolve_first(
    ("torch.distributed:reduce_scatter_single", "torch.distributed:reduce_scatter_tensor"),
    "to reduce-scatter a bucket's flat gradient buffer")
# A bucket's gather groups (planning/layout.py) are one collective each, launched as
# one: all_gather_single / reduce_scatter_single calls inside it become one
# coalesced op (c10d's allgather_into_tensor_coalesced_ / reduce_scatter_tensor_coalesced_:
# one NCCL group, gloo's and the fake backend's own); its `.wait()` waits for all.
coalescing_manager = resolve("torch.distributed.distributed_c10d:_coalescing_manager",
                             "to launch a bucket's per-group collectives as one")

# Activation checkpointing (runtime/hooks.py): the saved-tensors hooks on top of
# the stack, None when none are active.
top_saved_tensors_default_hooks = resolve(
    "torch._C._autograd:_top_saved_tensors_default_hooks",
    "to skip the recompute region inside a user's activation checkpoint")


# Selective checkpointing's dispatch modes (forward and recompute).
SAC_MODES = (
    resolve("torch.utils.checkpoint:_CachingTorchDispatchMode",
            "to hide bucket gathers from selective activation checkpointing"),
    resolve("torch.utils.checkpoint:_CachedTorchDispatchMode",
            "to hide bucket gathers from selective activation checkpointing"),
)

# The dispatch-mode stack (runtime/bucket.py: gathers launched outside SAC's modes).
len_torch_dispatch_stack = resolve("torch._C:_len_torch_dispatch_stack",
                                   "to read the dispatch-mode stack")
get_dispatch_stack_at = resolve("torch._C:_get_dispatch_stack_at",
                                "to read the dispatch-mode stack")
push_mode = resolve("torch.utils._python_dispatch:_push_mode", "to rebuild the dispatch-mode stack")
pop_mode = resolve("torch.utils._python_dispatch:_pop_mode", "to rebuild the dispatch-mode stack")

# Autograd's engine (runtime/grad_reduce.py): -1 outside backward, else the running
# graph task; callbacks queued on the engine run when that backward pass ends.
current_graph_task_id = resolve("torch._C:_current_graph_task_id",
                                "to tell forward from a recompute inside backward")
queue_callback = resolve("torch.autograd:Variable._execution_engine.queue_callback",
                         "to finish gradient reductions when a backward pass ends")
will_engine_execute_node = resolve("torch._C:_will_engine_execute_node",
                                   "to tell .backward() from autograd.grad in a no-sync pass")


def accumulates_into_grad(leaf: torch.Tensor) -> bool:
    """Whether the backward pass running now accumulates into `leaf`'s .grad
    (Tensor.backward, torch.autograd.backward), not torch.autograd.grad, which
    returns the grads and leaves .grad alone. Asked of a leaf's AccumulateGrad
    node under autograd.grad, torch raises ("... running autograd.grad()"): that
    answers too."""
    with torch.enable_grad():
        node = leaf.view_as(leaf).grad_fn.next_functions[0][0]
    try:
        return will_engine_execute_node(node)
    except RuntimeError as e:
        if "autograd.grad" not in str(e):
            raise
        return False

# Tensors.
# A bucket's fused copies (planning/fused.py, FSDP2's _fsdp_collectives.py): one
# kernel per bucket and direction. foreach_copy_ copies (and casts) pairs of equal
# shapes; chunk_cat (below) with n chunks writes chunk k of each tensor's dim 0
# (torch.chunk sizes, zero-padded) into row k of out, back to back, cast.
foreach_copy_ = resolve("torch:_foreach_copy_", "to copy a bucket's pieces in one op")
foreach_zero_ = resolve("torch:_foreach_zero_", "to zero a reduce input's gaps in one op")
tree_map = resolve("torch.utils._pytree:tree_map", "to cast forward inputs and outputs")
make_wrapper_subclass = resolve(  # checkpoint/pieces.py: ShardedPieces holds no full tensor
    "torch:Tensor._make_wrapper_subclass", "to build ShardedPieces for DCP")
# Inside a __torch_function__ subclass's handler (runtime/sharded_grad.py): ops run as
# on plain tensors and return plain tensors (the extending-torch docs' idiom).
plain_torch_function = resolve("torch._C:DisableTorchFunctionSubclass",
                               "to run ops on sharded grads as on plain tensors")
# torch.amp.GradScaler's check of its grads (every device kind): unscales them in place
# and sets found_inf to 1 where one holds an inf or NaN; sharded_grad.py makes the flag
# the same on the ranks holding the other pieces, as DTensor's handler of it does.
amp_unscale_ = resolve("torch:_amp_foreach_non_finite_check_and_unscale_",
                       "to skip a GradScaler step on every rank when one rank's grads overflow")

# DTensor's wrapper takes its local tensor's storage offset; a wrapper whose offset is
# not 0 has a nonzero data_ptr, so torch.save and DCP's stager read its (invalid)
# storage. checkpoint/pieces.py builds state-dict DTensors on a stand-in local with
# offset 0, then points them at the real local tensor (DTensor's own attribute).
DTENSOR_LOCAL = "_local_tensor"
DTENSOR_SPEC = "_spec"


def dtensor_spec(dtensor):
    """`dtensor`'s DTensorSpec (mesh, placements, global shape and stride)."""
    return getattr(dtensor, DTENSOR_SPEC)


def set_dtensor_local(dtensor, local: torch.Tensor) -> None:
    """Make `local` the local tensor of `dtensor` (same shape, dtype and device)."""
    setattr(dtensor, DTENSOR_LOCAL, local)


# A tensor's version counter, shared by views: bumped by every in-place write.
VERSION = _tensor_attr("_version", "to notice writes to the sharded params since a gather launched")
# The hooks register_post_accumulate_grad_hook added, carried to a re-created param.
POST_ACCUMULATE_GRAD_HOOKS = _tensor_attr("_post_accumulate_grad_hooks",
                                          "to keep post-accumulate-grad hooks across to()/to_empty()")


# tensor_version(t): `t`'s version counter (shared with its views and base); a C
# getter, as the step reads it on every gather.
tensor_version = operator.attrgetter(VERSION)


# A bucket's unsharded params live in storages made once (runtime/unsharded.py):
# a gather refills them in place while autograd holds them for backward, so the
# refill must not bump their version counters (FSDP2 does the same). An async
# gather may write its output when it completes (gloo copies it in its worker
# thread): the version it had at launch is set back once it is waited for.
preserve_versions = resolve("torch.autograd:_unsafe_preserve_version_counter",
                            "to refill unsharded params autograd saved, unseen by its version check")
set_versions = resolve("torch._C._autograd:_unsafe_set_version_counter",
                       "to refill unsharded params autograd saved, unseen by its version check")


# Device meshes (planning/tensor_parallel.py): the mesh a slice such as mesh["tp"] was
# cut from, to tell whether a DTensor param's mesh and flex_shard's share one root.
_get_root_mesh = resolve("torch.distributed.device_mesh:DeviceMesh._get_root_mesh",
                         "to check that a DTensor param's mesh and flex_shard's mesh share a root")


def root_mesh(mesh):
    """The DeviceMesh `mesh` was sliced from (itself for a root mesh)."""
    return _get_root_mesh(mesh)


# DTensor's side of DCP's protocol (planning/tensor_parallel.py): its one chunk says
# where this rank's local tensor lies in the global tensor, for any placements.
DTENSOR_CHUNKS = "__create_chunk_list__"


def dtensor_local_offsets(dtensor) -> tuple:
    """Where `dtensor`'s local tensor starts in the global one, per dim."""
    return tuple(getattr(dtensor, DTENSOR_CHUNKS)()[0].offsets)


# Meta-device init (checkpoint/materialize.py): a full-shape stand-in on the meta device
# for a param an ancestor's init may touch, a leaf that requires grad as the param does.
make_subclass = resolve("torch._C:TensorBase._make_subclass",
                        "to stand in for the params a module's init may reach into")


# Modules (checkpoint/state_dict.py): the names of a module's buffers that stay out
# of its state dict (register_buffer(..., persistent=False)).
_NON_PERSISTENT = "_non_persistent_buffers_set"


def persistent_buffer_names(module) -> list:
    """Names of `module`'s own buffers that its state dict holds."""
    skip = getattr(module, _NON_PERSISTENT)
    return [name for name, buf in module._buffers.items() if buf is not None and name not in skip]


# State-dict names (wrap/names.py): the attribute through which torch's checkpoint_wrapper
# holds the module it wraps, which its state-dict hooks, FSDP's and DSD's get_state_dict
# leave out of the keys; and the one through which torch.compile's OptimizedModule holds
# its module, which DSD leaves out. OptimizedModule is resolved when a name goes through
# `_orig_mod` (dynamo is imported by then; importing it for nothing costs seconds).
CHECKPOINT_WRAPPED_MODULE = resolve(
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:_CHECKPOINT_WRAPPED_MODULE",
    "to name a checkpoint_wrapper-ed block's params as its state_dict() does")
COMPILED_ORIG_MOD = "_orig_mod"
OPTIMIZED_MODULE = "torch._dynamo.eval_frame:OptimizedModule"


def is_compiled_wrapper(module) -> bool:
    """Whether `module` is torch.compile's OptimizedModule (a compiled module's wrapper)."""
    return isinstance(module, resolve(OPTIMIZED_MODULE, "to name a torch.compile-d block's "
                                                        "params as DSD's get_state_dict does"))


# torch.compile on CPU (runtime/compiled.py): the C++ compilers inductor searches,
# read when asked (the CXX environment variable sets it at import). Resolved on
# first use, not at import: importing inductor costs about 0.5 s, paid only by
# users who compile.
INDUCTOR_CPP = "torch._inductor.config:cpp"


def inductor_cpp_compilers() -> tuple:
    """The C++ compilers inductor tries on CPU, in order (None: conda's gcc, which
    inductor installs only when TORCH_INDUCTOR_INSTALL_GXX is set)."""
    cxx = resolve(INDUCTOR_CPP, "to check that inductor will find a C++ compiler before "
                                "compiling on CPU").cxx
    return tuple(cxx) if isinstance(cxx, (list, tuple)) else (cxx,)


# nn.Module.compile() (runtime/compiled.py): the compiled call it stores on the module
# (None until compiled), and the autograd node a compiled graph's forward records
# (AOTAutograd's CompiledFunction), to tell a compiled run from an eager one.
COMPILED_CALL_IMPL = "_compiled_call_impl"
COMPILED_GRAPH_NODE = "CompiledFunctionBackward"


# torch.compile of the activation collectives (collectives/): torch 2.11's dynamo traces
# their autograd Functions (in-place c10d collectives inside) into graphs whose backward
# gives zero gradients (measured on CPU: shard_tensor, reduce_scatter_tensor); 2.13 traces
# them right. Before 2.13 they run eagerly inside a compiled region (a graph break).
TRACES_COLLECTIVE_FUNCTIONS = _release(torch.__version__) >= (2, 13)


# torch's functional collectives (fs.compile's graph: runtime/traced.py): ops dynamo
# traces into the graph, whose outputs a wait_tensor completes; their namespace, as the
# selective checkpoint policy sees it.
FUNCTIONAL_COLLECTIVES_NAMESPACE = "_c10d_functional"
functional_collectives = getattr(torch.ops, FUNCTIONAL_COLLECTIVES_NAMESPACE)


# fs.compile's bucket gathers (runtime/traced.py): a function dynamo puts in its graph as
# one call, traced by AOTAutograd alone (as make_fx traces: the Python runs once, on
# fake tensors), where dynamo would interpret its Python bytecode by bytecode; and the
# pytree registration that lets an object (a TracedBucket) be its constant argument.
# Resolved when fs.compile first needs them: they import dynamo (and inductor with it).
def nonstrict_trace(fn):
    """`fn` marked for dynamo's non-strict tracing."""
    return resolve_first(("torch.compiler:nonstrict_trace", "torch._dynamo:nonstrict_trace"),
                         "to trace fs.compile's bucket gathers without dynamo")(fn)


def register_constant(cls: type) -> None:
    """`cls` a pytree constant: an argument of a non-strict traced function."""
    resolve("torch.utils._pytree:register_constant",
            "to pass a TracedBucket to its non-strict traced gather")(cls)


# fs.compile's reshard checkpoint recomputes only the gathers, so a block's Python side
# effects (a KV cache update, `self.aux = ...`) belong to its one forward, as in eager. By
# default dynamo refuses them inside a checkpoint (eager checkpointing would replay them)
# and runs the block as an eager checkpoint that reruns its forward in backward.
def side_effects_once_under_checkpoint():
    """A context in which dynamo traces side effects in checkpointed regions and
    applies them once, in forward; a null context where torch lacks the option."""
    import contextlib

    config = importlib.import_module("torch._dynamo.config")
    option = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    if not hasattr(config, option):
        return contextlib.nullcontext()
    return config.patch(**{option: True})


# DistributedDataParallel.__init__ reads this attribute of the module it wraps
# (hasattr, then the names it lists are left alone), before any collective.
DDP_IGNORED_NAMES = "_ddp_params_and_buffers_to_ignore"

# nn.Module.load_state_dict(assign=True) sets this key in the local_metadata
# its load_state_dict pre-hooks receive.
ASSIGN_METADATA_KEY = "assign_to_params_buffers"

# torch.distributed.checkpoint's protocol for tensors that are not DTensors
# (checkpoint/pieces.py ShardedPieces implements it); DCP calls these from
# planner_helpers._create_write_items, _create_chunk_list and utils.find_tensor_shard.
DCP_PROTOCOL = ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")
DCP_CALLERS = (
    resolve("torch.distributed.checkpoint.planner_helpers:_create_write_items",
            "DCP's save planner, which calls ShardedPieces.__create_write_items__"),
    resolve("torch.distributed.checkpoint.planner_helpers:_create_chunk_list",
            "DCP's load planner, which calls ShardedPieces.__create_chunk_list__"),
    resolve("torch.distributed.checkpoint.utils:find_tensor_shard",
            "DCP's loader, which calls ShardedPieces.__get_tensor_shard__"),
)

# Fused ops over lists of tensors (placements/batch.py, float8.py): one kernel for a
# bucket's params on a GPU. _chunk_cat joins tensors of any shapes, flattened, into
# `out` (cast to out's dtype inside: FSDP2's reduce-scatter copy-in); _foreach_norm
# with ord=inf is each tensor's max |x| (torchao's fused amax for FSDP2); it is also the
# call torch.nn.utils.clip_grad_norm_ and get_total_norm make on grads (sharded_grad.py).
chunk_cat = resolve("torch:_chunk_cat", "to join a bucket's pieces into one buffer in one op")
foreach_norm = resolve("torch:_foreach_norm", "to take every float8 weight's amax in one op")


def inductor_graph_pass() -> tuple:
    """inductor's CustomGraphPass and get_hash_for_files (fs.compile's post-grad
    pass, runtime/reduce_order.py), imported when fs.compile first needs them."""
    used_for = "to order fs.compile's reduce-scatters"
    return (resolve("torch._inductor.custom_graph_pass:CustomGraphPass", used_for),
            resolve("torch._inductor.custom_graph_pass:get_hash_for_files", used_for))


def inductor_mode_options(mode: str) -> dict:
    """The inductor options torch.compile's `mode` stands for."""
    return resolve("torch._inductor:list_mode_options", "to pass fs.compile's mode as "
                   "inductor options beside its post-grad pass")(mode)
