"""Atomic, resharding training checkpoints (torch.distributed.checkpoint underneath).

Layout of a checkpoint directory::

    ckpt/step_00000100/      one complete checkpoint: DCP's .metadata and data files
    ckpt/step_00000200/
    ckpt/.tmp-step_00000300/ a save in progress (or one that crashed): never loaded

A save writes into the temp directory and renames it to its final name only
after every rank has written and DCP's .metadata is on disk, so a crash at
any point leaves the previous checkpoints as they were. A checkpoint taken on
N ranks with one bucket plan loads on M ranks with another (see state_dict.py).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..runtime.hooks import check_call
from ..runtime.state import files_group, get_state
from . import layouts
from .optimizer_state import check_optimizer_export
from .async_save import async_saves, quiet_without_group

_STEP_DIR = "step_{:08d}"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_METADATA = ".metadata"  # written last by DCP's FileSystemWriter


def save_checkpoint(directory: str, model: nn.Module, optimizer=None, step: int = 0, *,
                    keep: Optional[int] = None, async_: bool = False):
    """Save `model` (and `optimizer`) as `directory/step_<step>`, atomically.

    Collective: every rank of the model's mesh calls it. Sharded parameters
    and optimizer state are written by the ranks that hold them. With `keep`,
    only the newest `keep` checkpoints are kept. Returns the checkpoint path.

    With `async_=True` it returns once this rank's pieces are copied to CPU
    memory, as a `concurrent.futures.Future` of the path: the files are
    written, and published as atomically, in a background thread while
    training goes on, and the checkpoint holds the values of the call. The
    next save or load of this model waits for it (and raises its error).
    """
    import torch.distributed.checkpoint as dcp

    _check_save_args(directory, optimizer, step, keep, async_)
    state = get_state(model)
    async_saves(state).wait()
    _check_bucket_meshes(state, "save_checkpoint")
    if optimizer is None:
        check_call(state, "fs.save_checkpoint")  # every rank is here, not one alone
    else:
        check_optimizer_export(state, optimizer, "fs.save_checkpoint", same_params=False)
    _check_writable(directory, state, step)
    final = os.path.join(directory, _STEP_DIR.format(step))
    tmp = os.path.join(directory, _TMP_PREFIX + _STEP_DIR.format(step))
    group, rank, _ = files_group(state)  # under TP: every rank of the (dp, tp) mesh
    if rank == 0:
        _remove_leftovers(directory)
    _barrier(group)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    holder = {"model": model_sd, "optim": optim_sd, "step": step}
    publish = functools.partial(_publish_step, tmp, final, directory, keep, rank == 0)
    if async_:  # its writer thread quiets DCP's note itself (not here: this thread's
        # filter entry would go out while the writer's, equal to it, is in use)
        return async_saves(state).start(holder, tmp, publish)
    with _single_process_quiet(state):
        dcp.save(holder, checkpoint_id=tmp, process_group=group)
    publish(group)
    return final


def _publish_step(tmp: str, final: str, directory: str, keep, writer: bool, group) -> str:
    """After every rank of `group` wrote its files into `tmp` (and rank 0 DCP's
    metadata): rename `tmp` to `final` on rank 0, prune, and let every rank on."""
    _barrier(group)
    if writer:
        _publish(tmp, final)
        if keep is not None:
            _prune(directory, keep)
    _barrier(group)
    return final


def load_checkpoint(path: str, model: nn.Module, optimizer=None, *, strict: bool = True) -> int:
    """Load the newest complete checkpoint under `path` (or the checkpoint
    `path` itself) into `model` (and `optimizer`), in place. Returns its step.

    Reads flexshard's checkpoints and the DCP checkpoints FSDP2 users write
    from DSD's state dicts: `{"model", "optim" or "optimizer"}`, `{"app":
    {...}}`, or the model's keys at the top level (checkpoint/layouts.py).

    Collective. The checkpoint may come from any world size and placements.
    Before any collective, every rank compares the checkpoint's keys, shapes
    and dtypes with the model's and raises a ValueError naming those that
    differ. With `strict=False` the keys both hold are loaded (the others are
    named in a warning) and a dtype that differs is cast to the model's; the
    shapes must still match, and an optimizer is refused when model keys are
    missing (it would have no state for them).
    """
    import torch.distributed.checkpoint as dcp

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_checkpoint: path must be a str or os.PathLike, got {path!r}")
    if not isinstance(strict, bool):
        raise TypeError(f"load_checkpoint: strict must be True or False, got {strict!r}")
    state = get_state(model)
    async_saves(state).wait()
    _check_bucket_meshes(state, "load_checkpoint")
    ckpt = find_checkpoint(os.fspath(path))
    metadata = _read_metadata(ckpt)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    saved = metadata.state_dict_metadata
    found = layouts.match(ckpt, saved, model_sd, optim_sd, strict)  # flexshard's, FSDP2 users'
    holder = layouts.holder(found.layout, saved, found.model_sd, optim_sd)
    with _single_process_quiet(state):
        dcp.load(holder, checkpoint_id=ckpt, process_group=files_group(state)[0])
    _set_state_dicts(model, optimizer, found.model_sd, optim_sd, strict)
    if not strict:
        _warn_partial(ckpt, found, len(model_sd))
    return layouts.loaded_step(ckpt, saved, holder)


def _set_state_dicts(model, optimizer, model_sd: dict, optim_sd: dict, strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_state_dict)

    options = StateDictOptions(strict=strict)
    if optimizer is None:
        set_model_state_dict(model, model_sd, options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=options)


def _warn_partial(ckpt: str, found, wanted: int) -> None:
    """load_checkpoint(strict=False)'s report: what it left out or cast."""
    if not (found.missing or found.unexpected or found.cast):
        return
    warnings.warn(f"load_checkpoint(strict=False) loaded {len(found.model_sd)} of the model's "
                  f"{wanted} keys from {ckpt!r}; not in the checkpoint (left as they were): "
                  f"{layouts.few(found.missing)}; in the checkpoint but not the model (not "
                  f"loaded): {layouts.few(found.unexpected)}; cast to the model's dtype: "
                  f"{layouts.few(found.cast)}", stacklevel=3)


def _read_metadata(ckpt: str):
    import torch.distributed.checkpoint as dcp

    try:
        return dcp.FileSystemReader(ckpt).read_metadata()
    except (EOFError, OSError, ValueError, AttributeError, ImportError) as e:
        raise ValueError(f"checkpoint {ckpt!r} is damaged: its {_METADATA} cannot be read "
                         f"({type(e).__name__}: {e}); load an earlier step_* checkpoint") from e
    except Exception as e:  # pickle.UnpicklingError and friends
        if type(e).__module__ in ("pickle", "_pickle"):
            raise ValueError(f"checkpoint {ckpt!r} is damaged: its {_METADATA} cannot be "
                             f"unpickled ({e}); load an earlier step_* checkpoint") from e
        raise


def find_checkpoint(path: str) -> str:
    """`path` if it is a complete checkpoint, else its newest complete
    `step_*` checkpoint. FileNotFoundError / ValueError saying what is wrong."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}: not a directory; pass the "
                                "directory given to save_checkpoint or one of its step_* dirs")
    if os.path.exists(os.path.join(path, _METADATA)):
        return path
    steps = sorted((int(m.group(1)), name) for name in os.listdir(path)
                   if (m := _STEP_RE.match(name)))
    for _, name in reversed(steps):
        if os.path.exists(os.path.join(path, name, _METADATA)):
            return os.path.join(path, name)
    partial = [n for _, n in steps] + [n for n in os.listdir(path) if n.endswith(".distcp")]
    if partial:
        raise ValueError(f"checkpoint {path!r} is incomplete: {_METADATA} is missing from "
                         f"{sorted(partial)} (a save that did not finish); load an earlier "
                         "checkpoint")
    raise FileNotFoundError(f"no checkpoint in {path!r}: it has no step_* directory with "
                            f"a {_METADATA} file")


def _state_dicts(model, optimizer) -> tuple:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return get_model_state_dict(model), {}
    get_state(model).state_dict_hooks.optimizers.attach(optimizer)
    return get_state_dict(model, optimizer)


def _check_bucket_meshes(state, what: str) -> None:
    """A bucket whose own mesh spans part of the model's ranks (expert
    parallelism) holds other params, under the same names, on the other ranks.
    Each must be a DTensor sharded over the other ranks (experts as
    DTensor(Shard(0)) over the expert-parallel mesh, as torchtitan makes them):
    then every group's piece has its place in the global tensor. A plain
    tensor would put every group's values at the same place."""
    for bucket in state.buckets:
        if bucket.mesh is None or bucket.mesh.size() >= state.mesh_size:
            continue
        specs = [w.tp for w in bucket.wiring]
        plain = [s.fqn for s, spec in zip(bucket.slots, specs)
                 if spec is None or not spec.sharded_over_tp]
        if plain:
            raise ValueError(
                f"{what}: bucket {bucket.name!r} runs on its own mesh of {bucket.mesh.size()} of "
                f"the model's {state.mesh_size} ranks, and its parameter {plain[0]!r} is a plain "
                "tensor: the other ranks hold other values under that name (other experts), and "
                "a checkpoint cannot tell where each group's values belong. Make the expert "
                "params DTensors sharded over the expert-parallel mesh before flex_shard, e.g. "
                "nn.Parameter(DTensor.from_local(local_experts, mesh['ep'], [Shard(0)]))")


def _check_save_args(directory, optimizer, step, keep, async_) -> None:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"save_checkpoint: directory must be a str or os.PathLike, "
                        f"got {directory!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"save_checkpoint: optimizer must be a torch.optim.Optimizer or None, "
                        f"got {type(optimizer).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint: step must be an int >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"save_checkpoint: keep must be None or an int >= 1, got {keep!r}")
    if not isinstance(async_, bool):
        raise TypeError(f"save_checkpoint: async_ must be True or False, got {async_!r}")


def _check_writable(directory, state, step: int) -> None:
    """Raise ValueError on every rank unless every rank can write `directory`
    and it holds no checkpoint of a later step than `step`."""
    problem, (group, rank, size) = "", files_group(state)
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".probe-rank{rank}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
        problem = _later_steps(directory, step)
    except OSError as e:
        problem = f"{type(e).__name__}: {e}"
    failed = torch.tensor([1.0 if problem else 0.0], device=state.buckets[0].compute_device)
    if group is not None and size > 1:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if failed.item():
        raise ValueError(f"save_checkpoint: cannot write checkpoints to {os.fspath(directory)!r} "
                         f"({problem or 'another rank could not write it'}); pass a directory "
                         "every rank can write, holding no later steps")


def _later_steps(directory, step: int) -> str:
    """Why a save of `step` must not go into `directory` (it holds later steps,
    another run's or those a resume rolled back from), or ''. load_checkpoint's
    newest would not be this run's, and keep= would prune this run's first."""
    later = sorted(int(m.group(1)) for n in os.listdir(directory) if (m := _STEP_RE.match(n))
                   and int(m.group(1)) > step)
    if not later:
        return ""
    return (f"it holds checkpoint step {later[-1]}, after this save's step {step}: "
            "load_checkpoint would resume from that one, and keep= would delete this run's "
            "first. Resume from it, save into another directory, or remove the steps after "
            f"{step} to roll back")


def _publish(tmp: str, final: str) -> None:
    """Rename the finished temp dir to its final name (replacing an older
    checkpoint of the same step only once the new one is complete)."""
    old = None
    if os.path.exists(final):
        old = os.path.join(os.path.dirname(final), _TMP_PREFIX + "old-" + os.path.basename(final))
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(directory: str) -> None:
    """Remove what crashed saves left behind (their temp dirs)."""
    for name in os.listdir(directory):
        if name.startswith(_TMP_PREFIX):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _prune(directory: str, keep: int) -> None:
    steps = sorted((int(m.group(1)), n) for n in os.listdir(directory) if (m := _STEP_RE.match(n)))
    for _, name in steps[:-keep]:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _single_process_quiet(state):
    """Without a process group DCP warns that it assumes one process: that is
    the intent here (a model wrapped without torch.distributed). One filter entry
    in and out, not warnings.catch_warnings, whose exit would swap back a filter
    list the background save's own entry went into meanwhile (async_save.py)."""
    return quiet_without_group(state.mesh_group)


def _barrier(group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
