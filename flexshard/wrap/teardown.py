"""Destroy a gloo default process group at interpreter exit, before finalization.

A script that ends without `dist.destroy_process_group()` (the README's
quickstart, most tutorials) leaves gloo's worker threads alive into
interpreter finalization. A worker that still holds the last reference to a
collective's tensor (it drops the finished work a moment after the waiting
thread returns) needs the GIL to free that tensor's Python object; taken
during finalization, the thread is ended by Python, inside a C++ destructor,
and the process aborts with "terminate called without an active exception".
On a loaded 2-core machine a 2-rank script of 300 all-reduces ending that way
aborted in 8 of 14 runs; with destroy_process_group() at its end, 0 of 16
(benchmarks/RESULTS.md, "Clean exits"). Destroying the group from an atexit
handler stops those threads taking work, and the handler then leaves the GIL
free so a worker still holding its last work drops it while the interpreter is
whole (the threads themselves are joined only when the last reference to their
group goes, which the model's state holds). A fixed pause was not enough on a
loaded machine (4 ranks on 2 cores: a worker waits for a core longer than 50 ms),
so the handler waits until every other thread of the process sleeps (Linux's
/proc/self/task: a worker that is running, or runnable and waiting for a core,
is not asleep), for at most a second; elsewhere it pauses a fixed 50 ms.
A core of such an abort (benchmarks/RESULTS.md, "Clean exits under torchrun")
shows the worker in `ProcessGroupGloo::runLoop` -> `~AsyncAllreduceWork` ->
`TensorImpl::decref_pyobject` -> `take_gil` -> `PyThread_exit_thread` while the
main thread is in `Py_FinalizeEx`'s last collection: torch's own teardown, which
a script avoids by calling `dist.destroy_process_group()` before it ends.

Only gloo, and only on a clean exit: NCCL's teardown has its own rules, and a
rank leaving on an exception may leave a collective its peers still wait in,
which a destroy could wait on too.
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


def destroy_gloo_group_at_exit() -> None:
    """Register (once per process) the exit handler below."""
    atexit.unregister(_destroy_at_exit)  # idempotent: one registration however many models
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    if getattr(sys, "last_value", None) is not None:  # exiting on an uncaught exception
        return
    if not (dist.is_available() and dist.is_initialized()):
        return  # never made, or the script destroyed it
    if dist.get_backend() != "gloo":
        return
    dist.destroy_process_group()  # no new work; the threads live on while groups are referenced
    settle_threads()  # the GIL free: a worker still dropping its last work does it now


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
