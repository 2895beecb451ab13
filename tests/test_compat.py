"""flexshard/compat.py: each private torch API flexshard uses resolves and
behaves as flexshard expects; nothing else in flexshard names a private torch API."""

from __future__ import annotations

import ast
import inspect
import math
import pathlib

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from flexshard import compat
from flexshard.checkpoint.pieces import ShardedPieces, piece_boxes
from flexshard.placements.shard import Shard

PKG = pathlib.Path(__file__).resolve().parent.parent / "flexshard"


class Recorder(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _stack() -> list:
    return [compat.get_dispatch_stack_at(i) for i in range(compat.len_torch_dispatch_stack())]


def test_torch_version_is_in_range_and_outside_warns():
    assert compat.check_torch_version()
    with pytest.warns(UserWarning, match=r"flexshard was written for torch>=2\.11,<2\.16 and "
                                         r"torch is 3\.1\.0"):
        assert not compat.check_torch_version("3.1.0")
    for inside in ("2.11.0+cu130", "2.13.1+cu126", "2.15.0"):
        assert compat.check_torch_version(inside)
    for outside in ("2.10.0", "2.16.0a0"):
        with pytest.warns(UserWarning, match="flexshard was written for"):
            assert not compat.check_torch_version(outside)


def test_pyproject_admits_the_releases_compat_was_written_for():
    import re

    text = (PKG.parent / "pyproject.toml").read_text()
    (a, b), (c, d) = compat.TORCH_RANGE
    assert re.search(rf'"torch>={a}\.{b},<{c}\.{d}"', text), "pyproject.toml and TORCH_RANGE differ"


def test_renamed_names_resolve_newest_first():
    assert compat.resolve_first(("torch:concat", "torch:cat"), "a test") is torch.concat
    assert compat.resolve_first(("torch:_no_such_cat", "torch:cat"), "a test") is torch.cat
    with pytest.raises(ImportError, match=r"one of torch's torch:_a / torch:_b \(for a test\), "
                                          r"none of which torch .* has"):
        compat.resolve_first(("torch:_a", "torch:_b"), "for a test")


def test_this_torch_runs_its_own_names():
    import torch.distributed as dist

    assert compat.all_gather_single is getattr(dist, "all_gather_single", None) \
        or not hasattr(dist, "all_gather_single")
    assert compat.reduce_scatter_single is getattr(dist, "reduce_scatter_single", None) \
        or not hasattr(dist, "reduce_scatter_single")


def test_torch_2_11_api_surface_trains_as_one_process(tmp_path):
    """flexshard imported after torch 2.13's two new names are deleted (the old ones
    kept, as on 2.11) trains 2 ranks as one process does: losses, step-0 grads, params."""
    import os
    import subprocess
    import sys

    from harness import _free_port
    from old_torch_api import STEPS
    from reference import compare_to_reference

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    script = PKG.parent / "tests" / "old_torch_api.py"
    ranks = [subprocess.Popen([sys.executable, str(script), str(tmp_path)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in ranks]  # about 3 s of CPU each
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(outputs)
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank, got in enumerate(saved):
        assert got["still_there"] == []
        assert got["calls"]["all_gather_into_tensor"] > 0
        assert got["calls"]["reduce_scatter_tensor"] > 0
    compare_to_reference([got["result"] for got in saved], 2, STEPS, exact=True)


def test_a_missing_symbol_fails_naming_it():
    with pytest.raises(ImportError, match=r"torch's private torch._C:_no_such_thing \(for a "
                                          r"test\), which torch .* does not have"):
        compat.resolve("torch._C:_no_such_thing", "for a test")


def test_top_saved_tensors_default_hooks():
    assert compat.top_saved_tensors_default_hooks(False) is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert compat.top_saved_tensors_default_hooks(False) is not None


def test_selective_checkpoint_modes_are_on_the_dispatch_stack():
    seen = []

    def block(x):
        seen.append([type(m) for m in _stack() if isinstance(m, compat.SAC_MODES)])
        return x.sin().sin()

    x = torch.randn(3, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=False, context_fn=lambda:
                     create_selective_checkpoint_contexts(lambda *a, **k:
                                                          CheckpointPolicy.MUST_SAVE))
    out.sum().backward()
    # forward caches, the recompute in backward replays: one mode each.
    assert seen == [[compat.SAC_MODES[0]], [compat.SAC_MODES[1]]]


def test_dispatch_stack_reads():
    before = compat.len_torch_dispatch_stack()
    with Recorder() as mode:
        assert compat.len_torch_dispatch_stack() == before + 1
        assert compat.get_dispatch_stack_at(before) is mode
    assert compat.len_torch_dispatch_stack() == before


def test_push_and_pop_mode():
    before = _stack()
    mode = Recorder()
    compat.push_mode(mode)
    try:
        assert _stack() == before + [mode]
    finally:
        assert compat.pop_mode() is mode
    assert _stack() == before


def test_current_graph_task_id_and_queue_callback():
    assert compat.current_graph_task_id() == -1
    w = torch.ones(2, requires_grad=True)
    events = []

    def hook(grad):
        events.append(("task", compat.current_graph_task_id()))
        compat.queue_callback(lambda: events.append(("callback", w.grad is not None)))
        return grad

    y = w * 2
    y.register_hook(hook)
    y.sum().backward()
    (_, task), callback = events
    assert task != -1
    assert callback == ("callback", True)  # ran once the pass ended, after AccumulateGrad
    assert compat.current_graph_task_id() == -1


def test_tree_map():
    out = compat.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t,
                          ((torch.ones(1), "a"), {"k": [torch.ones(1)]}))
    assert out[0][1] == "a" and torch.equal(out[1]["k"][0], torch.full((1,), 2.0))


def test_make_wrapper_subclass_holds_no_full_tensor():
    local = torch.arange(6.0).reshape(2, 3)
    boxes = piece_boxes(Shard(0), (4, 3), 0, 2)
    pieces = ShardedPieces(local, (4, 3), boxes)
    assert pieces.shape == (4, 3) and pieces.dtype == local.dtype
    assert pieces.local is local
    with pytest.raises(NotImplementedError, match="on a ShardedPieces"):
        pieces + 1


def test_tensor_version_counts_in_place_writes_shared_with_views():
    base = torch.zeros(4)
    view = base[:2]
    before = compat.tensor_version(base)
    view.add_(1)
    assert compat.tensor_version(base) == compat.tensor_version(view) > before


def test_post_accumulate_grad_hooks_carry_to_a_new_param():
    old = nn.Parameter(torch.ones(2))
    fired = []
    old.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    hooks = getattr(old, compat.POST_ACCUMULATE_GRAD_HOOKS)
    assert len(hooks) == 1
    new = nn.Parameter(torch.ones(2))
    setattr(new, compat.POST_ACCUMULATE_GRAD_HOOKS, hooks)
    (new * 3).sum().backward()
    assert len(fired) == 1 and torch.equal(fired[0], torch.full((2,), 3.0))


@pytest.mark.parametrize("assign", [False, True])
def test_assign_metadata_key(assign):
    module, seen = nn.Linear(2, 2), []
    module.register_load_state_dict_pre_hook(
        lambda m, sd, prefix, meta, *rest: seen.append(meta.get(compat.ASSIGN_METADATA_KEY, False)))
    module.load_state_dict(nn.Linear(2, 2).state_dict(), assign=assign)
    assert seen == [assign]


def test_dcp_calls_the_protocol():
    from torch.distributed.checkpoint.metadata import MetadataIndex

    create_write_items, create_chunk_list, find_tensor_shard = compat.DCP_CALLERS
    local = torch.arange(6.0).reshape(2, 3)
    pieces = ShardedPieces(local, (4, 3), piece_boxes(Shard(0), (4, 3), 1, 2))
    assert all(hasattr(pieces, name) for name in compat.DCP_PROTOCOL)
    items = create_write_items("w", pieces)
    assert [tuple(i.index.offset) for i in items] == [(2, 0)]
    assert create_chunk_list(pieces) == pieces.__create_chunk_list__()
    shard = find_tensor_shard(pieces, MetadataIndex("w", torch.Size([2, 0])))
    assert shard.data_ptr() == local.data_ptr()


# Private attributes of torch objects that flexshard reaches through compat.py, which
# the scan cannot tell from flexshard's own by their root name.
PRIVATE_ATTRS = {"_non_persistent_buffers_set", "__create_chunk_list__", "_version",
                 "_post_accumulate_grad_hooks", "_make_wrapper_subclass", "_get_root_mesh"}


def _private_torch_names(path: pathlib.Path) -> list:
    """(line, text) of each private torch name `path` imports or reads."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRS:
            out.append((node.lineno, node.attr))
            continue
        if isinstance(node, ast.Import):
            parts = [p for a in node.names if a.name.split(".")[0] == "torch"
                     for p in a.name.split(".")]
            out += [(node.lineno, p) for p in parts if p.startswith("_") and not p.endswith("__")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".") + [a.name for a in node.names]
            out += [(node.lineno, p) for p in parts if p.startswith("_") and not p.endswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.endswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "torch":
                out.append((node.lineno, node.attr))
    return out


@pytest.mark.world
def test_root_mesh_is_the_mesh_a_slice_was_cut_from():
    from harness import run_world

    assert run_world(2, _root_meshes) == [(True, True, True)] * 2


def _root_meshes() -> tuple:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    return (compat.root_mesh(mesh["dp"]) is mesh, compat.root_mesh(mesh["tp"]) is mesh,
            compat.root_mesh(mesh) is mesh)


def test_functional_collective_ops_live_in_the_namespace_the_policy_reads():
    ops = getattr(torch.ops, compat.FUNCTIONAL_COLLECTIVES_NAMESPACE)
    assert ops.all_gather_into_tensor.default.namespace == compat.FUNCTIONAL_COLLECTIVES_NAMESPACE
    assert ops.wait_tensor.default.namespace == compat.FUNCTIONAL_COLLECTIVES_NAMESPACE


class _Scale:
    """A constant argument of a non-strict traced function (as TracedBucket is)."""

    def __init__(self, by: float) -> None:
        self.by = by

    def __eq__(self, other) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


def _scaled(scale: _Scale, x: torch.Tensor) -> list:
    return [x * scale.by, (x * scale.by).sum()]


def test_nonstrict_trace_is_one_call_in_dynamos_graph_and_trains():
    """What fs.compile's gathers rely on (runtime/traced.py): a non-strict traced
    function with a pytree-constant argument is one node of dynamo's graph, whose
    ops AOTAutograd traces, forward and backward."""
    import torch._dynamo

    compat.register_constant(_Scale)
    traced, scale, graphs = compat.nonstrict_trace(_scaled), _Scale(3.0), []

    def backend(gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    torch._dynamo.reset()
    f = torch.compile(lambda x: traced(scale, x)[0].sin(), fullgraph=True, backend=backend)
    x = torch.randn(4, requires_grad=True)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, 3.0 * torch.cos(3.0 * x.detach()))
    (nodes,) = graphs  # the function's mul and sum are not dynamo's nodes: one call
    assert len(nodes) == 2 and "flat_apply" in nodes[0] and "getitem" in nodes[1], nodes
    torch._dynamo.reset()


def test_dtensor_local_offsets_place_the_local_tensor():
    from harness import run_world

    assert run_world(2, _local_offsets) == [((0, 0), (0, 0)), ((2, 0), (0, 4))]


def _local_offsets() -> tuple:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as DShard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = distribute_tensor(torch.zeros(4, 6), mesh, [DShard(0)])
    cols = distribute_tensor(torch.zeros(5, 7), mesh, [DShard(1)])  # 4 + 3 columns
    return compat.dtensor_local_offsets(rows), compat.dtensor_local_offsets(cols)


def test_persistent_buffer_names_leave_out_non_persistent_ones():
    module = nn.BatchNorm1d(3)
    module.register_buffer("cache", torch.zeros(2), persistent=False)
    module.register_buffer("empty", None)
    assert compat.persistent_buffer_names(module) == ["running_mean", "running_var",
                                                      "num_batches_tracked"]
    assert set(module.state_dict()) - {"weight", "bias"} == set(compat.persistent_buffer_names(module))


def test_importing_flexshard_does_not_import_inductor():
    import subprocess
    import sys

    code = "import sys, flexshard; print('torch._inductor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent)
    assert out.stdout.strip() == "False", "import inductor only where compile is used"


def test_inductor_cpp_compilers_are_the_config_list():
    import shutil

    names = compat.inductor_cpp_compilers()
    assert isinstance(names, tuple) and names
    assert all(n is None or isinstance(n, str) for n in names)
    assert any(n is not None and shutil.which(n) for n in names)  # g++ is on these machines


def test_the_private_name_scan_sees_plain_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import torch._inductor.config as c\nimport os\n")
    assert _private_torch_names(path) == [(1, "_inductor")]


def test_only_compat_names_private_torch_apis():
    found = {str(p.relative_to(PKG)): _private_torch_names(p) for p in PKG.rglob("*.py")
             if p.name != "compat.py"}
    assert {k: v for k, v in found.items() if v} == {}, "route them through flexshard/compat.py"
    assert _private_torch_names(PKG / "compat.py") == []  # compat names them as strings


def test_chunk_cat_joins_flattened_pieces_casting_into_out():
    a, b = torch.randn(2, 3), torch.randn(5)
    out = torch.empty(1, 11, dtype=torch.float64)
    compat.chunk_cat([a, b], 0, 1, out=out)
    assert torch.equal(out[0], torch.cat([a.reshape(-1), b]).double())


def test_foreach_norm_inf_is_each_max_abs():
    ts = [torch.randn(3, 4), torch.randn(7).bfloat16()]
    norms = compat.foreach_norm(ts, ord=math.inf)
    assert all(torch.equal(n, t.abs().max()) for n, t in zip(norms, ts))


def _recording_subclass() -> type:
    """A fresh torch-function subclass recording the functions that reach it and
    running them as on plain tensors (sharded_grad.py's idiom)."""
    class Sub(torch.Tensor):
        seen: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(func)
            with compat.plain_torch_function():
                return func(*args, **(kwargs or {}))

    return Sub


def test_plain_torch_function_and_foreach_norm():
    Sub = _recording_subclass()
    a, b = torch.ones(4).as_subclass(Sub), torch.full((3,), 2.0)
    norms = torch.nn.utils.get_total_norm([a, b], foreach=True)  # clip_grad_norm_'s path
    assert compat.foreach_norm in Sub.seen
    torch.testing.assert_close(norms, torch.tensor(math.sqrt(4 + 12)))
    assert type(a + 1) is torch.Tensor  # outputs stay plain under the handler


def test_amp_unscale_reaches_torch_function_and_only_sets_found_inf():
    Sub = _recording_subclass()
    grads = [torch.full((2,), 4.0), torch.full((3,), 8.0).as_subclass(Sub)]
    found_inf, inv_scale = torch.zeros(()), torch.full((), 0.25)
    compat.amp_unscale_(grads, found_inf, inv_scale)  # GradScaler("cpu")'s call
    assert compat.amp_unscale_ in Sub.seen  # a list holding a subclass dispatches
    assert [g.tolist() for g in grads] == [[1.0, 1.0], [2.0, 2.0, 2.0]] and found_inf == 0
    grads[0][0] = math.inf
    compat.amp_unscale_(grads, found_inf, inv_scale)
    assert found_inf == 1
    compat.amp_unscale_(grads[1:], found_inf, inv_scale)  # finite grads leave it set
    assert found_inf == 1


def test_chunk_cat_writes_dim0_chunks_back_to_back_with_the_cast():
    a = torch.arange(1., 13.).view(6, 2).to(torch.bfloat16)  # chunks of 2 rows: 2, 2, 2, 0
    b = torch.arange(100., 105.).to(torch.bfloat16)  # chunks of 2: 2, 2, 1, 0 (padded)
    out = torch.full((4, 6), -1.0)
    compat.chunk_cat([a, b], 0, 4, out=out)
    want = torch.zeros(4, 6)
    for r, (pa, pb) in enumerate(zip(a.float().chunk(3), b.float().chunk(3))):
        want[r, :pa.numel()] = pa.flatten()
        want[r, 4:4 + pb.numel()] = pb
    assert torch.equal(out, want)


def test_foreach_copy_casts_pairs():
    dst = [torch.empty(3, dtype=torch.bfloat16), torch.empty(2, dtype=torch.bfloat16)]
    compat.foreach_copy_(dst, [torch.arange(3.), torch.arange(2.)])
    assert [d.tolist() for d in dst] == [[0., 1., 2.], [0., 1.]]


def test_foreach_zero_zeroes_every_view_in_place():
    buffer = torch.arange(8.)
    compat.foreach_zero_([buffer[1:3], buffer[5:6]])
    assert buffer.tolist() == [0., 0., 0., 3., 4., 0., 6., 7.]


def test_module_compile_and_the_compiled_graphs_autograd_node():
    """runtime/compiled.py tells a compiled forward from an eager one by these."""
    from flexshard.runtime.hooks import module_compiled

    module = nn.Linear(2, 2)
    assert not module_compiled(module)
    module.compile(backend="aot_eager")
    assert module_compiled(module)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: t.sin() * 2, backend="aot_eager")
    out = compiled(torch.randn(3, requires_grad=True))
    assert out.grad_fn.name() == compat.COMPILED_GRAPH_NODE
    eager = torch.randn(3, requires_grad=True).sin() * 2
    assert eager.grad_fn.name() != compat.COMPILED_GRAPH_NODE


def test_wrapper_attributes_that_state_dicts_leave_out():
    """wrap/names.py drops these from named_parameters()' names, as the wrapped
    module's own state_dict() (checkpoint_wrapper) and DSD's (both) do."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)), torch.compile(nn.Linear(2, 2)))
    names = [n for n, _ in model.named_parameters()]
    assert names == [f"0.{compat.CHECKPOINT_WRAPPED_MODULE}.weight",
                     f"0.{compat.CHECKPOINT_WRAPPED_MODULE}.bias",
                     f"1.{compat.COMPILED_ORIG_MOD}.weight", f"1.{compat.COMPILED_ORIG_MOD}.bias"]
    assert compat.is_compiled_wrapper(model[1]) and not compat.is_compiled_wrapper(model[0])
    assert list(get_model_state_dict(model)) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert list(model[0].state_dict()) == ["weight", "bias"]


def test_ddp_reads_the_ignored_names_attribute_of_the_module_first():
    """api._refuse_ddp rides on it: a flex_shard model refuses DDP before DDP's
    first collective (tests/test_training_mistakes.py runs it at 2 ranks)."""
    source = inspect.getsource(torch.nn.parallel.DistributedDataParallel.__init__)
    read = source.index(f"hasattr(module, \"{compat.DDP_IGNORED_NAMES}\")")
    assert read < source.index("_verify_param_shape_across_processes")
    assert read < source.index("_sync_module_states")


def test_accumulates_into_grad_tells_backward_from_autograd_grad():
    """compat.accumulates_into_grad, asked from inside a backward node: True under
    .backward() (with or without inputs=), False under torch.autograd.grad."""
    from flexshard.compat import accumulates_into_grad

    p, x = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(accumulates_into_grad(p))
            return g * 2

    def loss():
        return (Probe.apply(p) * x).sum()

    loss().backward()
    loss().backward(inputs=[p])
    torch.autograd.grad(loss(), [p])
    torch.autograd.grad(loss(), [p, x])
    assert seen == [True, True, False, False]
