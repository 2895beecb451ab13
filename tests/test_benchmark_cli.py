"""Every benchmark command line, as a user starts it: `python -m benchmarks.X --help` and
`python benchmarks/X.py --help` both work, and every flag says what it does without
citing the project's issue numbers.

The script spelling runs in one process that imports the third-party libraries once
(torch, flexshard from the checkout) and forks a child per script, with
sys.path as Python sets it for `python benchmarks/X.py` (the script's folder first, the
checkout's root nowhere); the module spelling runs here through runpy.
"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLIS = sorted(p for p in (REPO / "benchmarks").glob("*.py")
              if 'if __name__ == "__main__"' in p.read_text())
DRIVER = r"""
import os, runpy, sys
sys.path.insert(0, os.environ["CHECKOUT"])
import flexshard, torch.distributed.fsdp  # once: the forks share them (not the benchmarks package)
del sys.path[0]
for path in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            os._exit(e.code or 0)
        except BaseException as e:
            print(f"{type(e).__name__}: {e}", flush=True)
            os._exit(3)
        os._exit(0)
    print(f"EXIT {os.path.basename(path)} {os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}",
          flush=True)
"""


def test_every_cli_is_found():
    assert len(CLIS) >= 15


def test_script_spelling_shows_help(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"CHECKOUT": str(REPO)}
    out = subprocess.run([sys.executable, "-c", DRIVER, *map(str, CLIS)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600).stdout
    exits = dict(re.findall(r"^EXIT (\S+) (-?\d+)$", out, re.M))
    assert exits == {p.name: "0" for p in CLIS}, out[-3000:]
    assert out.count("usage:") == len(CLIS)


def _help(monkeypatch, capsys, run) -> str:
    monkeypatch.setattr(sys, "argv", ["prog", "--help"])
    with pytest.raises(SystemExit) as exit_:
        run()
    assert exit_.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("path", CLIS, ids=[p.stem for p in CLIS])
def test_every_flag_has_help_without_issue_numbers(path, monkeypatch, capsys):
    text = _help(monkeypatch, capsys, lambda: runpy.run_module(
        f"benchmarks.{path.stem}", run_name="__main__", alter_sys=True))
    assert not re.search(r"\bissues? #?\d+|#\d+\b", text, re.I), f"{path.name} cites an issue"
    options = [o for o in re.split(r"\n  (?=-)", text.split("options:", 1)[1]) if o.strip()]
    bare = [o.split(None, 1)[0].rstrip(",") for o in options if not _described(o)]
    assert not bare, f"{path.name}: flags without help: {bare}"


def _described(option: str) -> bool:
    """An option's help block holds words beyond its flag names and metavars (a group's
    title, unindented, is not its help)."""
    first, *rest = option.split("\n")
    words = re.split(r"\s{2,}", first.strip(), maxsplit=1)
    return len(words) > 1 or any(line[:1].isspace() and line.strip() for line in rest)
