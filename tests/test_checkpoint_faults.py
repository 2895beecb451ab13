"""Checkpoint faults beyond tests/test_dcp_reshard.py (which covers a directory
no rank can write, a missing .metadata and an exception during save): a
directory only one rank cannot write, a data file gone missing, and a rank
killed (not raising) in the middle of a save."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from ckpt_util import train, wrapped
from harness import expect_all_ranks_raise, run_world
from test_timeouts import PG_TIMEOUT_S, SLACK_S, STARTUP_S, finish_world, init_world, record, start_world

pytestmark = pytest.mark.world

STEP1 = "step_00000001"


def _save_step1(root):
    model, opt = wrapped("shard0")
    train(model, opt, [0], dist.get_rank())
    fs.save_checkpoint(root, model, opt, step=1)
    return fs.full_state_dict(model)


def _save_where_rank1_cannot_write(root, blocked):
    model, opt = wrapped("shard0")
    fs.save_checkpoint(blocked if dist.get_rank() == 1 else root, model, opt, step=2)


def _load(root):
    model, opt = wrapped("shard0", seed=1)
    return fs.load_checkpoint(root, model, opt), fs.full_state_dict(model)


def test_directory_one_rank_cannot_write_fails_on_every_rank(tmp_path):
    root = str(tmp_path)
    saved = run_world(2, _save_step1, root)[0]
    (tmp_path / "a_file").write_text("a file where rank 1 wants a directory")
    fails = expect_all_ranks_raise(
        2, _save_where_rank1_cannot_write, ValueError,
        r"save_checkpoint: cannot write checkpoints to .*; pass a directory every rank can write",
        root, str(tmp_path / "a_file" / "ckpt"))
    assert "another rank could not write it" in fails[0].message
    assert "NotADirectoryError" in fails[1].message
    assert sorted(os.listdir(root)) == ["a_file", STEP1]  # nothing half-written
    for step, params in run_world(2, _load, root):
        assert step == 1
        assert all(torch.equal(params[k], saved[k]) for k in saved)


def _new_run_into(root):
    """A run started over (step 0 again) saving into a directory of a longer run,
    as keep= would prune it: its first save."""
    model, opt = wrapped("shard0", seed=1)
    fs.save_checkpoint(root, model, opt, step=0, keep=1)


def test_a_save_before_the_directorys_newest_step_is_refused_on_every_rank(tmp_path):
    """keep= pruned the steps just written (the older run's were "newer"), and
    load_checkpoint would have resumed from the older run: refused before writing."""
    root = str(tmp_path)
    saved = run_world(2, _save_step1, root)[0]
    expect_all_ranks_raise(2, _new_run_into, ValueError,
                           r"save_checkpoint: cannot write checkpoints to .* \(it holds checkpoint "
                           r"step 1, after this save's step 0: load_checkpoint would resume from "
                           r"that one.*save into another directory", root)
    assert sorted(os.listdir(root)) == [STEP1]
    for step, params in run_world(2, _load, root):
        assert step == 1 and all(torch.equal(params[k], saved[k]) for k in saved)


def test_missing_data_file_fails_on_every_rank_naming_it(tmp_path):
    run_world(2, _save_step1, str(tmp_path))
    (tmp_path / STEP1 / "__1_0.distcp").unlink()
    expect_all_ranks_raise(2, _load, "CheckpointException",
                           rf"No such file or directory: '.*{STEP1}/__1_0\.distcp'", str(tmp_path))


# ---- a rank killed mid-save, in a small world of its own (see test_timeouts.py)


def _killed_mid_save(rank: int, world: int, port: int, root: str, out_dir: str) -> None:
    """Save step 1, train on, then save step 2: rank 1 dies while writing its file."""
    from unittest import mock

    from torch.distributed.checkpoint import FileSystemWriter

    init_world(rank, world, port)
    model, opt = wrapped("shard0")
    train(model, opt, [0], rank)
    fs.save_checkpoint(root, model, opt, step=1)
    full = fs.full_state_dict(model)
    if rank == 0:
        torch.save(full, os.path.join(out_dir, "step1.pt"))
    train(model, opt, [1], rank)

    def die(*args, **kwargs):
        record(out_dir, rank, failed_at=time.time())
        os._exit(17)

    try:
        with mock.patch.object(FileSystemWriter, "write_data", die if rank == 1 else
                               FileSystemWriter.write_data):
            fs.save_checkpoint(root, model, opt, step=2)
    except Exception as e:  # noqa: BLE001 - what the test checks
        record(out_dir, rank, error=type(e).__name__, message=str(e)[:500], at=time.time())
        os._exit(3)
    record(out_dir, rank, error=None, at=time.time())
    os._exit(0)


def test_rank_killed_during_save_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    procs = start_world(_killed_mid_save, 2, str(root), str(out))
    result = finish_world(procs, str(out), time.monotonic() + STARTUP_S + PG_TIMEOUT_S + SLACK_S)
    assert result["hung"] == [] and result["codes"] == {0: 3, 1: 17}, result
    assert result["records"][0]["at"] - result["records"][1]["failed_at"] < PG_TIMEOUT_S + SLACK_S
    assert STEP1 in os.listdir(root) and "step_00000002" not in os.listdir(root)
    model, opt = wrapped("shard0", seed=1)  # this process: no process group, world size 1
    assert fs.load_checkpoint(str(root), model, opt) == 1
    saved = torch.load(out / "step1.pt")
    assert all(torch.equal(p, saved[k]) for k, p in model.named_parameters())


def test_truncated_metadata_is_refused_with_a_clear_error(tmp_path):
    """A damaged .metadata names the checkpoint instead of a bare unpickling error."""
    import flexshard.checkpoint.files as ckpt_mod

    step = tmp_path / "step_3"
    step.mkdir()
    (step / ".metadata").write_bytes(b"\x80\x04\x95")  # a pickle cut short
    with pytest.raises(ValueError, match=r"step_3.*is damaged.*metadata cannot be"):
        ckpt_mod._read_metadata(str(step))
