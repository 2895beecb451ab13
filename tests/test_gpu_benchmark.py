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


def test_profile_writes_a_trace_and_a_summary_per_runner(dry_run):
    _, _, out = dry_run
    for kind in ("plain", "fsdp2", "flexshard", "flexshard-offload"):
        trace = json.loads((out / "profile" / f"{kind}.json").read_text())
        assert trace["traceEvents"]
        summary = (out / "profile" / f"{kind}-summary.txt").read_text()
        assert summary.startswith(f"== {kind}\n") and "no device events" in summary
        assert "busiest CPU ops (inclusive): " in summary


def test_trace_summary_arithmetic():
    from benchmarks.gpu_profile import summarize_trace

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
