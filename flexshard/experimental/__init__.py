"""Experimental: measured, tested, not the default and not public API (see design.md).

`ingraph.compile_gather_in_graph(model, block)` compiles a block with its buckets'
gathers inside the graph.
"""
