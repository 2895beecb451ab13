"""Imports run one way (design.md, "Layers"): api / dry_run -> checkpoint -> runtime ->
planning -> config / placements -> runtime.comm -> torch. Planning computes plans
(pure records); runtime executes them every step; dry_run reports on a wrapped
model. Parsed, not imported; every module of the package must sit in a layer, so
a new file cannot dodge the check."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "flexshard"

# Each module may not import (directly or not) any module of a later layer. A layer
# entry ending in "." names every module under that package.
LAYERS = [
    {"runtime.gloo", "runtime.comm", "compat", "runtime.compiled", "tensor_views"},
    {"placements", "placements."},
    {"config"},
    {"planning", "planning.", "wrap", "wrap."},
    {"runtime.storage", "runtime.state", "runtime.offload", "runtime.counters",
     "runtime.inflight", "runtime.grad_reduce", "runtime.sharded_grad", "runtime.unsharded",
     "runtime.opaque_format", "runtime.grad_spans", "runtime.held", "runtime.rank_agreement"},
    {"runtime.gather"},
    {"runtime.bucket"},
    {"runtime.hooks", "runtime"},
    {"runtime.traced", "runtime.reduce_order", "runtime.explicit_unshard"},
    {"collectives", "collectives.", "clip", "grads", "optim"},
    {"checkpoint", "checkpoint."},
    {"api", "dry_run", "dry_run.", "whole_step"},
    {"", "integrations", "integrations."},
]
# Wings beside each other never import each other.
SIBLINGS = [("dry_run.", "api")]


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set:
    """flexshard modules `path` imports (relative imports resolved)."""
    name = _module_name(path)
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("flexshard"):
                mod = node.module[len("flexshard."):] if node.module != "flexshard" else ""
            else:
                continue
            out.add(mod)
            out.update(f"{mod}.{a.name}".lstrip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name[len("flexshard."):] for a in node.names
                       if a.name.startswith("flexshard."))
    return out


def _graph() -> dict:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {name: {m for m in _imports(p) if m in files and m != name}
            for name, p in files.items()}


def _reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _layer_of(name: str) -> int:
    """A module's layer: where its name is listed, else where a package entry holds it."""
    hits = [i for i, layer in enumerate(LAYERS) if name in layer]
    hits = hits or [i for i, layer in enumerate(LAYERS)
                    if any(e.endswith(".") and name.startswith(e) for e in layer)]
    if len(hits) != 1:
        raise AssertionError(f"module {name!r} is in layers {hits}; put it in exactly one")
    return hits[0]


def test_every_module_has_a_layer():
    graph = _graph()
    assert len(graph) > 30  # the whole package was found
    for name in graph:
        _layer_of(name)


def test_no_import_cycles():
    graph = _graph()
    # The parser sees the real edges (a check of the check).
    assert {"runtime.bucket", "runtime.hooks", "placements.contract",
            "runtime.comm"} <= _reachable(graph, "api")
    for name in graph:
        assert name not in _reachable(graph, name), f"{name} imports itself through a cycle"


def test_lower_layers_never_import_higher_ones():
    graph = _graph()
    for name in graph:
        level = _layer_of(name)
        bad = sorted(m for m in _reachable(graph, name) if _layer_of(m) > level)
        assert not bad, f"{name} (layer {level}) reaches {bad}"


def test_sibling_wings_stay_apart():
    graph = _graph()
    for a, b in SIBLINGS:
        for x, y in ((a, b), (b, a)):
            for name in graph:
                if name.startswith(x):
                    bad = sorted(m for m in graph[name] if m.startswith(y))
                    assert not bad, f"{name} imports {bad} from a sibling wing"


# When the code runs. Wrap time: flex_shard (and the setters and device moves between
# steps) plans and builds. Per step: what a training step runs. A wrap-time package
# never reaches a per-step one; a per-step module reads the plans wrap time made.
WRAP_TIME = ("planning", "wrap")
PER_STEP = ("runtime",)


def test_wrap_time_never_reaches_the_step():
    """planning/ (arithmetic over placements and configs) and wrap/ (meshes,
    Parameter identity, registration, exit) reach no runtime module (not even
    Comm: the collectives planning needs are passed in)."""
    graph = _graph()
    for name in graph:
        if name.split(".")[0] in WRAP_TIME:
            bad = sorted(m for m in _reachable(graph, name) if m.split(".")[0] in PER_STEP)
            assert not bad, f"{name} (wrap time) reaches {bad} (per step)"
