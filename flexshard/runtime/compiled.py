"""What flexshard needs from torch.compile: its hooks run eagerly, outside graphs,
and inductor on CPU has a C++ compiler.

A compiled block (`block.compile()`, `torch.compile(block)`) or a compiled model
runs flexshard's forward hooks eagerly: `nn.Module.compile` and `torch.compile`
of a module start dynamo at the module's `forward` frame, so the hooks that
`_call_impl` runs around it are not traced; a compiled parent that calls a
hooked block inside its own traced forward would trace them, so every hook
flexshard registers is also wrapped in `torch.compiler.disable`: dynamo ends the
graph before the hook (a graph break), runs it eagerly and resumes after it.
flexshard's hooks gather and reduce through process groups, read storage
pointers and push saved-tensor hooks: none of that is traceable (fake tensors
have no storage).

The compiled graph sees the unsharded params the pre-forward hook installed as
ordinary inputs. AOTAutograd turns off saved-tensor hooks while it traces and
inlines only hooks that are fx GraphModules, so ours are not traced either: at
run time the graph's autograd function saves its tensors (the unsharded params
among them) through `SavedParams.pack`, exactly as eager ops do, and backward
regathers through `unpack`.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import torch

from ..compat import inductor_cpp_compilers

_HOOK_REASON = (
    "flexshard's forward hooks gather and reshard parameters through process groups "
    "and run eagerly; compile each block instead (block.compile() after flex_shard), "
    "or the whole model without fullgraph=True (a graph break at each hooked module)")


def run_eagerly(hook: Callable) -> Callable:
    """`hook`, never traced by dynamo (a graph break where a traced frame calls it)."""
    return torch.compiler.disable(hook, recursive=True, reason=_HOOK_REASON)


def check_cpp_compiler(device: torch.device, backend: str = "inductor") -> None:
    """Raise RuntimeError, naming the fix, when inductor would compile CPU code and
    no C++ compiler it searches for is on PATH (inductor's own search would fail at
    the first forward, or fall back to eager if dynamo's errors are suppressed)."""
    if backend != "inductor" or torch.device(device).type != "cpu":
        return
    candidates = inductor_cpp_compilers()
    for cxx in candidates:
        if cxx is None:
            if os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"):
                return  # inductor installs gcc through conda itself
        elif shutil.which(cxx):
            return
    names = ", ".join(repr(c) for c in candidates if c is not None)
    raise RuntimeError(
        f"torch.compile with the inductor backend on CPU needs a C++ compiler, and none "
        f"of {names} (torch._inductor.config.cpp.cxx, the CXX environment variable) is on "
        "PATH: install one (e.g. apt-get install g++), set CXX to one, or turn compile off")
