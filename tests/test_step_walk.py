"""The files one training step walks through (benchmarks/step_walk.py): the meter on a
case whose answer is known, then flexshard's step held to what it crosses today, with
no call back into a room it came from."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks.step_walk import _record

REPO = Path(__file__).resolve().parent.parent


def test_the_meter_counts_files_hops_and_hops_back(tmp_path):
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "a.py").write_text(textwrap.dedent("""
        from . import b
        def start():
            return b.middle()
        def leaf():
            return 1
    """))
    (pkg / "b.py").write_text(textwrap.dedent("""
        def middle():
            from . import a
            return a.leaf() + a.leaf()
    """))
    (pkg / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    try:
        from toy import a
        walk, out = _record(str(pkg) + "/", a.start)
    finally:
        sys.path.remove(str(tmp_path))
    assert out == 2
    assert dict(walk.files) == {"a.py": 3, "b.py": 1}
    assert dict(walk.hops) == {("a.py", "b.py"): 1, ("b.py", "a.py"): 2}
    assert dict(walk.back) == {("b.py", "a.py"): 2}  # a -> b -> a: back into a


def test_a_step_crosses_few_files_and_never_returns_into_a_room():
    code = ("import json; from benchmarks.step_walk import walk_step, summary; "
            "print(json.dumps({lib: summary(walk_step(lib)) for lib in ('flexshard', 'fsdp2')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    flexshard, fsdp2 = got["flexshard"], got["fsdp2"]
    assert fsdp2["backward"][2] > 0  # the meter sees FSDP2's calls back into _fsdp_common
    # (files, hops, hops back) per phase; files at most today's (before the walk: 20 / 20 / 23;
    # the forward's 7th: runtime/rank_agreement.py, the ranks' check, out of hooks.py)
    assert flexshard["forward"][0] <= 7 and flexshard["backward"][0] <= 7
    assert flexshard["step"][0] <= 9
    assert all(flexshard[phase][2] == 0 for phase in flexshard), flexshard
