"""Leave no gloo work to interpreter finalization: at exit, destroy a gloo
default process group the script left, then wait for gloo's threads to sleep.

A gloo worker thread drops a finished collective's work a moment after the
waiting thread returns. When the last reference to one of its tensors is the
work's, dropping it frees the tensor's Python object, which needs the GIL; taken
during finalization, the thread is ended by Python inside a C++ destructor, and
the process aborts with "terminate called without an active exception". A core
(benchmarks/RESULTS.md, "Clean exits under torchrun") shows the worker in
`ProcessGroupGloo::runLoop` -> `~AsyncAllreduceWork` -> `TensorImpl::decref_pyobject`
-> `take_gil` -> `PyThread_exit_thread` while the main thread is in `Py_FinalizeEx`.

`dist.destroy_process_group()` at the end of a script does not prevent it on torch
2.13: it stops new work, but the threads live on while anything references their
group (a model's state does) and the last work may still be unreleased. A 2-rank
script of 300 all-reduces then destroy_process_group() aborted in 10 of 12 runs
under FSDP2 and 9 of 12 under flexshard before this handler waited after a script's
own destroy too. So the handler, on every exit of a process that wrapped a model or
called fs.collectives while a process group existed, destroys a gloo default group
still there (no new work), then sleeps with the GIL free until every other thread of
the process sleeps (Linux's /proc/self/task: a worker that is running, or runnable
and waiting for a core, is not asleep), for at most a second; elsewhere it pauses a
fixed 50 ms. A fixed pause was not enough on a loaded machine (4 ranks on 2 cores: a
worker waits for a core longer than 50 ms).

The destroy is skipped on an uncaught exception and off gloo: NCCL's teardown
has its own rules, and a rank leaving on an exception may leave a collective its
peers still wait in, which a destroy could wait on too. The wait is not: a
thread blocked in a collective sleeps, so it costs ~15 ms.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

import torch.distributed as dist

_SETTLE_S = 0.05  # without /proc: a fixed pause, once per process exit
_SETTLE_MAX_S = 1.0  # a thread of the user's that never sleeps costs this, once per exit
_POLL_S = 0.005
_QUIET_POLLS = 3  # in a row: every other thread asleep (S), idle (I) or a zombie (Z)


_registered = False


def destroy_gloo_group_at_exit() -> None:
    """Register (once per process) the exit handler below: flex_shard does, and the
    activation collectives (fs.collectives) do on their first call."""
    global _registered
    if not _registered:
        atexit.register(_destroy_at_exit)
        _registered = True


def _destroy_at_exit() -> None:
    clean = getattr(sys, "last_value", None) is None  # not exiting on an uncaught exception
    if clean and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()  # no new work; the threads live on while groups are referenced
    settle_threads()  # the GIL free: a worker still dropping its last work does it now, the
    # script's own destroy_process_group() or not (gloo subgroups live under NCCL too)


def settle_threads(max_s: float = _SETTLE_MAX_S) -> float:
    """Sleep, the GIL free, until every other thread of this process has slept for
    `_QUIET_POLLS` polls in a row (at most `max_s`); returns the seconds waited."""
    start = time.monotonic()
    states = _thread_states_reader()
    if states is None:  # no /proc (macOS, Windows): a fixed pause
        time.sleep(_SETTLE_S)
        return time.monotonic() - start
    quiet = 0
    while quiet < _QUIET_POLLS and time.monotonic() - start < max_s:
        time.sleep(_POLL_S)
        quiet = quiet + 1 if all(state in "SIZ" for state in states()) else 0
    return time.monotonic() - start


def _thread_states_reader():
    """A function listing the scheduler state letter of every other thread, or None."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        return None
    me = str(threading.get_native_id())

    def states() -> list:
        letters = []
        for tid in os.listdir(tasks):
            if tid == me:
                continue
            try:
                with open(f"{tasks}/{tid}/stat") as f:
                    letters.append(f.read().rpartition(")")[2].split()[0])  # after (comm)
            except (OSError, IndexError):
                continue  # the thread ended
        return letters

    return states
