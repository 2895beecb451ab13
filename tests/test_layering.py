"""Imports run one way (STYLE.md): api -> hooks/recompute -> bucket ->
storage/layout -> placements -> comm -> torch. Parsed, not imported."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "flexshard"

# Each module may not import (directly or not) any module of a higher layer.
LAYERS = [
    {"comm"},
    {"placements.contract", "placements.shard", "placements.owned", "placements.ragged"},
    {"layout", "storage"},
    {"bucket"},
    {"hooks", "recompute"},
    {"api"},
]


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


def test_no_import_cycles():
    graph = _graph()
    # The parser sees the real edges (a check of the check).
    assert {"bucket", "hooks", "placements.contract", "comm"} <= _reachable(graph, "api")
    for name in graph:
        assert name not in _reachable(graph, name), f"{name} imports itself through a cycle"


def test_lower_layers_never_import_higher_ones():
    graph = _graph()
    for level, layer in enumerate(LAYERS):
        higher = set().union(*LAYERS[level + 1:])
        for name in layer:
            bad = _reachable(graph, name) & higher
            assert not bad, f"{name} (layer {level}) reaches {sorted(bad)}"
