"""The names a state dict gives a wrapped model's parameters and buffers.

`named_parameters()` walks every module, wrappers included, so a block wrapped
by torch's checkpoint_wrapper (the activation-checkpointing recipe) or
torch.compile names its weight `layers.0._checkpoint_wrapped_module.up.weight`
or `layers.0._orig_mod.up.weight`. The unwrapped model's `state_dict()`, DSD's
`get_model_state_dict` and so Hugging Face's `save_pretrained` say
`layers.0.up.weight`: flexshard's full-tensor state dicts and grads use those
names, and its full-tensor loaders take either spelling.
"""

from __future__ import annotations

import torch.nn as nn

from ..compat import CHECKPOINT_WRAPPED_MODULE, COMPILED_ORIG_MOD, is_compiled_wrapper


def state_dict_name(root: nn.Module, name: str) -> str:
    """`name` (a path from `root`, as named_parameters() gives it) without the
    wrappers' attributes: the key the unwrapped model's state dict has."""
    if CHECKPOINT_WRAPPED_MODULE not in name and COMPILED_ORIG_MOD not in name:
        return name  # the common case: no walk
    kept, module = [], root
    for attr in name.split("."):
        if not _wrapper_attr(module, attr):
            kept.append(attr)
        module = getattr(module, attr, None) if isinstance(module, nn.Module) else None
    return ".".join(kept)


def _wrapper_attr(module, attr: str) -> bool:
    """Whether `module.attr` is the module a wrapper holds (left out of state-dict keys).
    checkpoint_wrapper's by name alone, as torch's own state-dict code strips it."""
    if attr == CHECKPOINT_WRAPPED_MODULE:
        return True
    return attr == COMPILED_ORIG_MOD and module is not None and is_compiled_wrapper(module)
