"""The compiled backward's reduce-scatters in FSDP2's order, one in flight: an
inductor post-grad pass fs.compile installs (imported only then: it imports
inductor).

Each reduce-scatter after the first takes more, empty, pieces: an empty
slice of each of the one before's waited outputs, so it is issued after that wait and
overlaps the next block's backward compute. Left alone, inductor places each
wait where its peak-memory reorder likes, which can be the end of the graph:
every bucket's full grads alive at once (the reorder counts a collective's
input freed at the collective, not at its wait: benchmarks/RESULTS.md,
"torch.compile"). A pass after tracing, not a token handed between modules in
the traced code: that handoff is a Python side effect, which dynamo refuses
inside a block the user checkpoints.
"""

from __future__ import annotations

import operator

import torch

from ..compat import functional_collectives, inductor_graph_pass

CustomGraphPass, get_hash_for_files = inductor_graph_pass()

# a bucket's reductions: its reduce-scatter, and its compact groups' all-reduce
# (runtime/traced.py); HSDP's and tensor parallelism's all-reduces are not coalesced
_REDUCES = (functional_collectives.reduce_scatter_tensor_coalesced.default,
            functional_collectives.all_reduce_coalesced.default)
_WAIT = functional_collectives.wait_tensor.default


class ChainReduces(CustomGraphPass):
    """Post-grad pass: each bucket reduction waits for the last one before it whose
    outputs are waited (one whose outputs nothing reads, a rank holding nothing of
    its bucket's, has no wait to chain to)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        reduces = [n for n in graph.nodes if n.target in _REDUCES]
        pieces = {n: len(n.args[0]) for n in reduces}  # before the empty ones join
        last = []  # the waited outputs of the last reduction that has any
        for node in reduces:
            waited = waited_outputs(node, pieces[node])
            if last and node.users:
                _chain(graph, order, node, pieces[node], last)
            last = waited or last

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def waited_outputs(node: torch.fx.Node, pieces: int) -> list:
    """The waits on the first `pieces` outputs of the collective `node`."""
    return [w for g in node.users if g.target is operator.getitem and g.args[1] < pieces
            for w in g.users if w.target is _WAIT]


def _chain(graph: torch.fx.Graph, order: dict, node: torch.fx.Node, pieces: int,
           waited: list) -> None:
    """Give `node` an empty slice of each of `waited` as extra pieces, each waited."""
    with graph.inserting_before(node):
        empty = [graph.call_function(torch.ops.aten.slice.Tensor, (w, 0, 0, 0)) for w in waited]
    node.args = (list(node.args[0]) + empty, *node.args[1:])
    at = max(node.users, key=order.get)
    for i in range(pieces, pieces + len(empty)):
        with graph.inserting_after(at):  # every piece of a collective waited
            at = graph.call_function(operator.getitem, (node, i))
        with graph.inserting_after(at):
            at = graph.call_function(_WAIT, (at,))
