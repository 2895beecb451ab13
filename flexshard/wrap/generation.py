"""Hugging Face `generate()` on a model sharded over several ranks.

generate() calls the model once per new token until every sequence of *this*
rank has ended. A rank whose sequences end sooner stops calling forward, and so
stops joining the gathers its peers still wait in: under gloo a peer fails with
"Connection closed by peer" or a mismatched collective, under NCCL it hangs.
transformers keeps finished ranks calling forward when generate's `synced_gpus`
is True, and turns it on by itself only for FSDP and DeepSpeed models. The class
a flex_shard model becomes makes True the default of its generate when the model
spans several ranks; a value the caller passes is kept (None counts as not passed,
as in transformers).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

SYNCED = "synced_gpus"


def synced_generate(cls: type, spans_ranks: Callable) -> dict:
    """{"generate": ...} for the wrapped class of `cls` when cls.generate takes
    `synced_gpus`, or passes its keyword arguments on to a generate that does
    (transformers' GenerationMixin under a model's or a user's override, PEFT's
    models), else {}. `spans_ranks(module)`: whether the model's mesh has more
    than one rank."""
    generate = getattr(cls, "generate", None)
    if not inspect.isfunction(generate) or not _takes_synced_gpus(cls, generate):
        return {}
    positional = _positional_index(generate)

    @functools.wraps(generate)
    def generate_in_step(self, *args, **kwargs):
        passed = kwargs.get(SYNCED) is not None or len(args) >= positional  # args: no self
        if not passed and spans_ranks(self):
            kwargs[SYNCED] = True  # every rank calls forward until all have finished
        return generate(self, *args, **kwargs)

    return {"generate": generate_in_step}


def _takes_synced_gpus(cls: type, generate) -> bool:
    if SYNCED in inspect.signature(generate).parameters:
        return True
    # an override with **kwargs (BLIP-2, Kosmos-2, SeamlessM4T, ... or a user's subclass)
    # hands them to GenerationMixin.generate, by super() or a language model's generate
    return _passes_kwargs_on(generate) and (
        cls.__module__.split(".")[0] == "peft"  # PeftModel.generate: the base model's
        or any(_names_synced(c) for c in cls.__mro__))


def _passes_kwargs_on(fn) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD
               for p in inspect.signature(fn).parameters.values())


def _names_synced(c: type) -> bool:
    own = c.__dict__.get("generate")
    return inspect.isfunction(own) and SYNCED in inspect.signature(own).parameters


def _positional_index(generate) -> float:
    """How many positional arguments after self reach `synced_gpus`: a caller
    passing that many gave it by position (inf: it cannot be given so)."""
    params = list(inspect.signature(generate).parameters.values())[1:]
    for i, p in enumerate(params):
        if p.name == SYNCED:
            return i + 1 if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else float("inf")
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            break
    return float("inf")
