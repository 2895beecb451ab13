"""A quick run of benchmarks/compare.py at world sizes 1 and 2: the report has
its fields and its numbers are sane (no timing targets: those live in
benchmarks/RESULTS.md). benchmarks/async_checkpoint.py leaves no temporary directory."""

import math

import pytest

from harness import run_world

pytestmark = pytest.mark.world


def _run(variants):
    import torch.distributed as dist

    from benchmarks.compare import run_configs
    from benchmarks.harness.configs import Config

    ws = dist.get_world_size()
    return run_configs([Config(ws, **v) for v in variants], steps=2, warmup=1, device="cpu")


def _model_bytes(prefix: str = ""):
    from benchmarks.harness.model import build_model

    return sum(p.numel() * p.element_size() for fqn, p in build_model("odd").named_parameters()
               if fqn.startswith(prefix))


def _param_count():
    from benchmarks.harness.model import build_model

    return len(list(build_model("odd").parameters()))


def _check_timing(result, kinds):
    assert result["status"] == "ok", result
    assert set(result["step_time_s"]) == set(kinds)
    for spread in [*result["step_time_s"].values(), *result["ratio"].values()]:
        assert 0 < spread["min"] <= spread["median"] <= spread["max"] < math.inf


# The meter counts each storage at its allocator footprint (64-byte blocks on CPU:
# under 64 bytes more than its size), and flexshard's storage holds the gaps that
# start each piece on a 16-byte boundary (at most 15 bytes per param).
_ROUNDING, _GAP = 63, 15


def _check_memory(run, model_bytes, ws):
    mem = run["memory"]
    assert len(mem["peak_bytes_per_rank"]) == ws
    assert model_bytes / ws <= mem["param_bytes"] <= model_bytes * 1.1 / ws
    # fp32 grads, one per sharded param, the same bytes up to gaps and rounding
    slack = (_ROUNDING + _GAP) * _param_count()
    assert mem["grad_bytes"] - slack <= mem["param_bytes"] <= mem["grad_bytes"] + slack
    # AdamW: two moments per sharded param (grads may be views of a reduce output
    # that holds the same alignment gaps)
    assert mem["opt_state_bytes"] >= 2 * (mem["grad_bytes"] - slack)
    assert mem["peak_bytes"] >= mem["param_bytes"] + mem["opt_state_bytes"]
    assert sum(mem["peak_by_kind"].values()) == mem["peak_bytes"]


@pytest.fixture(scope="module")
def ws1_results():
    return run_world(1, _run, [{}], timeout=240)[0]


def test_world_size_1_against_plain(ws1_results):
    [result] = ws1_results
    _check_timing(result, ["fsdp2", "flexshard", "plain"])
    assert result["loss_gap_flexshard_fsdp2"] <= 1e-5
    runs = result["runners"]
    for run in runs.values():
        assert run["collectives"] == {} and run["comm_debug_count"] == 0
        _check_memory(run, _model_bytes(), 1)
    # without a cast, flexshard at world size 1 is the plain model: no copies of its own
    assert runs["flexshard"]["copies"] == runs["plain"]["copies"] == result["plain_copies"]
    # the same peak but for the params' storage: flexshard's buffer per bucket (its
    # alignment gaps, one block rounding each) against the plain model's tensors (one
    # block rounding each): below the plain model's, never above by more than the gaps
    diff = runs["flexshard"]["memory"]["param_bytes"] - runs["plain"]["memory"]["param_bytes"]
    assert -_ROUNDING * _param_count() <= diff <= _GAP * _param_count()
    assert (runs["flexshard"]["memory"]["peak_bytes"]
            == runs["plain"]["memory"]["peak_bytes"] + diff)


def _check_flexshard_traffic(run):
    counters = run["flexshard_counters"]["total"]
    colls = run["collectives"]
    # segments under GlooComm's rooted threshold: one all-gather each
    gathers = colls.get("allgather_base", {"count": 0, "wire_bytes": 0})
    broadcasts = colls.get("broadcast", {"count": 0, "wire_bytes": 0})
    assert gathers["count"] == counters["gathers"] and broadcasts["count"] == 0
    # a bucket's one reduce: reduce_scatter_tensor, or a list reduce_scatter where its
    # reduce layout is uneven (whole tensors on ranks of unequal bytes: Owned)
    none = {"count": 0, "wire_bytes": 0}
    reduces = [colls.get(k, none) for k in ("reduce_scatter_base", "reduce_scatter")]
    assert sum(r["count"] for r in reduces) == counters["reduces"]
    assert run["comm_debug_count"] == sum(c["count"] for c in colls.values())
    # the dispatch-level byte count agrees with flexshard's own counters
    assert gathers["wire_bytes"] + broadcasts["wire_bytes"] == counters["gather_wire_bytes"]
    assert sum(r["wire_bytes"] for r in reduces) == counters["reduce_wire_bytes"]


@pytest.fixture(scope="module")
def ws2_results():
    return run_world(2, _run, [{}, dict(placement="owned", optimizer="muon")], timeout=240)[0]


def test_world_size_2_side_by_side(ws2_results):
    result = ws2_results[0]
    _check_timing(result, ["fsdp2", "flexshard"])
    assert result["loss_gap_flexshard_fsdp2"] <= 1e-5
    runs = result["runners"]
    _check_flexshard_traffic(runs["flexshard"])
    blocks = 4
    for run in runs.values():
        _check_memory(run, _model_bytes(), 2)
        assert run["comm_debug_count"] == sum(c["count"] for c in run["collectives"].values())
        assert run["collectives"]["reduce_scatter_base"]["count"] == blocks + 1
        for d in run["wire"].values():
            assert 0 < d["ideal_bytes"] <= d["wire_bytes"]
        assert run["optimizer_collectives"] == {}  # AdamW on shards
    # both reduce every gradient once, in fp32: the same bytes had to move
    assert runs["fsdp2"]["wire"]["reduce"]["ideal_bytes"] == _model_bytes()
    assert runs["flexshard"]["wire"]["reduce"]["ideal_bytes"] == _model_bytes()


def test_report_renders(ws1_results):
    from benchmarks.harness.report import markdown

    results = ws1_results
    meta = {"date": "today", "torch": "x", "backend": "gloo", "cpu_cores": 2,
            "load_average_start": [0.0]}
    text = markdown(results, meta)
    assert "### Headline" in text and "shard/fp32/reshard/odd" in text
    assert "World size 1 against the plain model" in text


def test_world_size_2_muon_on_owned(ws2_results):
    result = ws2_results[1]
    _check_timing(result, ["fsdp2", "flexshard"])
    assert result["loss_gap_flexshard_fsdp2"] <= 1e-5  # the same Muon math on whole matrices
    runs = result["runners"]
    _check_flexshard_traffic(runs["flexshard"])
    assert runs["flexshard"]["optimizer_collectives"] == {}
    assert runs["flexshard"]["optimizer_comm_debug_count"] == 0
    # FSDP2 gathers each of the 4 blocks' 4 matrices for Newton-Schulz
    fsdp_gathers = [c["count"] for k, c in runs["fsdp2"]["optimizer_collectives"].items()
                    if "gather" in k]
    assert sum(fsdp_gathers) == 16
    # Owned blocks are views of their gather outputs; the root bucket keeps its params
    # through backward and equal segments would be over 1/16 padding at 2 ranks, so it
    # copies them out
    root = _model_bytes() - _model_bytes("layers.")
    assert runs["flexshard"]["flexshard_counters"]["copy_out_by_placements"] == {"Owned": root}
    for run in runs.values():
        mem = run["memory"]
        assert mem["peak_bytes"] >= mem["param_bytes"] + mem["opt_state_bytes"]


def test_command_line_writes_report(tmp_path):
    """The CLI spawns its own world, writes results.json/.md, and re-renders from JSON."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    # One configuration (the grid's filters cut it to Shard(0), fp32, reshard on): what
    # is checked is the launch and the files, not the grid (test_world_size_* run it).
    cmd = [sys.executable, "-m", "benchmarks.compare", "--world-sizes", "1", "--grid", "engine",
           "--models", "odd", "--placements", "shard", "--dtypes", "fp32", "--steps", "1",
           "--warmup", "0", "--no-chart", "--out-dir", str(tmp_path)]
    subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True, timeout=300)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["backend"] == "gloo" and saved["meta"]["torch"]
    assert [r["status"] for r in saved["results"]] == ["ok"]
    [config] = [r["config"] for r in saved["results"]]
    assert (config["placement"], config["param_dtype"], config["model"]) == ("shard", "fp32", "odd")
    (tmp_path / "results.md").unlink()
    # Re-rendering starts no world: compare.main in this process parses the same
    # arguments without paying a second interpreter's torch import.
    from benchmarks.compare import main

    assert main(["--from-json", str(tmp_path / "results.json"), "--no-chart",
                 "--out-dir", str(tmp_path)]) == 0
    assert "### Headline" in (tmp_path / "results.md").read_text()


def test_bad_configurations_are_refused():
    from benchmarks.harness.configs import Config

    with pytest.raises(ValueError, match=r"Config.placement='rows'; use one of"):
        Config(2, placement="rows")
    with pytest.raises(ValueError, match=r"Muon needs whole matrices on a rank: placement 'shard'"):
        Config(2, placement="shard", optimizer="muon")
    with pytest.raises(ValueError, match=r"Config.world_size=0; use 1 or more"):
        Config(0)


def _async_checkpoint_leftovers(tmp: str) -> list:
    """benchmarks/async_checkpoint.py in this world, its temporary files under `tmp`:
    what it left there."""
    import os
    import tempfile

    from benchmarks import async_checkpoint

    before, tempfile.tempdir = tempfile.tempdir, tmp
    try:
        async_checkpoint.main(["--model", "odd", "--steps", "2", "--every", "1"])
    finally:
        tempfile.tempdir = before
    return sorted(os.listdir(tmp))


def test_async_checkpoint_benchmark_cleans_up(tmp_path):
    """One checkpoint directory for all ranks, removed at the end (each rank made one,
    and only rank 0's was removed). Rank 0 lists after its removal."""
    assert run_world(2, _async_checkpoint_leftovers, str(tmp_path), timeout=240)[0] == []
