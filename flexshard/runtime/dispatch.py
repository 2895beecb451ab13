"""Keeping flexshard's own collectives out of selective activation checkpointing's
dispatch modes, which replay ops by call index (runtime/bucket.py's gathers)."""

from __future__ import annotations

from contextlib import contextmanager

from ..compat import (SAC_MODES as _SAC_MODES, get_dispatch_stack_at, len_torch_dispatch_stack,
                      pop_mode as _pop_mode, push_mode as _push_mode)


@contextmanager
def hidden_from_checkpoint():
    """Run a gather's ops outside selective-checkpoint dispatch modes.

    Under the user's selective activation checkpointing (torchtitan's "op" AC),
    torch replays ops by (op, call index), so the forward and the recompute
    must issue the same ops. A gather may be launched early (prefetch) in one
    and on demand in the other, so it never shows to those modes; other
    dispatch modes (CommDebugMode, user modes) still see it.
    """
    depth = len_torch_dispatch_stack()
    stack = [get_dispatch_stack_at(i) for i in range(depth)]
    if not any(isinstance(m, _SAC_MODES) for m in stack):
        yield
        return
    for _ in stack:
        _pop_mode()
    kept = [m for m in stack if not isinstance(m, _SAC_MODES)]
    for m in kept:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for m in stack:
            _push_mode(m)
