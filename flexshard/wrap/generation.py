"""Hugging Face `generate()` on a model sharded over several ranks.

generate() calls the model once per new token until every sequence of *this*
rank has ended. A rank whose sequences end sooner stops calling forward, and so
stops joining the gathers its peers still wait in: under gloo a peer fails with
"Connection closed by peer" or a mismatched collective, under NCCL it hangs.
transformers keeps finished ranks calling forward when generate's `synced_gpus`
is True, and turns it on by itself only for FSDP and DeepSpeed models. The class
a flex_shard model becomes makes True the default of its generate when the model
spans several ranks; a value the caller passes is kept.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable


def synced_generate(cls: type, spans_ranks: Callable) -> dict:
    """{"generate": ...} for the wrapped class of `cls` when cls.generate takes
    `synced_gpus` (transformers' GenerationMixin; PEFT's models pass their keyword
    arguments on to it), else {}. `spans_ranks(module)`: whether the model's mesh
    has more than one rank."""
    generate = getattr(cls, "generate", None)
    if not inspect.isfunction(generate) or not _takes_synced_gpus(cls, generate):
        return {}

    @functools.wraps(generate)
    def generate_in_step(self, *args, synced_gpus=None, **kwargs):
        if synced_gpus is None and spans_ranks(self):
            synced_gpus = True  # every rank calls forward until all have finished
        return generate(self, *args, synced_gpus=synced_gpus, **kwargs)

    return {"generate": generate_in_step}


def _takes_synced_gpus(cls: type, generate) -> bool:
    params = inspect.signature(generate).parameters
    if "synced_gpus" in params:
        return True
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return passes_on and cls.__module__.split(".")[0] == "peft"
