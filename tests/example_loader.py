"""The examples/ scripts as modules, for the tests that run them against a reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    """examples/<name>.py, imported fresh (its module-level code runs again)."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_thread(fn, *args, **kwargs):
    """fn(*args) on one intra-op thread, as the harness workers run: the same kernels
    and rounding, so a one-process reference can match them to 1e-5 or better."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)
