"""The set-up cannot drift: what is installed is what constraints.txt (the lock) and
requirements-physicsnemo.txt (installed with --no-deps) pin."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PIN = re.compile(r"([A-Za-z0-9_.\-]+)==([^\s;#]+)")


def pins(lock: str = "constraints.txt") -> dict:
    out = {}
    for line in (REPO / lock).read_text().splitlines():
        match = PIN.fullmatch(line.split("#")[0].strip())
        if match:
            out[match.group(1)] = match.group(2)
    return out


def test_the_lock_pins_torch_and_the_test_tools():
    locked = {re.sub(r"[-_.]+", "-", name).lower() for name in pins()}
    for name in ("torch", "pytest", "pytest-timeout", "hypothesis", "torchtitan", "triton",
                 "transformers", "matplotlib"):
        assert name in locked, f"constraints.txt does not pin {name}"


def test_every_locked_package_is_installed_at_its_pin():
    wrong = []
    locked = {**pins(), **pins("requirements-physicsnemo.txt")}  # the second: --no-deps
    for name, version in sorted(locked.items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name}: pinned {version}, not installed")
            continue
        if installed.split("+")[0] != version:
            wrong.append(f"{name}: pinned {version}, installed {installed}")
    assert not wrong, ("the environment drifted from the locks (run the README's set-up "
                       "command in a fresh virtual environment):\n" + "\n".join(wrong))
