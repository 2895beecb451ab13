"""Seconds each test file took in a full run: conftest.py hands the heaviest files to
the pytest-xdist processes first, so the last files handed out are short and both
processes finish together. Refresh the table after a full run:

    python -m pytest -q -n 2 --dist loadfile --junitxml=run.xml
    python tests/file_seconds.py run.xml        # rewrites tests/file_seconds.json

A stale table costs balance, never a test: a file it does not name is handed out first.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TABLE = Path(__file__).with_suffix(".json")


def read() -> dict:
    """File (as xdist names a scope, `tests/test_x.py`) -> seconds."""
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def from_junit(report: Path) -> dict:
    """Per file, the seconds of its tests (setup, call and teardown) in a junit report."""
    seconds: dict = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x[.Class]
        while parts and not Path(*parts).with_suffix(".py").is_file():
            parts.pop()
        if parts:
            name = "/".join(parts) + ".py"
            seconds[name] = seconds.get(name, 0.0) + float(case.get("time", 0.0))
    return {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=1) + "\n")
