"""Every error flexshard raises for a user, read from the source: the catalogue
docs/troubleshooting.md holds between its markers (tests/test_docs.py checks it is
current; `python tests/error_catalogue.py` rewrites it)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "troubleshooting.md"
BEGIN, END = "<!-- errors: begin -->", "<!-- errors: end -->"
USER_ERRORS = {"ValueError", "TypeError", "NotImplementedError", "RuntimeError", "KeyError"}
AREAS = [  # (heading, path prefixes under flexshard/), first match wins
    ("Compiling the whole step: fs.compile", ("whole_step.py", "runtime/traced.py")),
    ("Wrapping a model: flex_shard, BucketSpec, policies", ("api.py", "config.py", "planning/", "dry_run/",
                                                            "runtime/", "wrap/")),
    ("Placements", ("placements/",)),
    ("Checkpoints, state dicts and loading", ("checkpoint/",)),
    ("Activation collectives", ("collectives.py",)),
    ("Gradient clipping and optimizers", ("clip.py", "grads.py", "optim.py")),
    ("torchtitan", ("integrations/",)),
]


def _text(node) -> str:
    """A message's text, `{...}` where it interpolates."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{…}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    return "{…}"


def errors() -> list:
    """[(area, file, exception, message)] for every user-facing raise, in file order."""
    out = []
    for path in sorted((REPO / "flexshard").rglob("*.py")):
        rel = path.relative_to(REPO / "flexshard").as_posix()
        area = next((a for a, prefixes in AREAS if rel.startswith(prefixes)), "Other")
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            name = getattr(node.exc.func, "id", None)
            if name in USER_ERRORS and node.exc.args:
                message = re.sub(r"\s+", " ", _text(node.exc.args[0])).strip()
                out.append((area, rel, name, message))
    return out


def catalogue() -> str:
    lines = [BEGIN]
    for area, _ in AREAS + [("Other", ())]:
        rows = [e for e in errors() if e[0] == area]
        if not rows:
            continue
        lines += ["", f"### {area}", "", "| error | message (it names the cause and the fix) | raised in |",
                  "|---|---|---|"]
        for _, rel, name, message in rows:
            cell = message.replace("|", "\\|")
            lines.append(f"| {name} | {cell} | `{rel}` |")
    return "\n".join(lines + ["", END])


def page_with_catalogue(page: str) -> str:
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + catalogue() + tail


if __name__ == "__main__":
    PAGE.write_text(page_with_catalogue(PAGE.read_text()))
    print(f"wrote {len(errors())} errors into {PAGE.relative_to(REPO)}", file=sys.stderr)
