"""Pytest setup: import paths, the ``world`` marker, and world teardown."""

import os
import sys

import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)
for _path in (_REPO_ROOT, _TESTS_DIR):  # `import flexshard` / `import harness`
    if _path not in sys.path:
        sys.path.insert(0, _path)

# inductor compiles a graph's kernels in a pool of processes it starts (compile_threads:
# one per core), each importing torch. Tests already run two pytest processes and
# multi-rank worlds on the cores: a pool per compiling rank only adds its imports (the
# world-3 inductor test, cold cache: 148 s -> 109 s). Worlds and torchruns inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import file_seconds  # noqa: E402
import harness  # noqa: E402


def pytest_configure(config):
    """Register the ``world`` marker."""
    config.addinivalue_line(
        "markers",
        "world(n): test runs bodies in the persistent n-rank gloo world (tests/harness.py)",
    )
    config.addinivalue_line(
        "markers",
        "kills_world: test kills a persistent world on purpose; it runs last, so the tests "
        "before it keep their warm worlds",
    )


def pytest_collection_modifyitems(items):
    """Tests that kill a persistent world run after every other test: a killed world
    restarts on next use, paying its processes' imports again (seconds per rank)."""
    items.sort(key=lambda item: item.get_closest_marker("kills_world") is not None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` hands out the heaviest file first (tests/file_seconds.json),
    not the one with the most tests: xdist's order left single-test files of minutes
    to the end, one process finishing them while the other sat idle."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    seconds = file_seconds.read()

    class HeaviestFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            heaviest = max(self.workqueue, key=lambda f: seconds.get(f, float("inf")))
            self.workqueue.move_to_end(heaviest, last=False)  # the unit the base pops
            super()._assign_work_unit(node)

    return HeaviestFileFirst(config, log)


@pytest.fixture(scope="session", autouse=True)
def _flexshard_worlds():
    """At session end stop all worlds gracefully; fail if any worker misbehaved."""
    yield
    problems = harness.shutdown_worlds()
    if problems:
        pytest.fail("distributed test worlds did not shut down cleanly:\n"
                    + "\n".join(problems), pytrace=False)
