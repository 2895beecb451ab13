"""Where a DCP checkpoint keeps the model and the optimizer: the layouts that
`fs.load_checkpoint` reads.

flexshard writes `{"model": ..., "optim": ..., "step": N}`. FSDP2 users write
the state dicts of DSD's `get_state_dict` (keys by FQN) under other names:
`{"model", "optimizer"}` (the DCP tutorial, torchtitan's optimizer key), an
`{"app": {"model", "optim"}}` Stateful, or the model's keys at the top level
(`dcp.save(get_model_state_dict(model))`, torchtitan). A layout is found by
the model's keys: the prefix under which the most of them are saved. Every
difference between the checkpoint and the model (keys, shapes, dtypes) is
found from the metadata alone, before anything is loaded (`match`).
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


class Match(NamedTuple):
    """How a checkpoint's keys meet the model's (load_checkpoint's plan)."""

    layout: Layout
    model_sd: dict  # the model's state dict, less the keys the checkpoint lacks (strict=False)
    missing: list  # model FQNs the checkpoint does not hold
    unexpected: list  # checkpoint keys (less the layout's prefix) the model does not have
    cast: list  # keys loaded into another dtype (strict=False)


def match(ckpt: str, saved: dict, model_sd: dict, optim_sd: dict, strict: bool) -> Match:
    """Find the layout of checkpoint `ckpt` (its metadata's keys `saved`) and
    compare it with the model's (and optimizer's) state dicts. ValueError, before
    anything is loaded, for keys missing or unexpected (unless not `strict`),
    shapes, and dtypes (unless not `strict`: then cast)."""
    prefix = _model_prefix(ckpt, saved, model_sd)
    missing = [k for k in model_sd if prefix + k not in saved]
    unexpected = _unexpected(saved, prefix, model_sd)
    if strict and (missing or unexpected):
        raise ValueError(
            f"checkpoint {ckpt!r} does not match the model (its keys under "
            f"{prefix or 'the top level'!r}): {_differences(missing, unexpected)}. Nothing was "
            "loaded. Load the checkpoint of this model, or pass strict=False to load only the "
            "keys both hold (as load_state_dict(strict=False))")
    if missing and optim_sd:
        raise ValueError(
            f"load_checkpoint(strict=False): checkpoint {ckpt!r} lacks {few(missing)} of the "
            "model, so it holds no optimizer state for them; load the model alone "
            "(load_checkpoint(path, model, strict=False)) and start a new optimizer")
    model_sd = {k: v for k, v in model_sd.items() if prefix + k in saved}
    layout = Layout(prefix, _optim_prefix(ckpt, saved, prefix, optim_sd) if optim_sd else None)
    cast = check_tensors(ckpt, saved, layout, model_sd, optim_sd, strict)
    cast = [k[len(prefix):] if k.startswith(prefix) else k for k in cast]  # model FQNs
    return Match(layout, model_sd, missing, unexpected, cast)


def _model_prefix(ckpt: str, saved: dict, model_sd: dict) -> str:
    """The prefix under which the checkpoint holds the most of the model's keys
    (the first such in MODEL_PREFIXES), else ValueError."""
    counts = [sum(prefix + k in saved for k in model_sd) for prefix in MODEL_PREFIXES]
    if model_sd and max(counts) > 0:
        return MODEL_PREFIXES[counts.index(max(counts))]
    example = next(iter(model_sd), "?")
    raise ValueError(
        f"checkpoint {ckpt!r} does not hold this model: load_checkpoint looks for every parameter "
        f"under one of 'model.', 'app.model.' or the top level (e.g. {'model.' + example!r}), "
        f"and it holds {_sample(saved)}; it was saved from another model, or under other keys "
        "(save {'model': get_model_state_dict(model), 'optim': ...} with DCP, or use "
        "fs.save_checkpoint)")


def _unexpected(saved: dict, prefix: str, model_sd: dict) -> list:
    """The checkpoint's model keys the model does not have: every key under the
    prefix, or at the top level those whose first name is one of the model's
    (other top-level entries are the optimizer's, the step, a trainer's state)."""
    if prefix:
        return [k[len(prefix):] for k in saved if k.startswith(prefix)
                and k[len(prefix):] not in model_sd]
    roots = {k.split(".")[0] for k in model_sd}
    return [k for k in saved if k.split(".")[0] in roots and k not in model_sd]


def _differences(missing: list, unexpected: list) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's keys are not in it: {few(missing)}")
    if unexpected:
        parts.append(f"it holds {len(unexpected)} keys the model does not have: "
                     f"{few(unexpected)}")
    return "; ".join(parts)


def few(keys: list, limit: int = 5) -> str:
    """A few keys, and how many more."""
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"{keys[:limit]}{more}"


def _optim_prefix(ckpt: str, saved: dict, prefix: str, optim_sd: dict) -> str:
    """Where the checkpoint beside the model at `prefix` holds every key of the
    optimizer's state, else ValueError naming the keys it lacks."""
    lacking = {}
    for name in OPTIM_KEYS:
        optim = prefix[:-len("model.")] + name + "."
        keys = _optim_keys(optim, optim_sd)
        lacking[optim] = [key for key in keys if key not in saved]
        if not lacking[optim]:
            return optim
    optim, missing = min(lacking.items(), key=lambda item: len(item[1]))
    if len(missing) < len(_optim_keys(optim, optim_sd)):  # some state saved, not all
        raise ValueError(
            f"checkpoint {ckpt!r} holds this optimizer's state under {optim!r} for some params "
            f"but not for others: it lacks {len(missing)} keys, {few(missing)}. An optimizer "
            "has no state for a param until the param's first step, so params frozen "
            "(requires_grad=False) when it was saved have none. Freeze the same params before "
            "loading (and unfreeze them after), or load the model alone "
            "(load_checkpoint(path, model)) and start the optimizer afresh")
    raise ValueError(
        f"checkpoint {ckpt!r} holds the model under {prefix or 'the top level'!r} but not "
        f"this optimizer's state: it needs e.g. {missing[:1]} "
        f"(or 'optimizer.' in place of 'optim.'); it holds {_sample(saved)}. Load it without "
        "the optimizer (load_checkpoint(path, model)), or save the optimizer with DSD's "
        "get_state_dict(model, optimizer)")


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


def check_tensors(ckpt: str, saved: dict, layout: Layout, model_sd: dict, optim_sd: dict,
                  strict: bool) -> list:
    """ValueError naming the keys the checkpoint holds in another shape, or
    (when `strict`) another dtype; returns the keys of another dtype otherwise."""
    shapes, dtypes = [], []
    for key, value in _wanted(layout, model_sd, optim_sd).items():
        meta = saved[key]
        if not isinstance(value, torch.Tensor) or getattr(meta, "size", None) is None:
            continue
        if tuple(meta.size) != tuple(value.shape):
            shapes.append(f"{key!r} has shape {tuple(meta.size)} but the model's is "
                          f"{tuple(value.shape)}")
        elif meta.properties.dtype != value.dtype:
            dtypes.append((key, f"{key!r} has dtype {meta.properties.dtype} but the model's "
                                f"is {value.dtype}"))
    bad = shapes + ([text for _, text in dtypes] if strict else [])
    if bad:
        more = f" ({len(bad)} keys differ: {few(bad, 3)})" if len(bad) > 1 else ""
        cast = "" if shapes else (", or pass strict=False to load it cast to the model's "
                                  "dtypes")
        raise ValueError(f"checkpoint {ckpt!r}: {bad[0]}; load it into the same model{cast}"
                         f"{more}. Nothing was loaded")
    return [key for key, _ in dtypes]


def _wanted(layout: Layout, model_sd: dict, optim_sd: dict) -> dict:
    """Checkpoint key -> the value it loads into."""
    wanted = {layout.model + k: v for k, v in model_sd.items()}
    if layout.optim is not None:
        for fqn, entries in optim_sd.get("state", {}).items():
            wanted.update({f"{layout.optim}state.{fqn}.{name}": v for name, v in entries.items()})
    return wanted
