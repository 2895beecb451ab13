"""The examples without options of their own still have a command line: `--help`
prints the module's docstring and exits 0 before anything runs, and a mistyped
argument is an error instead of a silent full run. Each runs here as
`python examples/X.py` would run it (runpy, `__main__`), in this one process."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["custom_placement", "domain_parallel", "muon", "shard_tensor"])
def test_help_and_unknown_arguments(name, monkeypatch, capsys):
    path = EXAMPLES / f"{name}.py"
    for argv, code in ((["--help"], 0), (["--stpes", "3"], 2)):
        monkeypatch.setattr(sys, "argv", [str(path), *argv])
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(path), run_name="__main__")
        assert exit_.value.code == code, f"{name} {argv}: exit {exit_.value.code}"
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: {path.name}"), out[:500]
    first_line = runpy.run_path(str(path))["__doc__"].splitlines()[0]
    assert first_line in out
    assert "unrecognized arguments: --stpes 3" in err, err
