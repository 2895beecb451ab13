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
pointers and free storages: none of that is traceable (fake tensors
have no storage).

The compiled graph sees the unsharded params the pre-forward hook installed as
ordinary inputs: the params made once (runtime/unsharded.py), which its autograd
function saves as eager ops do, freed after forward and refilled by the hook on
the block's outputs before its backward.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Callable, Optional, Sequence

import torch

from ..compat import COMPILED_GRAPH_NODE, inductor_cpp_compilers, tree_map

_HOOK_REASON = (
    "flexshard's forward hooks gather and reshard parameters through process groups "
    "and run eagerly; compile the whole model with fs.compile(model, fullgraph=True) "
    "(the gathers and reductions in the graph), or each block (block.compile() after "
    "flex_shard); a block inside an activation checkpoint wrapper: compile the block, "
    "wrapper._checkpoint_wrapped_module.compile() (dynamo cannot break a graph inside "
    "a checkpoint, so a compiled wrapper runs eagerly)")


def run_eagerly(hook: Callable) -> Callable:
    """`hook`, never traced by dynamo (a graph break where a traced frame calls it)."""
    return torch.compiler.disable(hook, recursive=True, reason=_HOOK_REASON)


def _grad_fns(tree) -> list:
    fns = []
    tree_map(lambda t: fns.append(t.grad_fn) if isinstance(t, torch.Tensor)
             and t.grad_fn is not None else None, tree)
    return fns


def ran_compiled(inputs, output) -> Optional[bool]:
    """Whether a compiled graph ran between `inputs` and `output`: a compiled graph's
    node in the autograd graph from `output` back to `inputs` (not past them).
    None when autograd recorded nothing to tell by (no grad)."""
    todo = _grad_fns(output)
    if not todo:
        return None
    stop = {id(fn) for fn in _grad_fns(inputs)}
    seen = {}  # id -> node: holding the nodes keeps their ids unique while walking
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        if node.name() == COMPILED_GRAPH_NODE:
            return True
        todo.extend(fn for fn, _ in node.next_functions)
    return False


class EagerCompiledBlocks:
    """Says once per model when a block the user compiled with nn.Module.compile()
    ran its forward eagerly. dynamo may skip such a block's frame without a word: torch
    2.11 skips the forward of torch.nn's own modules (nn.Linear,
    nn.TransformerEncoderLayer; measured, CPU) under .compile() even with flexshard's
    hooks on them (2.13 and 2.14 compile it); a block that silently runs eagerly
    trains correctly, only slower. Each block is checked once, at its first forward
    under grad after it was compiled, by walking the autograd graph it recorded back
    to its inputs (a few hundred nodes, once)."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, names: Sequence[str], inputs, output, checkpointed: bool = False) -> bool:
        """Check one forward of a compiled block running buckets `names` (`checkpointed`:
        the user compiled an activation checkpoint wrapper around it); False when it
        could not tell (no grad recorded), so the next forward checks again."""
        compiled = ran_compiled(inputs, output)
        if compiled is None:
            return False
        if not compiled and not self.warned:
            self.warned = True
            why = (" A block inside an activation checkpoint wrapper runs flexshard's hooks "
                   "inside the checkpoint, where dynamo cannot break a graph, so the compiled "
                   "wrapper runs eagerly: compile the block inside it instead, "
                   "wrapper._checkpoint_wrapped_module.compile() (as flexshard's torchtitan "
                   "integration does)." if checkpointed else
                   " torch 2.11, for one, skips the forward of torch.nn's own modules, such "
                   "as nn.Linear, under .compile(): compile it with "
                   "`parent.name = torch.compile(block)`, or compile a block class of your "
                   "own with .compile().")
            warnings.warn(
                f"flexshard: the block running bucket(s) {', '.join(map(repr, names))} was "
                f"compiled but ran its forward eagerly: dynamo compiled no graph for it.{why} "
                "TORCH_LOGS=graph_breaks says why dynamo skipped it. (Said once per model.)",
                stacklevel=2)
        return True


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
