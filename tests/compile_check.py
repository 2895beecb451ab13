"""Did a compiled graph run? The compile tests ask it of every step, so a block that
silently runs eagerly (dynamo skipped its frame) fails them instead of matching eager.
And what did fs.compile's graphs hold? `counting_backend` records each graph's
functional collectives (tests/test_whole_step.py, tests/test_tensor_parallel.py)."""

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


COLLECTIVES = ("all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_reduce",
               "all_reduce_coalesced")  # the last: a compact reduce group's (runtime/traced.py)


def _chained(reduces: list, pieces: dict) -> list:
    """Per bucket reduction after the first that has a waited one before it and
    outputs read: whether it takes an empty piece made from each of the last such
    one's waited outputs (FSDP2's order, one in flight). `pieces`: each node's
    pieces before the pass added any."""
    from flexshard.runtime.reduce_order import waited_outputs

    def ancestors(node):
        seen, todo = set(), [node]
        while todo:
            for a in todo.pop().all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    todo.append(a)
        return seen
    empty = (torch.ops.aten.slice.Tensor, (0, 0, 0))
    out, last = [], []
    for node in reduces:
        if last and node.users:
            out.append(all(any((p.target, tuple(p.args[1:])) == empty and w in ancestors(p)
                               for p in node.args[0]) for w in last))
        last = waited_outputs(node, pieces[node]) or last
    return out


# a bucket's reductions (flexshard/runtime/reduce_order.py)
_REDUCES = ("reduce_scatter_tensor_coalesced", "all_reduce_coalesced")
# ops a slice's or an index's grad writes: a whole zero-filled input each
_SCATTERS = ("slice_backward", "as_strided_scatter", "select_backward", "index_put")


def counting_backend(graphs: list, gathered: list = None, chains: list = None,
                     matmuls: list = None, groups: list = None, scatters: list = None):
    """aot_eager that records, per compiled forward and backward graph, how many
    of each functional collective it holds (and in `gathered`, if given, the
    bytes each graph's all-gathers send from this rank). The backward graph runs
    through fs.compile's reduce-order pass first, as inductor's post-grad pass
    does (`chains`, if given: whether each reduce-scatter waits for the one before;
    `matmuls`, if given: each graph's matmuls, mm, addmm and bmm; `groups`, if given:
    each graph's {(collective, group name): count}; `scatters`, if given: the elements
    each graph's slice- and index-grad ops write, _SCATTERS)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from flexshard.runtime.reduce_order import ChainReduces

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            if kind == "backward":
                pieces = {n: len(n.args[0]) for n in gm.graph.nodes
                          if getattr(n.target, "__name__", "").split(".")[0] in _REDUCES}
                ChainReduces()(gm.graph)
                gm.recompile()
            calls = [n for n in gm.graph.nodes if n.op == "call_function"]
            names = [getattr(n.target, "__name__", str(n.target)).split(".")[0] for n in calls]
            graphs.append((kind, {c: names.count(c) for c in COLLECTIVES}))
            if gathered is not None:
                gathered.append((kind, sum(
                    t.meta["val"].nbytes for n, name in zip(calls, names)
                    if name == "all_gather_into_tensor_coalesced" for t in n.args[0])))
            if groups is not None:
                named = [(name, n.args[-1]) for n, name in zip(calls, names) if name in COLLECTIVES]
                groups.append((kind, {k: named.count(k) for k in set(named)}))
            if scatters is not None:
                scatters.append((kind, sum(n.meta["val"].numel() for n, name in zip(calls, names)
                                           if name in _SCATTERS)))
            if matmuls is not None:
                matmuls.append((kind, sum(names.count(m) for m in ("mm", "addmm", "bmm"))))
            if chains is not None and kind == "backward":
                chains.extend(_chained([n for n, name in zip(calls, names) if name in _REDUCES],
                                       pieces))
            return make_boxed_func(gm.forward)
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))
