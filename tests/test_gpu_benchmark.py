"""benchmarks/gpu.py before any GPU run: its CPU dry run produces every field
of the report (no timing targets checked: those are for the GPU), its trace
summary does the right arithmetic, and bad arguments are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bench")
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--preset", "tiny",
           "--steps", "2", "--warmup", "1", "--offload", "--ac", "full",
           "--profile", str(out / "profile"), "--json", str(out / "result.json")]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text()), proc.stdout, out


def test_report_fields(dry_run):
    result, stdout, _ = dry_run
    assert set(result["runners"]) == {"plain", "fsdp2", "flexshard", "flexshard-offload"}
    for r in result["runners"].values():
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
        assert 0 < r["step_s"]["min"] <= r["step_s"]["median"] <= r["step_s"]["max"]
        assert r["max_allocated_bytes"] is None and r["max_reserved_bytes"] is None  # CPU
        assert r["final_loss"] > 0
    model = result["model"]
    assert model["preset"] == "tiny" and model["params"] > 0
    # 6 N (without the token embedding) + 12 L d s
    n = model["params"] - model["vocab"] * model["dim"]
    assert model["flops_per_token"] == 6 * n + 12 * model["layers"] * model["dim"] * model["seq"]
    config = result["config"]
    assert config["ac"] == "full" and config["world_size"] == 1 and config["timing"] == "alternate"
    assert config["tokens_per_step"] == model["batch"] * model["seq"]
    names = [t["name"] for t in result["targets"]]
    assert names == ["memory flexshard/fsdp2", "tokens/s flexshard/fsdp2", "tokens/s flexshard/plain"]
    verdicts = {t["name"]: t["verdict"] for t in result["targets"]}
    assert verdicts["memory flexshard/fsdp2"] == "n/a"  # no CUDA memory stats on CPU
    assert {verdicts[n] for n in names[1:]} <= {"PASS", "MISS"}
    assert result["loss_gap_flexshard_fsdp2"] < 1e-2  # same weights, same batches
    assert "| flexshard-offload |" in stdout and "tokens/s flexshard/plain" in stdout


def test_whole_compile_runners_run_their_graphs(tmp_path, dry_run):
    """--compile whole (issue 46's one-rank target): the plain model and flexshard's step
    each one graph a step, FSDP2 a graph per block; no graph compiled in the timed steps;
    losses as the eager dry run's (the same weights and batches; its activation
    checkpoints change no value)."""
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--preset", "tiny",
           "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "r.json"),
           "--compile", "whole"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    whole, eager = json.loads((tmp_path / "r.json").read_text()), dry_run[0]
    assert whole["config"]["compile"] == "whole" and whole["graphs_in_timed_steps"] == 0
    calls = {k: r["compiled_graph_calls"] for k, r in whole["runners"].items()}
    assert calls == {"plain": 1, "fsdp2": whole["model"]["layers"], "flexshard": 1}, calls
    assert {r["compiled_graph_calls"] for r in eager["runners"].values()} == {0}
    for kind in whole["runners"]:
        a, b = whole["runners"][kind]["final_loss"], eager["runners"][kind]["final_loss"]
        assert abs(a - b) <= 1e-2 * abs(b), (kind, a, b)


def test_profile_writes_a_trace_and_a_summary_per_runner(dry_run):
    _, _, out = dry_run
    for kind in ("plain", "fsdp2", "flexshard", "flexshard-offload"):
        trace = json.loads((out / "profile" / f"{kind}.json").read_text())
        assert trace["traceEvents"]
        summary = (out / "profile" / f"{kind}-summary.txt").read_text()
        assert summary.startswith(f"== {kind}\n") and "no device events" in summary
        assert "busiest CPU ops (inclusive): " in summary


def test_trace_summary_arithmetic():
    from benchmarks.harness.trace import summarize_trace

    def kernel(name, ts, dur, stream, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = {"traceEvents": [
        kernel("gemm", 100, 50, 7), kernel("allgather", 120, 60, 20),  # overlap: 100..180
        kernel("copy", 200, 10, 21, "gpu_memcpy"),  # gap 180..200
        kernel("gemm2", 300, 40, 7),  # gap 210..300
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 40, "dur": 5},
    ]}
    s = summarize_trace(trace)
    assert s.device_events == 4 and s.span_us == 240 and s.busy_us == 130 and s.idle_us == 110
    assert s.per_stream_us == {7: 90, 20: 60, 21: 10}
    assert s.per_category_us == {"kernel": 150, "gpu_memcpy": 10}
    assert [(g.start_us, g.length_us, g.before, g.after) for g in s.gaps] == [
        (110, 90, "copy", "gemm2"), (80, 20, "allgather", "copy")]
    assert s.top_cpu_ops == [("aten::mm", 35.0)]
    text = s.text("flexshard")
    assert "device span 0.24 ms, busy 0.13 ms (54.2%), idle 0.11 ms, 4 device events" in text
    assert "idle 0.090 ms at +0.11 ms: after 'copy', before 'gemm2'" in text


def test_targets_verdicts():
    from benchmarks.gpu import targets

    runners = {"plain": {"tokens_per_s": 100.0, "max_allocated_bytes": 10},
               "fsdp2": {"tokens_per_s": 95.0, "max_allocated_bytes": 8},
               "flexshard": {"tokens_per_s": 97.0, "max_allocated_bytes": 8}}
    rows = {r["name"]: (round(r["value"], 4), r["verdict"]) for r in targets(runners)}
    assert rows == {"memory flexshard/fsdp2": (1.0, "PASS"),
                    "tokens/s flexshard/fsdp2": (round(97 / 95, 4), "PASS"),
                    "tokens/s flexshard/plain": (0.97, "MISS")}
    del runners["plain"]  # world size > 1: no plain model
    assert targets(runners)[2]["verdict"] == "n/a"


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seq", "0"], "--seq must be >= 1, got 0"),
    (["--device", "cuda"], "--device cuda: torch sees no CUDA device here"),
])
def test_bad_arguments(argv, message, capsys):
    import torch

    from benchmarks.gpu import parse_args

    if argv == ["--device", "cuda"] and torch.cuda.is_available():
        argv, message = ["--warmup", "-1"], "--warmup must be >= 0, got -1"
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_presets_are_what_the_issue_asks():
    """The default preset: >= 1 B parameters, sequence >= 2048."""
    import torch

    from benchmarks.gpu import PRESETS, build_model

    model = build_model(PRESETS["1b"], "none", torch.device("meta"), 0)
    assert sum(p.numel() for p in model.parameters()) >= 1e9 and PRESETS["1b"].seq >= 2048


# --- the fake world (--fake-world N): one rank of an N-rank job in one process ---

FAKE_WORLD = 4


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """The CLI's CPU count mode on the tiny Llama, then count_step on the same
    configuration, in one fresh process (a fake world is its default group)."""
    out = tmp_path_factory.mktemp("fake-world")
    script = (
        "import json, sys\n"
        "from benchmarks import gpu\n"
        "from benchmarks.harness.fake_world import PRESETS\n"
        f"gpu.main(['--fake-world', '{FAKE_WORLD}', '--device', 'cpu', '--counts', '--preset',"
        f" 'tiny', '--steps', '2', '--warmup', '1', '--json', sys.argv[1]])\n"
        f"c = gpu.count_step('flexshard', world={FAKE_WORLD}, shape=PRESETS['tiny'])\n"
        "print('COUNT_STEP', json.dumps(c._asdict()))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script, str(out / "fake.json")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    helper = json.loads(proc.stdout.split("COUNT_STEP ", 1)[1])
    return json.loads((out / "fake.json").read_text()), proc.stdout, helper


def _gathers(by_op: dict) -> int:
    from benchmarks.harness.meters import is_collective

    return sum(c for n, (c, _) in by_op.items() if is_collective(n) and "gather" in n)


def _shard_bytes_bf16(shape, world: int) -> tuple:
    """bf16 bytes of one rank's shard of one decoder layer and of the root params
    (a Llama's matrices and norms, from its dims; the tiny preset divides by the world)."""
    kv = shape.dim // shape.heads * shape.kv_heads
    layer = 2 * shape.dim * shape.dim + 2 * kv * shape.dim + 3 * shape.dim * shape.ffn \
        + 2 * shape.dim
    root = 2 * shape.vocab * shape.dim + shape.dim
    return 2 * layer // world, 2 * root // world


def test_fake_world_counts_both_sides(fake_run):
    from benchmarks.harness.fake_world import PRESETS

    result, stdout, _ = fake_run
    assert result["config"]["world"] == FAKE_WORLD and result["config"]["device"] == "cpu"
    (mode,) = result["modes"]
    assert mode["mode"] == "eager"
    sides = mode["sides"]
    for side in ("flexshard", "fsdp2"):
        c = sides[side]["counts"]
        assert 0 < c["non_view_ops"] < c["ops"] and 0 < c["copy_ops"] < c["ops"]
        assert c["copy_bytes"] > 0 and sides[side]["peak_bytes"] > 0 and sides[side]["step_s"] > 0
        assert sum(n for n, _ in c["by_op"].values()) == c["ops"]
        assert sum(b for _, b in c["by_op"].values()) == c["copy_bytes"]
    fs_ops, fsdp_ops = sides["flexshard"]["counts"]["by_op"], sides["fsdp2"]["counts"]["by_op"]
    # reshard after forward: each layer gathers in forward and again in backward, the root once
    shape = PRESETS["tiny"]
    assert _gathers(fs_ops) == _gathers(fsdp_ops) == 2 * shape.layers + 1
    # the fake backend stands in for NCCL: both sides reduce with its AVG, no pre-scale op
    assert fs_ops.get("aten::mul_", [0])[0] == fsdp_ops.get("aten::mul_", [0])[0] == 0
    # FSDP2's copy-in writes exactly the bf16 shards it gathers: the byte count is the bytes written
    assert all(n % FAKE_WORLD == 0 for n in (shape.dim, shape.ffn, shape.vocab))  # no padding
    layer, root = _shard_bytes_bf16(shape, FAKE_WORLD)
    assert fsdp_ops["fsdp::all_gather_copy_in"] == [2 * shape.layers + 1,
                                                    2 * shape.layers * layer + root]
    for key in ("ops", "non_view_ops", "copy_ops", "copy_bytes", "peak_bytes", "step_s"):
        a, b = (sides[s]["counts"][key] if key in sides[s]["counts"] else sides[s][key]
                for s in ("flexshard", "fsdp2"))
        assert mode["ratios"][key] == pytest.approx(a / b)
    # every op lands in one region; every copy a library makes is inside its labels, so
    # the unlabelled copies are the model's own: the same bytes on both sides
    from benchmarks.harness.op_counter import OUTSIDE

    for side in ("flexshard", "fsdp2"):
        regions = sides[side]["counts"]["by_region"]
        assert sum(n for n, _ in regions.values()) == sides[side]["counts"]["ops"]
    fs_regions, fsdp_regions = (sides[s]["counts"]["by_region"] for s in ("flexshard", "fsdp2"))
    assert fs_regions[OUTSIDE][1] == fsdp_regions[OUTSIDE][1] > 0
    assert any(r.startswith("FlexShard::") and b > 0 for r, (_, b) in fs_regions.items())
    assert any(r.startswith("FSDP::") and b > 0 for r, (_, b) in fsdp_regions.items())
    assert [t[:2] for t in result["targets"]] == [["eager", "ops"], ["eager", "copy_bytes"],
                                                  ["eager", "engine_copy_bytes"]]
    assert result["config"]["placement"] == "shard"
    assert "flexshard placement shard, FSDP2 Shard(0)" in stdout
    assert "| " + "  of them in the library's labelled regions (engine) |" in stdout
    assert "| aten ops per forward+backward |" in stdout and "| fsdp::chunk_cat |" in stdout
    assert "target eager ops flexshard/FSDP2" in stdout


def test_engine_copy_bytes_are_what_fsdp2_writes_by_hand(fake_run):
    """The engine meter on a case whose answer is known: FSDP2's labelled regions write,
    per gather, the shards cast to bf16 (`_to_copy`), those copied into the gather input
    (copy-in) and the unsharded params' bf16 bytes out of the gather output
    (split_with_sizes_copy), and per reduce the full grads in fp32 into the reduce input
    (chunk_cat); nothing else (no padding at this shape). On both sides the engine bytes
    are the total less the model's own (the unlabelled row, the same on both sides)."""
    from benchmarks.harness.fake_world import PRESETS
    from benchmarks.harness.op_counter import OUTSIDE

    result, _, _ = fake_run
    shape, sides = PRESETS["tiny"], result["modes"][0]["sides"]
    layer, root = _shard_bytes_bf16(shape, FAKE_WORLD)
    gathered = 2 * shape.layers * layer + root  # each layer twice (reshard after forward)
    reduced = shape.layers * layer + root  # each param's grad once
    fsdp = sides["fsdp2"]["counts"]
    assert fsdp["by_op"]["fsdp::split_with_sizes_copy"][1] == FAKE_WORLD * gathered
    assert fsdp["by_op"]["fsdp::chunk_cat"][1] == 2 * FAKE_WORLD * reduced
    assert fsdp["engine_copy_bytes"] == (2 + FAKE_WORLD) * gathered + 2 * FAKE_WORLD * reduced
    for side in ("flexshard", "fsdp2"):
        c = sides[side]["counts"]
        assert c["engine_copy_bytes"] == c["copy_bytes"] - c["by_region"][OUTSIDE][1] > 0
    ratio = result["modes"][0]["ratios"]["engine_copy_bytes"]
    assert ratio == pytest.approx(sides["flexshard"]["counts"]["engine_copy_bytes"]
                                  / fsdp["engine_copy_bytes"])


def test_count_step_matches_the_cli(fake_run):
    """count_step (the helper engine tests call) counts what the CLI counts."""
    result, _, helper = fake_run
    cli = result["modes"][0]["sides"]["flexshard"]["counts"]
    assert helper == cli


def test_written_bytes_of_copy_ops():
    import torch

    from benchmarks.harness.op_counter import OpCounter

    a, b = torch.zeros(6), torch.ones(4, dtype=torch.bfloat16)
    outs = [torch.empty(2), torch.empty(4)]
    with OpCounter() as counter:
        a[:4].copy_(b)  # 4 fp32 written
        torch._foreach_copy_([a[:2], a[2:3]], [b[:2], b[2:3]])  # 3 fp32
        torch.split_with_sizes_copy(a, [2, 4], out=outs)  # 6 fp32 into out=
        torch.cat([b, b])  # 8 bf16
        a.view(2, 3).t()  # views: counted ops, no bytes
    c = counter.copy_bytes
    assert c["aten::copy_"] == 16 and c["aten::_foreach_copy_"] == 12
    assert c["aten::split_with_sizes_copy"] == 24 and c["aten::cat"] == 16
    assert counter.views["aten::view"] == 1 and counter.views["aten::t"] == 1
    assert "aten::view" not in c


def test_ops_are_attributed_to_the_innermost_library_range():
    import torch
    from torch.profiler import record_function

    from benchmarks.harness.op_counter import OUTSIDE, OpCounter

    a = torch.zeros(4)
    with OpCounter() as counter:
        with record_function("FSDP::all_gather (layers.0)"):
            a.clone()  # 16 bytes
            with record_function("user range"):
                a.clone()  # still FSDP's: the user range is no library's
                with record_function("FlexShard::all_gather_copy_in"):
                    a.add(1)
            a.mul(2)
        a.sub(1)
    assert counter.region_ops == {"FSDP::all_gather": 3, "FlexShard::all_gather_copy_in": 1,
                                  OUTSIDE: 1}
    assert counter.region_bytes == {"FSDP::all_gather": 32}


def _event(name, device, us=0.0, parent=None, kernels=0):
    """A made-up profiler event (as torch.profiler's FunctionEvent), linked to `parent`."""
    from types import SimpleNamespace

    e = SimpleNamespace(name=name, device_type=device, device_time_total=us,
                        cpu_parent=parent, kernels=[None] * kernels, cpu_children=[])
    if parent is not None:
        parent.cpu_children.append(e)
    return e


def test_device_summary_attributes_kernels_to_copies():
    """On a GPU: kernels counted, copy time taken once per outermost copy op,
    and per library label (made-up events, as torch.profiler's FunctionEvents)."""
    from types import SimpleNamespace

    from benchmarks.harness.device_time import device_summary

    cpu, cuda = SimpleNamespace(name="CPU"), SimpleNamespace(name="CUDA")
    ev = _event
    label = ev("FSDP::all_gather_copy_in", cpu, 7.0)
    copy_in = ev("fsdp::all_gather_copy_in", cpu, 7.0, label)
    inner = ev("aten::_foreach_copy_", cpu, 7.0, copy_in, kernels=2)
    mm = ev("aten::mm", cpu, 30.0, kernels=1)
    annotation = ev("FSDP::all_gather_copy_in", cuda, 7.0)  # its range on the GPU timeline
    annotation.is_user_annotation = True
    events = [label, copy_in, inner, mm, ev("kernel_a", cuda, 3.0), ev("kernel_b", cuda, 4.0),
              ev("gemm", cuda, 30.0), ev("Memcpy HtoD", cuda, 1.0), annotation]
    s = device_summary(events)
    assert (s["kernels"], s["memcpy_memset"], s["device_us"]) == (3, 1, 38.0)
    assert (s["copy_device_us"], s["copy_kernels"]) == (7.0, 2)
    assert s["label_device_us"] == {"FSDP::all_gather_copy_in": 7.0}


def test_engine_gpu_time_leaves_out_the_kernels_under_collectives():
    """The fake backend's own writes (kernels launched under c10d's collective ops,
    standing in for NCCL) are not engine work: per label and in the copy-family time
    they are set apart (made-up events, as torch.profiler's FunctionEvents)."""
    from types import SimpleNamespace

    from benchmarks.harness.device_time import device_summary, engine_label_us

    cpu, cuda = SimpleNamespace(name="CPU"), SimpleNamespace(name="CUDA")
    ev = _event
    gather = ev("FlexShard::all_gather", cpu, 10.0)
    coalesced = ev("c10d::allgather_into_tensor_coalesced_", cpu, 8.0, gather)
    backend_copy = ev("aten::copy_", cpu, 8.0, coalesced, kernels=2)  # the backend's writes
    cast = ev("aten::_to_copy", cpu, 2.0, gather, kernels=1)  # the engine's cast, same label
    reduce = ev("FSDP::post_backward_reduce", cpu, 9.0)
    base = ev("c10d::_reduce_scatter_base_", cpu, 5.0, reduce)
    base_copy = ev("aten::copy_", cpu, 5.0, base, kernels=1)
    pack = ev("fsdp::chunk_cat", cpu, 4.0, reduce, kernels=1)
    model = ev("aten::_to_copy", cpu, 3.0, kernels=1)  # the model's own cast: no label
    events = [gather, coalesced, backend_copy, cast, reduce, base, base_copy, pack, model,
              ev("kernel", cuda, 30.0), ev("_dequantize", cuda, 1.5)]  # a Triton kernel
    assert engine_label_us(events) == {"FlexShard::all_gather": 2.0,
                                       "FSDP::post_backward_reduce": 4.0}
    s = device_summary(events)
    assert s["copy_device_us"] == 8.0 + 2.0 + 5.0 + 4.0 + 3.0
    assert s["engine_device_us"] == 2.0 + 4.0 + 1.5
    assert (s["model_copy_device_us"], s["fused_kernel_device_us"]) == (3.0, 1.5)
    assert s["label_device_us"] == {"FlexShard::all_gather": 10.0,
                                    "FSDP::post_backward_reduce": 9.0}
    assert s["engine_label_device_us"] == engine_label_us(events)


def test_device_summary_reads_real_profiler_events():
    """The attributes device_summary reads are torch.profiler's (a CPU profile:
    no device events, the labelled copy found with nothing under it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.harness.device_time import device_summary

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("FlexShard::all_gather_copy_in"):
            torch.cat([torch.ones(4), torch.zeros(4)]).to(torch.bfloat16)
    s = device_summary(prof.events())
    assert (s["kernels"], s["copy_kernels"], s["compiled_graph_calls"]) == (0, 0, 0)
    assert s["label_device_us"] == {"FlexShard::all_gather_copy_in": 0}
    assert s["engine_label_device_us"] == {"FlexShard::all_gather_copy_in": 0}
    assert s["engine_device_us"] == s["copy_device_us"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--fake-world", "8", "--rank", "8"], "need N >= 1 and 0 <= rank < N"),
    (["--fake-world", "8", "--offload"], "--offload is for the real-world mode"),
    (["--fake-world", "8", "--device", "cpu", "--preset", "1b"],
     "--preset '1b' with --fake-world: choose from"),
    (["--preset", "8b"], "--preset '8b': choose from"),
])
def test_fake_world_bad_arguments(argv, message, capsys):
    from benchmarks.gpu import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_fake_world_defaults():
    from benchmarks.gpu import parse_args

    args = parse_args(["--fake-world", "8", "--device", "cpu", "--counts"])
    assert (args.preset, args.modes) == ("cpu", ["eager"])
    assert parse_args([]).preset == "1b"  # the real-world mode keeps its default
    assert args.placement == "shard"
    for name in ("ragged", "owned", "mixed", "shard1"):  # flexshard's; FSDP2 stays Shard(0)
        assert parse_args(["--fake-world", "8", "--device", "cpu", "--placement",
                           name]).placement == name


def test_mixed_placement_reads_block_names_of_both_model_families():
    """Block matrices Owned in this repository's models (`layers.N.`) and in Hugging
    Face's Llama (`model.layers.N.`), other matrices RaggedShard, vectors Shard(0)."""
    import torch

    import flexshard as fs
    from benchmarks.harness.runners import flexshard_placement

    choose = flexshard_placement("mixed")
    matrix, vector = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    for fqn in ("layers.0.up.weight", "model.layers.3.mlp.up_proj.weight"):
        assert choose(fqn, matrix) == fs.Owned(), fqn
    assert choose("model.embed_tokens.weight", matrix) == fs.RaggedShard()
    assert choose("model.layers.0.input_layernorm.weight", vector) == fs.Shard(0)
    shard1 = flexshard_placement("shard1")
    assert (shard1("model.layers.0.mlp.up_proj.weight", matrix), shard1("x.bias", vector)) == \
        (fs.Shard(1), fs.Shard(0))


def test_fake_world_refuses_an_unknown_placement():
    from benchmarks.harness.fake_world import wrap

    with pytest.raises(ValueError, match=r"unknown placement 'rows'; use one of"):
        wrap("flexshard", None, None, placement="rows")


def test_fake_world_presets_are_what_the_issues_ask():
    """CPU: hidden >= 384, 4 layers, sequence >= 256 (issue 34); GPU: Llama-3-8B's
    layer shapes at sequence 4096 (issue 33)."""
    from benchmarks.harness.fake_world import PRESETS

    cpu, gpu = PRESETS["cpu"], PRESETS["8b"]
    assert cpu.dim >= 384 and cpu.layers == 4 and cpu.seq >= 256
    assert (gpu.dim, gpu.ffn, gpu.heads, gpu.kv_heads, gpu.seq) == (4096, 14336, 32, 8, 4096)


def test_compile_checks_name_eager_and_recompiling_blocks():
    from benchmarks.harness.fake_world_run import compile_checks

    def side(calls, again):
        return {"profile": {"compiled_graph_calls": calls}, "graphs_after_warmup": again}
    result = {"modes": [
        {"mode": "eager", "sides": {"flexshard": {}, "fsdp2": {}}},
        {"mode": "module-compile", "sides": {"flexshard": side(0, 0), "fsdp2": side(8, 0)}},
        {"mode": "float8-compile", "sides": {"flexshard": side(8, 3), "fsdp2": side(8, 0)}}]}
    assert [row[1:] for row in compile_checks(result)] == [
        ("flexshard", 0, 0, "ran eagerly"), ("fsdp2", 8, 0, "compiled"),
        ("flexshard", 8, 3, "recompiled (3 graphs after warm-up)"), ("fsdp2", 8, 0, "compiled")]


def test_count_step_refuses_compiled_modes():
    from benchmarks.harness.fake_world import count_step

    with pytest.raises(ValueError, match="count an eager mode"):
        count_step("flexshard", mode="compile")


def test_fake_world_targets_per_mode_and_device():
    """Issue 34's targets: ops and copy bytes against FSDP2 everywhere, times and memory
    on a GPU only; a quantized-gather mode against flexshard's bf16 gathers, time only."""
    from benchmarks.harness.fake_world_run import targets

    def mode(name, **r):
        return {"mode": name, "ratios": r}
    modes = [mode("eager", ops=0.9, copy_bytes=1.2, step_s=0.8, peak_bytes=0.9),
             mode("int8-gather", ops=1.5, copy_bytes=1.5, step_s=1.04, peak_bytes=1.0)]
    cpu = targets({"config": {"device": "cpu"}, "modes": modes})
    assert cpu == [("eager", "ops", 0.9, 1.0, "PASS"), ("eager", "copy_bytes", 1.2, 1.0, "MISS")]
    gpu = targets({"config": {"device": "cuda"}, "modes": modes})
    assert [r[:2] + r[4:] for r in gpu] == [
        ("eager", "ops", "PASS"), ("eager", "copy_bytes", "MISS"), ("eager", "step_s", "PASS"),
        ("eager", "peak_bytes", "PASS"), ("int8-gather", "step_s", "PASS")]


def test_whole_step_sides_drop_what_their_meters_cannot_see():
    """flexshard's whole-step graph has no labels, so no engine GPU time (it read 0 on the
    H200: a PASS by default); under CUDA graphs its tensors live in the graphs' pool,
    outside torch.cuda's allocated counters, so no peak. FSDP2's side keeps both."""
    from benchmarks.harness.fake_world_run import ratios, unmeasured

    def side():
        return {"peak_bytes": 2 ** 30, "step_s": 0.1,
                "profile": {"device_us": 9.0, "engine_device_us": 0.0, "kernels": 5,
                            "model_copy_device_us": 4.8, "compiled_graph_calls": 2}}
    for mode, peak in (("whole-compile", True), ("cudagraph", False), ("eager", True)):
        sides = {"flexshard": unmeasured(side(), mode, "flexshard"),
                 "fsdp2": unmeasured(side(), mode, "fsdp2")}
        got = ratios(sides)
        whole = mode != "eager"
        assert ("engine_device_us" in got, "model_copy_device_us" in got) == (not whole,) * 2
        assert ("peak_bytes" in got) == peak and "step_s" in got and "kernels" in got
        assert sides["fsdp2"] == side()


def test_copy_kernels_dry_run_writes_the_same_bits_every_way():
    """benchmarks/copy_kernels.py (the battery's copy timings) on the CPU, shapes / 32:
    every way of each copy writes what the first writes (the check raises otherwise)."""
    from benchmarks.copy_kernels import run

    rows = run(torch.device("cpu"), 32, 8, 1)
    assert [(copy.split()[0], way) for copy, way, _, _ in rows] == [
        ("pack", "_foreach_copy_"), ("pack", "copy_ each"), ("pack", "_chunk_cat each"),
        ("pack", "_chunk_cat all (FSDP2)"), ("copy-in", "_foreach_copy_"), ("copy-in", "copy_ each")]
    assert all(ms > 0 and gbs > 0 for _, _, ms, gbs in rows)


def test_idle_text_names_the_idle_time_streams_and_gaps():
    """A GPU run's line on where the step idled (from its Chrome trace's summary)."""
    from benchmarks.harness.fake_world_report import idle_text

    text = idle_text("flexshard", {"span_us": 130e3, "idle_us": 8.4e3,
                                   "per_stream_us": {"7": 120e3, "13": 5e3},
                                   "gaps": [[900.0, "gemm", "triton_poi_0"]]})
    assert text == ("flexshard: the GPU idled 8.40 ms of the step's 130.00 ms (stream 7 120.0 "
                    "ms, stream 13 5.0 ms). Longest gaps: 0.90 ms after `gemm` before "
                    "`triton_poi_0`")


def test_the_gpu_battery_names_real_modes_and_fits_one_device_call():
    """benchmarks/gpu_battery.sh (one device call for a session lent a GPU): each
    mode it runs is a fake-world mode, and its time limits add up to under 10 minutes
    (one device command's limit), leaving the start and the transfers room."""
    import re

    from benchmarks.harness.fake_world import MODES

    text = (REPO / "benchmarks" / "gpu_battery.sh").read_text()
    modes = re.search(r"\$\{MODES:-([^}]*)\}", text).group(1).split()
    limits = dict(re.findall(r"\[([\w-]+)\]=(\d+)", text))
    # the default modes have limits; so do the modes named only when MODES is set
    assert modes and set(modes) <= set(limits) <= set(MODES), (modes, limits)
    steps = [int(n) for n in re.findall(r"^\s*step \S+ (\d+)", text, re.M)]
    assert sum(steps) + sum(int(limits[m]) for m in modes) <= 9 * 60
