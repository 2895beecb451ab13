"""Asynchronous checkpoint saves: the training loop waits only for a copy.

`save_checkpoint(..., async_=True)` copies this rank's pieces (parameters and
optimizer state) into CPU memory, then writes them in a background thread.
The copy is made here, not by DCP's stager: the stager deep-copies each
value's Python metadata (a DTensor's spec, a ShardedPieces' boxes), which
cost 4-5x FSDP2's blocked time on the benchmark Llama; sharing the
(immutable) metadata and copying only the local pieces does not. That thread runs DCP's collectives (plan exchange, the
final gather of write results) and the publish barriers on a process group of
its own, so they never interleave with the training step's collectives on
the model's groups. One save per model is in flight: the next save or load
of the model waits for it first, and raises its error there.

Atomicity is the synchronous save's: files go to the temp directory, which
rank 0 renames to its final name once every rank wrote its files.
"""

from __future__ import annotations

import contextlib
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..compat import tree_map
from ..runtime.state import FlexShardState, files_group
from .pieces import copy_value


class AsyncSaves:
    """The asynchronous saves of one wrapped model: its writer thread, its
    process group, and the save in flight."""

    def __init__(self, state: FlexShardState) -> None:
        self._files_group = files_group(state)[0]  # None without a process group
        self._group = None  # made on the first save (a collective of the files group)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None

    def start(self, holder: dict, tmp: str, publish: Callable) -> Future:
        """Copy `holder` to CPU now; write it into `tmp` and `publish(group)` in
        the background. Returns the future of publish's result."""
        group = self._save_group()
        with torch.profiler.record_function("FlexShard::checkpoint_stage"):
            staged = tree_map(copy_value, holder)  # every piece copied: training may go on
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="flexshard-checkpoint")
        self._pending = self._executor.submit(_write, staged, tmp, group, publish)
        return self._pending

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as e:
            raise RuntimeError(f"the previous asynchronous save_checkpoint failed ({type(e).__name__}: "
                               f"{e}); its temp directory is left unpublished and removed by "
                               "the next save") from e

    def _save_group(self):
        if self._group is None and self._files_group is not None:
            ranks = dist.get_process_group_ranks(self._files_group)
            self._group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return self._group


def _write(staged: dict, tmp: str, group, publish: Callable):
    import torch.distributed.checkpoint as dcp

    with torch.profiler.record_function("FlexShard::checkpoint_write"), quiet_without_group(group):
        dcp.save(staged, checkpoint_id=tmp, process_group=group)
    return publish(group)


@contextlib.contextmanager
def quiet_without_group(group):
    """Without a process group DCP warns that it assumes one process: that is the
    intent (a model wrapped without torch.distributed). warnings.catch_warnings
    swaps the process-wide filter list back on exit, which from this thread would
    drop a filter the training thread adds meanwhile: one entry goes in, exactly
    it comes out, and only DCP's own note matches it."""
    if group is not None:
        yield
        return
    # by its text only: the module it is attributed to is whoever called dcp.save
    # (a wrapper of it included)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    entry = warnings.filters[0]
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            warnings.filters.remove(entry)


def async_saves(state: FlexShardState) -> AsyncSaves:
    """The model's AsyncSaves, made on first use."""
    if state.async_saves is None:
        state.async_saves = AsyncSaves(state)
    return state.async_saves
