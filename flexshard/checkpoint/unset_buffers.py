"""Buffers that to_empty() left uninitialised: refused at the first forward.

`module.to_empty(device=...)` gives every buffer that was on the meta device
fresh, uninitialised memory. A persistent buffer comes back from a loader; a
non-persistent one (a rotary embedding's `inv_freq`) is in no state dict, so
unless an init function recomputes it the model would compute with garbage.
Each such buffer is remembered with its version counter: an in-place write
(a loader's `copy_`, an init function's `fill_`) bumps it, and assigning a new
tensor replaces it. A buffer still the same tensor at the same version at the
first forward was never written, and that forward raises before any compute
or collective. Every rank runs the same wrap, to_empty and loads, so every
rank raises alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

from ..compat import tensor_version


class _Fresh(NamedTuple):
    module: nn.Module  # the module registering the buffer
    name: str  # its attribute there
    tensor: object  # the tensor to_empty() made
    version: int  # its version counter then


def meta_buffers(module: nn.Module) -> list:
    """[(fqn, owning module, attribute)] of the buffers now on the meta device."""
    return [(f"{prefix}.{name}" if prefix else name, sub, name)
            for prefix, sub in module.named_modules(remove_duplicate=False)
            for name, buf in sub._buffers.items() if buf is not None and buf.is_meta]


class UnsetBuffers:
    """The buffers to_empty() allocated and nothing has written since."""

    def __init__(self) -> None:
        self._fresh: dict = {}  # fqn -> _Fresh
        self._hook = None  # the root's forward pre-hook while any are fresh

    def track(self, root: nn.Module, were_meta: list) -> None:
        """After nn.Module._apply: remember each of `were_meta` (meta_buffers()
        before it) that is now real memory, and check them at the next forward."""
        for fqn, sub, name in were_meta:
            buf = sub._buffers.get(name)
            if buf is not None and not buf.is_meta:
                self._fresh[fqn] = _Fresh(sub, name, buf, tensor_version(buf))
        if self._fresh and self._hook is None:  # first of the root's pre-hooks: before any gather
            self._hook = root.register_forward_pre_hook(self._check, prepend=True)

    def unset(self) -> list:
        """FQNs of the tracked buffers nothing has written or replaced."""
        return [fqn for fqn, f in self._fresh.items()
                if f.module._buffers.get(f.name) is f.tensor
                and tensor_version(f.tensor) == f.version]

    def _check(self, root: nn.Module, args) -> None:
        names = self.unset()
        if names:
            raise ValueError(
                f"buffer(s) {', '.join(names)} were on the meta device and are still the "
                "uninitialised memory module.to_empty() gave them: no loader or init "
                "function has written them (non-persistent buffers, such as a rotary "
                "embedding's inv_freq, are in no state dict). Initialise them before the "
                "first forward: model.init_parameters(init_fn) with an init_fn(module) that "
                "also sets each module's buffers (a Hugging Face model's own: "
                "model.init_parameters(model._init_weights)), or write them in place "
                "(buffer.copy_(value)); see docs/meta-device.md")
        self._fresh.clear()
        self._hook.remove()
        self._hook = None
