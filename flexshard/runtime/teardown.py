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
free for a moment so a worker still holding its last work drops it while the
interpreter is whole (the threads themselves are joined only when the last
reference to their group goes, which the model's state holds).

Only gloo, and only on a clean exit: NCCL's teardown has its own rules, and a
rank leaving on an exception may leave a collective its peers still wait in,
which a destroy could wait on too.
"""

from __future__ import annotations

import atexit
import sys
import time

import torch.distributed as dist


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
    time.sleep(_SETTLE_S)  # the GIL free: a worker still dropping its last work does it now


_SETTLE_S = 0.05  # once per process exit
