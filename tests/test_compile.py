"""torch.compile with flex_shard: compiled blocks train as the eager model does.

Inductor on CPU is slow to compile, so the tests share one world per size and
one model shape: every run compiles TinyGPT's Block.forward (once per process
and graph; later runs, other placements and other models of the same shape
reuse the compiled code), and inductor's on-disk cache serves the rest.
"""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import flexshard as fs
from flexshard.runtime.state import get_state
from compile_check import compiled_graph_calls
from harness import run_world
from models import batch, loss_fn
from reference import assemble_grads, assert_rel_close, make_model, sharded_grads

STEPS = 5
LR = 1e-2
PLACEMENTS = {"shard": fs.Shard(0), "owned": fs.Owned(), "ragged": fs.RaggedShard()}
BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _compile_blocks(model, how: str):
    """Compile `model.layers` in place: `module` is nn.Module.compile, `wrap` puts
    torch.compile's OptimizedModule in the ModuleList."""
    for i, block in enumerate(model.layers):
        if how == "module":
            block.compile()
        else:
            model.layers[i] = torch.compile(block)


def _snapshot() -> dict:
    """dynamo's counts of compiled frames, graphs, recompiles and graph breaks."""
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values()),
            # a graph break dynamo resumes after is a "graph_break", one that skips the
            # frame an "unimplemented"
            "breaks": sum(counters["graph_break"].values())
            + sum(counters["unimplemented"].values())}


def _count_gathers(model) -> list:
    """A one-element list counting every bucket gather (forward and backward)."""
    count = [0]
    for bucket in get_state(model).buckets:
        def gather(*args, _gather=bucket.gather.gather, **kwargs):
            count[0] += 1
            return _gather(*args, **kwargs)
        bucket.gather.gather = gather
    return count


def _train_steps(model, step_fn, rank: int, grads_of) -> tuple:
    """STEPS SGD steps of `model` through `step_fn`: (losses, dynamo counts after each
    step, `grads_of()` after step 0's backward: this rank's sharded grads; compiled
    graphs each step ran). SGD, not AdamW: AdamW turns the fp32 noise between inductor
    and eager into full steps on near-zero grads (measured: one loss 1.46e-5 apart
    after 4 AdamW steps with int8 gathers), and it is blind to a wrong grad scale."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, seen, grads, graph_calls = [], {}, None, []
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = loss_fn(step_fn(x), y)
        graph_calls.append(compiled_graph_calls(loss))
        loss.backward()
        if step == 0:
            grads = grads_of()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        seen[step + 1] = _snapshot()
    return losses, seen, grads, graph_calls


def train(config: dict, compiled: str = "", order: str = "after", bf16: bool = False) -> dict:
    """Rank body: 5 SGD steps of flex_shard(TinyGPT), blocks compiled as
    `compiled` says ("", "module", "wrap", "whole") before or after flex_shard."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = make_model()
    if compiled in ("module", "wrap") and order == "before":
        _compile_blocks(model, compiled)
    config = dict(config)
    mp = config.pop("mp_policy", BF16 if bf16 else fs.MixedPrecisionPolicy())
    model = fs.flex_shard(model, mp_policy=mp, **config)
    if compiled in ("module", "wrap") and order == "after":
        _compile_blocks(model, compiled)
    step_fn = torch.compile(model) if compiled == "whole" else model
    gathers = _count_gathers(model)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        losses, seen, grads, graph_calls = _train_steps(model, step_fn, rank, lambda: {
            k.replace("._orig_mod", ""): p.grad.clone() for k, p in model.named_parameters()})
    full = fs.full_state_dict(model)  # keyed as the plain model's state dict: no `_orig_mod.`
    return {"losses": losses, "full": full, "grads": grads, "gathers": gathers[0],
            "counters": seen, "graph_calls": graph_calls,
            "said": [str(w.message) for w in said if "flexshard" in str(w.message)]}


def compiled_and_eager(config: dict, compiled: str, order: str = "after",
                       bf16: bool = False) -> tuple:
    """Rank body: (eager run, compiled run) of the same training."""
    return train(config, bf16=bf16), train(config, compiled, order, bf16)


def check_matches_eager(world: int, config: dict, compiled: str = "module",
                        order: str = "after", bf16: bool = False, params: bool = True) -> dict:
    results = run_world(world, compiled_and_eager, config, compiled, order, bf16,
                        timeout=300)
    # bf16: inductor fuses and rounds bf16 intermediates where eager rounds each op,
    # so losses and grads agree to a few bf16 roundings (2**-8 each; the worst, the
    # first norm's weight grad after two blocks' backward, reads 1.1%): the params
    # are compared in fp32 only.
    rel = 1e-5 if not bf16 else 2 ** -6
    for eager, comp in results:  # each rank's own batches, loss and sharded grads
        # Each step ran both blocks' compiled graphs (a block dynamo skipped would run
        # eagerly and still match), and flexshard said nothing of an eager block.
        assert comp["graph_calls"] == [2] * STEPS and eager["graph_calls"] == [0] * STEPS
        assert comp["counters"][1]["graphs"] >= 1 and not comp["said"], comp["said"]
        # The same gathers (forward and backward regathers): reshard works under compile.
        assert comp["gathers"] == eager["gathers"]
        torch.testing.assert_close(torch.tensor(comp["losses"]), torch.tensor(eager["losses"]),
                                   rtol=rel, atol=0)
        for k, ref in eager["grads"].items():
            if ref.numel():
                assert_rel_close(comp["grads"][k], ref, rel, f"grad of {k}")
    eager, comp = results[0]
    assert comp["full"].keys() == eager["full"].keys()
    for k, ref in eager["full"].items() if params and not bf16 else ():
        assert_rel_close(comp["full"][k], ref, rel, k)
    return comp


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("world", [1, 2])
def test_compiled_blocks_match_eager(world, placement, reshard, bf16):
    config = {"placement": PLACEMENTS[placement], "reshard_after_forward": reshard}
    comp = check_matches_eager(world, config, bf16=bf16)
    # Compiled once (or reused from an earlier test): nothing compiles after step 2.
    assert comp["counters"][2] == comp["counters"][STEPS], comp["counters"]


def test_compiled_blocks_with_quantized_gathers_match_eager():
    """The gather (and its int8 quantize / dequantize) stays in the hooks: a
    compiled block computes on the same dequantized weights as eager."""
    quant = fs.MixedPrecisionPolicy(gather_format=fs.QuantizedGather(torch.int8, min_numel=256))
    # Losses of every step, the first step's grads and the params after 5 SGD steps.
    comp = check_matches_eager(2, {"mp_policy": quant})
    assert comp["counters"][2] == comp["counters"][STEPS], comp["counters"]


@pytest.mark.parametrize("how", ["module", "wrap"])
def test_compiling_before_flex_shard_matches_eager(how):
    check_matches_eager(2, {}, compiled=how, order="before")


def no_recompiles() -> dict:
    """Rank body: a fresh dynamo, per-block compile after flex_shard at reshard."""
    torch._dynamo.reset()
    counters.clear()
    return train({}, "module")


def test_nothing_recompiles_after_the_first_step():
    out = run_world(2, no_recompiles, timeout=300)[0]
    seen = out["counters"]
    assert seen[1]["graphs"] == 1  # both blocks share Block.forward's one graph
    assert out["graph_calls"] == [2] * STEPS  # and every step ran it, for each block
    assert seen[2] == seen[STEPS], seen
    # nn.Module.compile starts dynamo at Block.forward: flexshard's hooks, which
    # _call_impl runs around it, are not traced, so there is no graph break at all.
    assert seen[STEPS]["breaks"] == 0 and seen[STEPS]["recompiles"] == 0


def eager_compiled_blocks() -> tuple:
    """Rank body: TinyGPT's blocks compiled with .compile(), two steps under dynamo's
    "force_eager" stance (every compiled frame runs eagerly, as one dynamo skips):
    (compiled graphs each step ran, flexshard's warnings)."""
    model = fs.flex_shard(make_model())
    for block in model.layers:
        block.compile(backend="aot_eager")
    with torch.compiler.set_stance("force_eager"):
        return _two_steps_said(model)


def _two_steps_said(model) -> tuple:
    """Two forward/backward steps: (compiled graphs each ran, flexshard's warnings)."""
    calls = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(2):
            x, y = batch(step, 0)
            loss = loss_fn(model(x), y)
            calls.append(compiled_graph_calls(loss))
            loss.backward()
    return calls, [str(w.message) for w in said if "flexshard" in str(w.message)]


def test_a_compiled_block_that_ran_eagerly_is_said_once():
    for calls, said in run_world(2, eager_compiled_blocks, timeout=300):
        assert calls == [0, 0]  # both blocks ran eagerly, both steps
        assert len(said) == 1, said  # once per model, not per block or step
        assert said[0].startswith("flexshard: the block running bucket(s) 'layers.0' was "
                                  "compiled but ran its forward eagerly")
        assert "compile it with `parent.name = torch.compile(block)`" in said[0]


def checkpoint_wrapped_blocks(inner: bool) -> tuple:
    """torchtitan's order, by hand: blocks in activation checkpoint wrappers, sharded
    one bucket each, then the wrappers compiled (or the blocks inside them):
    (compiled graphs each step ran, flexshard's warnings)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch._dynamo.reset()
    model = make_model()
    model.layers = torch.nn.ModuleList(checkpoint_wrapper(b) for b in model.layers)
    fs.flex_shard(model, buckets=[fs.BucketSpec("layers.0.*"), fs.BucketSpec("layers.1.*"),
                                  fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"])])
    for wrapper in model.layers:
        (wrapper._checkpoint_wrapped_module if inner else wrapper).compile(backend="aot_eager")
    return _two_steps_said(model)


def test_a_compiled_checkpoint_wrapper_that_ran_eagerly_is_said_with_the_fix():
    """The wrapper compiled: flexshard's hooks run inside the checkpoint, where dynamo
    cannot break a graph, so each block ran eagerly, without a word (the check looked
    at the hooked block, not the wrapper the user compiled). The fix it names, the
    block inside the wrapper compiled, runs both blocks' graphs every step."""
    for calls, said in run_world(2, checkpoint_wrapped_blocks, False, timeout=300):
        assert calls == [0, 0] and len(said) == 1, (calls, said)
        assert "wrapper._checkpoint_wrapped_module.compile()" in said[0], said[0]
    for calls, said in run_world(2, checkpoint_wrapped_blocks, True, timeout=300):
        assert calls == [2, 2] and said == [], (calls, said)


def whole_model() -> dict:
    torch._dynamo.reset()
    counters.clear()
    out = train({}, "whole")
    out["break_reasons"] = list(counters["graph_break"]) + list(counters["unimplemented"])
    return out


def test_whole_model_compile_breaks_at_the_hooks_and_matches_eager():
    """torch.compile(model): dynamo stops at the first hooked block (our hooks are
    torch.compiler.disable'd), runs the root's forward eagerly and compiles each
    block's forward as its own frame."""
    results = run_world(2, whole_model, timeout=300)
    eager = run_world(2, train, {})[0]
    comp = results[0]
    torch.testing.assert_close(torch.tensor(comp["losses"]), torch.tensor(eager["losses"]),
                               rtol=1e-5, atol=0)
    for k, ref in eager["full"].items():
        assert_rel_close(comp["full"][k], ref, 1e-5, k)
    assert comp["counters"][2] == comp["counters"][STEPS]
    assert comp["counters"][STEPS]["graphs"] == 1
    assert comp["graph_calls"] == [2] * STEPS  # each block's forward, every step
    reasons = comp["break_reasons"]
    # TinyGPT's forward breaks at the first block's pre-forward hook, inside its loop
    # over blocks: dynamo skips that frame (runs it eagerly) and compiles each
    # block's forward frame instead. Every break is one of flexshard's hooks.
    assert len(reasons) == 2, reasons
    assert all("ModuleHooks.pre_forward" in r and "fs.compile(model, fullgraph=True)" in r
               for r in reasons), reasons


def whole_model_fullgraph() -> None:
    torch._dynamo.reset()  # forget that an earlier test ran TinyGPT.forward eagerly
    model = fs.flex_shard(make_model())
    x, _ = batch(0, 0)
    torch.compile(model, fullgraph=True)(x)


def test_whole_model_fullgraph_names_fs_compile():
    from harness import expect_all_ranks_raise

    expect_all_ranks_raise(2, whole_model_fullgraph, "torch._dynamo.exc.Unsupported",
                           r"compile the whole model with fs.compile\(model, fullgraph=True\)")


def test_a_missing_cpp_compiler_is_named_before_compiling(monkeypatch):
    """inductor needs g++ (or $CXX) on CPU: without one, parallelize_llama raises
    at once, before touching the model."""
    import torch._inductor.config as inductor_config  # tests may use torch privates
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims as titan_parallel_dims

    from flexshard.integrations.torchtitan import parallelize_llama

    # torch's own config patching: pytest 9's monkeypatch undo deletes the cpp.cxx entry.
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    model = torch.nn.Linear(2, 2)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler, and none of 'no-such-g\+\+'"
                                           r".* is on PATH: install one"):
        with mock.patch.object(titan_parallel_dims, "device_type", "cpu"), \
                inductor_config.patch({"cpp.cxx": (None, "no-such-g++")}):
            parallelize_llama(model, parallel_dims=dims, training=TrainingConfig(),
                              parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
                              compile_config=CompileConfig(enable=True), ac_config=None,
                              dump_folder="")
    assert model._compiled_call_impl is None  # nothing compiled or sharded


@pytest.mark.parametrize("device, backend, cxx", [("cuda", "inductor", (None, "no-such-g++")),
                                                  ("cpu", "aot_eager", (None, "no-such-g++")),
                                                  ("cpu", "inductor", (None, "sh"))])
def test_the_compiler_check_passes_where_inductor_needs_none_or_finds_one(device, backend, cxx):
    import torch._inductor.config as inductor_config
    from flexshard.runtime.compiled import check_cpp_compiler

    before = inductor_config.cpp.cxx
    with inductor_config.patch({"cpp.cxx": cxx}):
        check_cpp_compiler(torch.device(device), backend)  # raises nothing
    assert inductor_config.cpp.cxx == before  # restored for later compiles in this process


def _compiled_names() -> tuple:
    """Rank body: TinyGPT with torch.compile-d blocks (never run: names only) and
    fs's full-tensor state dicts of it, loaded back from both spellings of the keys."""
    model = make_model(seed=1)
    _compile_blocks(model, "wrap")
    model = fs.flex_shard(model)
    source = make_model().state_dict()
    fs.load_full_state_dict(model, source)
    loaded = fs.full_state_dict(model)
    prefixed = {k: source[k.replace("._orig_mod", "")] for k, _ in model.named_parameters()}
    fs.load_full_state_dict(model, {k: v + 1 for k, v in prefixed.items()})
    plus_one = fs.full_state_dict(model)
    fs.load_pretrained(model, source)
    return loaded, plus_one, fs.full_state_dict(model), list(model.state_dict())


def test_full_state_dicts_of_compiled_blocks_have_the_plain_models_keys():
    """As DSD's get_model_state_dict, without torch.compile's `_orig_mod.`."""
    source = make_model().state_dict()
    for loaded, plus_one, reloaded, own_keys in run_world(2, _compiled_names):
        assert list(loaded) == list(plus_one) == list(reloaded) == list(source)
        assert any("._orig_mod." in k for k in own_keys)  # module.state_dict(): torch's keys
        for k, v in source.items():
            assert torch.equal(loaded[k], v) and torch.equal(reloaded[k], v), k
            assert torch.equal(plus_one[k], v + 1), k
