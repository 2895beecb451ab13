"""Where a DCP checkpoint keeps the model and the optimizer: the layouts that
`fs.load_checkpoint` reads.

flexshard writes `{"model": ..., "optim": ..., "step": N}`. FSDP2 users write
the state dicts of DSD's `get_state_dict` (keys by FQN) under other names:
`{"model", "optimizer"}` (the DCP tutorial, torchtitan's optimizer key), an
`{"app": {"model", "optim"}}` Stateful, or the model's keys at the top level
(`dcp.save(get_model_state_dict(model))`, torchtitan). A layout is found by
the model's keys: the first prefix under which every one of them is saved.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

import torch

MODEL_PREFIXES = ("model.", "app.model.", "")  # "": the FQNs at the top level
OPTIM_KEYS = ("optim", "optimizer")  # beside the model: "model.x" -> "optim.state.x.exp_avg"
_STEP_DIR = re.compile(r"step[-_](\d+)$")


class Layout(NamedTuple):
    """The prefixes a checkpoint keeps the model's and optimizer's keys under."""

    model: str  # e.g. "model." or "" (top level)
    optim: Optional[str]  # e.g. "optim." or "app.optimizer."; None: no optimizer state wanted


def find_layout(ckpt: str, saved: dict, model_sd: dict, optim_sd: dict) -> Layout:
    """The layout of checkpoint `ckpt` (its metadata's keys `saved`) that holds
    every key of `model_sd` and of `optim_sd`'s state, else ValueError naming
    the keys found and the keys needed."""
    fqns = list(model_sd)
    for prefix in MODEL_PREFIXES:
        if not all(prefix + k in saved for k in fqns):
            continue
        if not optim_sd:
            return Layout(prefix, None)
        for name in OPTIM_KEYS:
            optim = prefix[:-len("model.")] + name + "."
            if all(key in saved for key in _optim_keys(optim, optim_sd)):
                return Layout(prefix, optim)
        raise ValueError(
            f"checkpoint {ckpt!r} holds the model under {prefix or 'the top level'!r} but not "
            f"this optimizer's state: it needs e.g. {_optim_keys(prefix[:-6] + 'optim.', optim_sd)[:1]} "
            f"(or 'optimizer.' in place of 'optim.'); it holds {_sample(saved)}. Load it without "
            "the optimizer (load_checkpoint(path, model)), or save the optimizer with DSD's "
            "get_state_dict(model, optimizer)")
    missing = fqns[0] if fqns else "?"
    raise ValueError(
        f"checkpoint {ckpt!r} does not hold this model: load_checkpoint looks for every parameter "
        f"under one of 'model.', 'app.model.' or the top level (e.g. {'model.' + missing!r}), "
        f"and it holds {_sample(saved)}; it was saved from another model, or under other keys "
        "(save {'model': get_model_state_dict(model), 'optim': ...} with DCP, or use "
        "fs.save_checkpoint)")


def _optim_keys(prefix: str, optim_sd: dict) -> list:
    return [f"{prefix}state.{fqn}.{name}" for fqn, entries in optim_sd.get("state", {}).items()
            for name in entries]


def _sample(saved: dict, limit: int = 6) -> str:
    """A few of the checkpoint's keys, one per top-level name first."""
    firsts: dict = {}
    for key in saved:
        firsts.setdefault(key.split(".")[0], key)
    keys = list(firsts.values())[:limit]
    more = len(saved) - len(keys)
    return f"{len(saved)} keys: {keys}" + (f" and {more} more" if more > 0 else "")


def holder(layout: Layout, saved: dict, model_sd: dict, optim_sd: dict) -> dict:
    """The nested dict DCP loads into: the state dicts placed at the layout's
    prefixes, and the step where flexshard keeps it."""
    out: dict = {}
    _place(out, layout.model, model_sd)
    if layout.optim is not None:
        _place(out, layout.optim, optim_sd)
    if "step" in saved and "step" not in out:
        out["step"] = -1  # flexshard's layout (and DCP's tutorials') keep the step here
    return out


def _place(out: dict, prefix: str, state_dict: dict) -> None:
    if not prefix:
        out.update(state_dict)
        return
    *parents, last = prefix[:-1].split(".")
    for name in parents:
        out = out.setdefault(name, {})
    out[last] = state_dict


def loaded_step(ckpt: str, saved: dict, loaded: dict) -> int:
    """The checkpoint's step: its "step" entry, else the N of a directory
    named step-N or step_N (torchtitan's, flexshard's), else 0."""
    step = loaded.get("step", -1) if "step" in saved else -1
    if isinstance(step, torch.Tensor):
        step = step.item()
    if int(step) >= 0:
        return int(step)
    match = _STEP_DIR.search(ckpt.rstrip("/"))
    return int(match.group(1)) if match else 0


def check_shapes(ckpt: str, saved: dict, layout: Layout, model_sd: dict, optim_sd: dict) -> None:
    """ValueError naming the first key the checkpoint holds in another shape."""
    wanted = {layout.model + k: v for k, v in model_sd.items()}
    if layout.optim is not None:
        for fqn, entries in optim_sd.get("state", {}).items():
            wanted.update({f"{layout.optim}state.{fqn}.{name}": v for name, v in entries.items()})
    for key, value in wanted.items():
        size = getattr(saved[key], "size", None)
        if size is not None and isinstance(value, torch.Tensor) and tuple(size) != value.shape:
            raise ValueError(f"checkpoint {ckpt!r}: {key!r} has shape {tuple(size)} but the "
                             f"model's is {tuple(value.shape)}; load it into the same model")
