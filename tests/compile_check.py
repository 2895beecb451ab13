"""Did a compiled graph run? The compile tests ask it of every step, so a block that
silently runs eagerly (dynamo skipped its frame) fails them instead of matching eager."""

from __future__ import annotations

import torch

from flexshard.compat import COMPILED_GRAPH_NODE


def compiled_graph_calls(output: torch.Tensor) -> int:
    """How many calls of compiled graphs autograd recorded on the way to `output`:
    one node per call of a compiled forward (AOTAutograd's CompiledFunction), 0 when
    everything ran eagerly."""
    todo, seen = [output.grad_fn], {}  # seen holds the nodes, so their ids stay unique
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        todo.extend(fn for fn, _ in node.next_functions)
    return sum(node.name() == COMPILED_GRAPH_NODE for node in seen.values())
