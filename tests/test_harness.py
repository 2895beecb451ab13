"""Tests of the multi-process harness itself (world sizes 1 and 2 only)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import WorkerDiedError, WorkerError, expect_all_ranks_raise, run_world

pytestmark = pytest.mark.world


# ---- bodies: top-level functions, run on every rank


def _rank_info(offset, scale=1):
    return (dist.get_rank() + offset) * scale, dist.get_world_size()


def _all_reduce_sum():
    t = torch.tensor([float(dist.get_rank() + 1), 10.0])
    dist.all_reduce(t)
    return t


def _raise_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError(f"bad input on rank {dist.get_rank()}")
    return "fine"


def _raise_everywhere(msg):
    print(f"about to fail on rank {dist.get_rank()}")
    raise TypeError(f"{msg} (rank {dist.get_rank()})")


def _sleep(seconds):
    time.sleep(seconds)
    return "woke"


def _exit_on_rank1(code):
    if dist.get_rank() == 1:
        os._exit(code)
    dist.barrier()  # rank 0 blocks here until the harness notices rank 1 died


def _pid():
    return os.getpid()


# ---- tests


def test_returns_per_rank_values():
    assert run_world(1, _rank_info, 5) == [(5, 1)]
    assert run_world(2, _rank_info, 1, scale=3) == [(3, 2), (6, 2)]


def test_all_reduce_sum():
    out = run_world(2, _all_reduce_sum)
    for t in out:
        assert torch.equal(t, torch.tensor([3.0, 20.0]))


def test_exception_on_one_rank_reports_rank_and_traceback():
    with pytest.raises(WorkerError, match="ValueError: bad input on rank 1") as info:
        run_world(2, _raise_on_rank1)
    err = info.value
    assert list(err.failures) == [1] and err.results == {0: "fine"}
    assert "Traceback" in str(err) and "_raise_on_rank1" in str(err)
    assert "rank 1" in str(err)
    assert run_world(2, _rank_info, 0) == [(0, 2), (1, 2)]  # world still usable


def test_expect_all_ranks_raise():
    fails = expect_all_ranks_raise(2, _raise_everywhere, TypeError, r"boom \(rank \d\)", "boom")
    assert [f.rank for f in fails] == [0, 1]
    assert "about to fail on rank 1" in fails[1].output
    expect_all_ranks_raise(2, _raise_everywhere, "Exception", "boom", "boom")  # base class
    with pytest.raises(AssertionError, match="rank 0 did not raise"):
        expect_all_ranks_raise(2, _raise_on_rank1, ValueError, "bad")
    with pytest.raises(AssertionError, match="does not match"):
        expect_all_ranks_raise(2, _raise_everywhere, TypeError, "other", "boom")


@pytest.mark.kills_world
def test_timeout_kills_world_and_next_call_uses_fresh_world():
    before = run_world(2, _pid)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"_sleep timed out .*rank\(s\) \[0, 1\]"):
        run_world(2, _sleep, 60, timeout=3)
    assert time.monotonic() - start < 10
    after = run_world(2, _pid)
    assert set(after).isdisjoint(before)
    assert run_world(2, _sleep, 0) == ["woke", "woke"]


@pytest.mark.kills_world
def test_dead_worker_is_reported():
    with pytest.raises(WorkerDiedError, match="rank 1 exit code 3"):
        run_world(2, _exit_on_rank1, 3, timeout=60)
    assert run_world(2, _rank_info, 0) == [(0, 2), (1, 2)]


def test_rejects_non_top_level_functions():
    with pytest.raises(ValueError, match="top-level"):
        run_world(1, lambda: 0)
