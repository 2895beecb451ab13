"""The exit handler (flexshard/wrap/teardown.py): it waits for gloo's threads on every
exit, also after the script destroyed its process group itself (examples/train.py does),
where a worker still dropping its last collective aborts the process in finalization.
Launches under torchrun measure the aborts: benchmarks/exit_stress.py."""

import sys
import threading

import torch.distributed as dist

from flexshard.wrap import teardown


def _run_handler(monkeypatch, initialized: bool, backend: str = "gloo", exception=None) -> list:
    calls = []
    monkeypatch.setattr(teardown, "settle_threads", lambda: calls.append("settle"))
    monkeypatch.setattr(dist, "is_initialized", lambda: initialized)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(sys, "last_value", exception, raising=False)
    teardown._destroy_at_exit()
    return calls


def test_a_group_the_script_left_is_destroyed_then_the_threads_awaited(monkeypatch):
    assert _run_handler(monkeypatch, initialized=True) == ["destroy", "settle"]


def test_the_threads_are_awaited_after_the_scripts_own_destroy(monkeypatch):
    assert _run_handler(monkeypatch, initialized=False) == ["settle"]


def test_an_uncaught_exception_or_nccl_skips_the_destroy_not_the_wait(monkeypatch):
    assert _run_handler(monkeypatch, initialized=True, exception=ValueError("x")) == ["settle"]
    assert _run_handler(monkeypatch, initialized=True, backend="nccl") == ["settle"]


def test_the_wait_ends_once_every_other_thread_sleeps():
    stop = threading.Event()
    sleeper = threading.Thread(target=stop.wait)
    sleeper.start()
    try:
        assert teardown.settle_threads(max_s=2.0) < 1.0  # asleep: three quiet polls
    finally:
        stop.set()
        sleeper.join()

