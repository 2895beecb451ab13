"""Persistent multi-process gloo worlds for running distributed test bodies.

Starting a process that imports torch costs seconds, so this module keeps ONE
world (n worker processes sharing a gloo process group) per world size
for the whole test session, started lazily, and runs many test bodies in it.

Public API::

    run_world(n, fn, *args, timeout=120.0, **kwargs) -> list
    expect_all_ranks_raise(n, fn, exc_type, match, *args, timeout=120.0, **kwargs)
        -> list[RemoteFailure]
    shutdown_worlds() -> list[str]          # graceful stop; returns problems
    WorkerError, WorkerDiedError, RemoteFailure

``fn`` must be a top-level function of an importable module (e.g. a test
module); it is sent by module + qualified name and run on every rank. Bodies
get rank/world size from ``torch.distributed`` and seed themselves (the
harness never reseeds). Each body is followed by a barrier on all ranks. A
world is killed and restarted on next use after a timeout, a dead worker, a
failed barrier, or an error while some rank did not answer.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from multiprocessing.connection import wait

MAX_WORLD_SIZE = 4
STARTUP_TIMEOUT_S = 180.0  # 4 ranks take 15-19 s to import torch on 2 cores
PG_TIMEOUT_S = 120.0  # gloo timeout; the harness enforces per-test timeouts
# After a rank fails, how long to wait for the others: a rank doing the same check behind
# it on a loaded machine (2 cores, xdist) answers within seconds; one blocked in a
# collective never does, and is reported after this long.
ERROR_GRACE_S = 20.0
MIN_BARRIER_S = 10.0  # the post-body barrier always gets at least this long
STOP_TIMEOUT_S = 30.0
POLL_S = 0.25
OUTPUT_TAIL = 4000  # chars of a failing rank's output included in errors

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# Workers fork from this test process's forkserver, which imported these once (with
# _WORKER_ENV set): a spawned rank paid ~3 CPU-s importing them, and a session starts
# some twenty ranks per pytest process (world sizes 1-4, restarts after kills).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
           "torch.distributed.checkpoint", "flexshard", "models", "harness"]


# ----------------------------------------------------------------- errors


@dataclasses.dataclass
class RemoteFailure:
    """An exception raised by a test body on one rank."""

    rank: int
    type_name: str  # e.g. "ValueError"
    type_names: list  # names (plain and module-qualified) of the whole MRO
    message: str  # str(exc)
    traceback: str  # formatted traceback, ends with "TypeName: message"
    output: str = ""  # tail of what the rank printed during the body

    def describe(self) -> str:
        """Multi-line report: header, traceback, captured output."""
        text = f"----- rank {self.rank}: {self.type_name}: {self.message}\n{self.traceback}"
        if self.output.strip():
            text += f"----- rank {self.rank} output (tail)\n{self.output}"
        return text


class WorkerError(RuntimeError):
    """A test body raised on at least one rank (see ``failures``)."""

    def __init__(self, fn_name, failures, results=None, missing=(), note=""):
        self.fn_name = fn_name
        self.failures = dict(sorted(failures.items()))  # rank -> RemoteFailure
        self.results = dict(results or {})  # rank -> value, ranks that returned
        self.missing = list(missing)  # ranks that never answered
        lines = [f"{fn_name} raised on rank(s) {list(self.failures)}"]
        if self.missing:
            lines.append(f"rank(s) {self.missing} did not answer (likely blocked in a "
                         "collective); the world was killed and restarts on next use")
        if note:
            lines.append(note)
        lines += [f.describe() for f in self.failures.values()]
        super().__init__("\n".join(lines))


class WorkerDiedError(RuntimeError):
    """A worker process exited unexpectedly; the world restarts on next use."""

    def __init__(self, what, dead, log_paths):
        self.dead = dict(dead)  # rank -> exit code
        lines = [f"{what}: worker process died: "
                 + ", ".join(f"rank {r} exit code {c}" for r, c in self.dead.items())]
        for r in self.dead:
            tail = _tail(log_paths[r]) or ("(empty: output from before the worker set up "
                                           "its log went to the parent's stderr)\n")
            lines.append(f"----- rank {r} log {log_paths[r]} (tail)\n{tail}")
        super().__init__("\n".join(lines))


def _tail(path, limit=OUTPUT_TAIL):
    """Last ``limit`` characters of a text file ('' if unreadable)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return ""


# ----------------------------------------------------------------- worker side


def _send(conn, obj):
    """Send ``obj`` with plain pickle (tensors are copied, no shared memory)."""
    conn.send_bytes(pickle.dumps(obj))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _resolve(module, qualname, path):
    """Import ``module`` (from ``path`` if a plain import fails), get ``qualname``."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        if not path:
            raise
        spec = importlib.util.spec_from_file_location(module, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _failure(rank, exc, output=""):
    """Turn a caught exception into a picklable RemoteFailure."""
    names = []
    for cls in type(exc).__mro__:
        names += [cls.__name__, f"{cls.__module__}.{cls.__qualname__}"]
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RemoteFailure(rank, type(exc).__name__, names, str(exc), tb, output)


def _read_from(path, offset):
    """Flush stdio, return what was appended to ``path`` after ``offset`` (tail)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()[-OUTPUT_TAIL:]


def _run_body(rank, spec, log_path):
    """Run one test body; return the pickled reply ("ok", value) / ("err", failure)."""
    module, qualname, path, args, kwargs = spec
    offset = os.path.getsize(log_path)
    try:
        value = _resolve(module, qualname, path)(*args, **kwargs)
        try:
            return pickle.dumps(("ok", value))
        except Exception as exc:
            raise TypeError(f"{qualname} returned an unpicklable value: {exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        return pickle.dumps(("err", _failure(rank, exc, _read_from(log_path, offset))))


def _guarded(rank, fn):
    """Run ``fn()``; reply ("ok", None) or ("err", failure)."""
    try:
        fn()
        return pickle.dumps(("ok", None))
    except BaseException as exc:  # noqa: BLE001
        return pickle.dumps(("err", _failure(rank, exc)))


def _redirect_output(log_path):
    """Point fds 1 and 2 at the rank's log file (not at pytest's capture)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # unbuffered as under PYTHONUNBUFFERED, whatever env the forkserver started with: a
    # rank that dies keeps its last lines in the log the failure report quotes
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)


def _worker_main(rank, world_size, port, conn, log_path):
    """Worker entry point: init the gloo group, then serve commands until stop."""
    _redirect_output(log_path)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    os.environ.update(_WORKER_ENV)
    for path in (_REPO_ROOT, _TESTS_DIR):
        if path not in sys.path:
            sys.path.insert(0, path)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size,
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    _send(conn, ("ok", "ready"))
    while True:
        try:
            cmd = _recv(conn)
        except (EOFError, OSError):  # parent is gone
            os._exit(1)
        if cmd[0] == "run":
            conn.send_bytes(_run_body(rank, cmd[1], log_path))
        elif cmd[0] == "barrier":
            conn.send_bytes(_guarded(rank, dist.barrier))
        elif cmd[0] == "stop":
            dist.barrier()
            dist.destroy_process_group()
            _send(conn, ("ok", "bye"))
            conn.close()
            # Skip the interpreter's teardown of torch's modules (1-2 s of CPU per rank,
            # ten ranks at once at session end): the group is destroyed and flexshard
            # starts no thread and registers no exit hook, so nothing is left to check.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


# ----------------------------------------------------------------- parent side


def _free_port():
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LOG_DIR = None


def _log_dir():
    """Session-wide directory holding one log file per worker."""
    global _LOG_DIR
    if _LOG_DIR is None:
        _LOG_DIR = tempfile.mkdtemp(prefix="flexshard-worlds-")
    return _LOG_DIR


class _World:
    """n worker processes (forked by the forkserver) in one gloo process group."""

    _generation = 0

    def __init__(self, n):
        _World._generation += 1
        self.n = n
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # no effect once the server runs
        port = _free_port()
        self.log_paths = [os.path.join(_log_dir(), f"world{n}-gen{_World._generation}-rank{r}.log")
                          for r in range(n)]
        self.conns, self.procs = [], []
        saved = {k: os.environ.get(k) for k in _WORKER_ENV}
        os.environ.update(_WORKER_ENV)  # set before the forkserver (first start) imports torch
        try:
            for r in range(n):
                parent_end, child_end = ctx.Pipe()
                p = ctx.Process(target=_worker_main, name=f"flexshard-w{n}-r{r}", daemon=True,
                                args=(r, n, port, child_end, self.log_paths[r]))
                p.start()
                child_end.close()
                self.conns.append(parent_end)
                self.procs.append(p)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def wait_ready(self, timeout):
        """Wait until every rank has joined the process group, else kill + raise."""
        replies, dead = self.collect(time.monotonic() + timeout)
        if dead:
            self.kill()
            raise WorkerDiedError(f"starting world of size {self.n}", dead, self.log_paths)
        if len(replies) < self.n:
            self.kill()
            raise TimeoutError(f"world of size {self.n} did not start within {timeout}s")

    def alive(self):
        return all(p.is_alive() for p in self.procs)

    def broadcast(self, cmd):
        """Send ``cmd`` to every rank; return {rank: exitcode} of dead ones."""
        data, dead = pickle.dumps(cmd), {}
        for r, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                dead[r] = self._exitcode(r)
        return dead

    def _exitcode(self, r):
        self.procs[r].join(1.0)
        return self.procs[r].exitcode

    def collect(self, deadline, grace=None):
        """Read one reply per rank until ``deadline``.

        Returns ({rank: (status, payload)}, {rank: exitcode of dead ranks}).
        Stops early when a rank dies; once some rank replies "err", the others
        get at most ``grace`` more seconds.
        """
        replies, dead = {}, {}
        while len(replies) < self.n and not dead:
            now = time.monotonic()
            if now >= deadline:
                break
            pending = [r for r in range(self.n) if r not in replies]
            handles = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            wait(handles, timeout=min(POLL_S, deadline - now))
            for r in pending:
                try:
                    if self.conns[r].poll():
                        replies[r] = _recv(self.conns[r])
                    elif not self.procs[r].is_alive():
                        dead[r] = self._exitcode(r)
                except (EOFError, OSError):
                    dead[r] = self._exitcode(r)
            if grace is not None and any(s == "err" for s, _ in replies.values()):
                deadline = min(deadline, now + grace)
        return replies, dead

    def kill(self):
        """Terminate all worker processes (SIGTERM, then SIGKILL)."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in self.conns:
            conn.close()

    def stop(self, timeout=STOP_TIMEOUT_S):
        """Graceful stop (final barrier, destroy group, exit 0); return problems."""
        return self.finish_stop(self.broadcast(("stop",)), timeout)

    def finish_stop(self, dead, timeout=STOP_TIMEOUT_S):
        """Wait for the ranks told to stop (`dead`: those already gone); return problems."""
        problems = [f"world {self.n}: rank {r} already dead before stop (exit code {c})"
                    for r, c in dead.items()]
        deadline = time.monotonic() + timeout
        self.collect(deadline)
        for r, p in enumerate(self.procs):
            p.join(max(0.1, deadline - time.monotonic()))
            if r in dead:
                continue
            if p.is_alive():
                problems.append(f"world {self.n}: rank {r} did not exit within {timeout}s")
            elif p.exitcode != 0:
                problems.append(f"world {self.n}: rank {r} exited with code {p.exitcode}; "
                                f"log tail:\n{_tail(self.log_paths[r])}")
        self.kill()
        return problems


_WORLDS: dict = {}


def _get_world(n):
    """The live world of size n, starting (or restarting) it if needed."""
    if not (isinstance(n, int) and 1 <= n <= MAX_WORLD_SIZE):
        raise ValueError(f"world size must be an int in 1..{MAX_WORLD_SIZE}, got {n!r}")
    world = _WORLDS.get(n)
    if world is not None and not world.alive():
        warnings.warn(f"world of size {n} lost a worker while idle; restarting it")
        _drop_world(n)
        world = None
    if world is None:
        for attempt in range(2):  # a second try covers a lost free-port race
            world = _World(n)
            try:
                world.wait_ready(STARTUP_TIMEOUT_S)
                break
            except (WorkerDiedError, TimeoutError):
                if attempt:
                    raise
        _WORLDS[n] = world
    return world


def _drop_world(n):
    """Kill the world of size n (if any); the next use starts a fresh one."""
    world = _WORLDS.pop(n, None)
    if world is not None:
        world.kill()


def _fn_spec(fn):
    """(module, qualname, file) identifying a top-level function."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(f"{fn!r} must be a top-level function of an importable module")
    path = getattr(sys.modules.get(module), "__file__", None)
    return module, qualname, path


def run_world(n, fn, *args, timeout=120.0, **kwargs):
    """Run ``fn(*args, **kwargs)`` on all n ranks; return per-rank results.

    Raises WorkerError if any rank raised, TimeoutError if some rank did not
    answer within ``timeout`` seconds (world killed), WorkerDiedError if a
    worker process died (world killed). A barrier on all ranks follows the body.
    """
    module, qualname, path = _fn_spec(fn)
    name = f"{module}.{qualname}"
    world = _get_world(n)
    deadline = time.monotonic() + timeout
    dead = world.broadcast(("run", (module, qualname, path, args, kwargs)))
    replies, more_dead = ({}, {}) if dead else world.collect(deadline, grace=ERROR_GRACE_S)
    dead.update(more_dead)
    if dead:
        _drop_world(n)
        raise WorkerDiedError(f"running {name}", dead, world.log_paths)
    failures = {r: p for r, (s, p) in replies.items() if s == "err"}
    results = {r: p for r, (s, p) in replies.items() if s == "ok"}
    missing = [r for r in range(n) if r not in replies]
    if missing:
        _drop_world(n)
        if failures:
            raise WorkerError(name, failures, results, missing)
        raise TimeoutError(f"{name} timed out after {timeout}s on world of size {n}: "
                           f"rank(s) {missing} did not answer; the world was killed "
                           "and restarts on next use")
    _post_barrier(world, name, deadline, timeout, failures, results)
    if failures:
        raise WorkerError(name, failures, results)
    return [results[r] for r in range(n)]


def _post_barrier(world, name, deadline, timeout, failures, results):
    """Barrier on all ranks after a body; kill the world and raise if it fails."""
    deadline = max(deadline, time.monotonic() + min(timeout, MIN_BARRIER_S))
    dead = world.broadcast(("barrier",))
    replies, more_dead = ({}, {}) if dead else world.collect(deadline, grace=ERROR_GRACE_S)
    dead.update(more_dead)
    if dead:
        _drop_world(world.n)
        raise WorkerDiedError(f"barrier after {name}", dead, world.log_paths)
    bad = {r: p for r, (s, p) in replies.items() if s == "err"}
    missing = [r for r in range(world.n) if r not in replies]
    if not bad and not missing:
        return
    _drop_world(world.n)
    note = (f"the barrier after the body failed (ranks out of step?): "
            f"errors on {sorted(bad)}, no answer from {missing}")
    if failures or bad:
        raise WorkerError(name, {**bad, **failures}, results, missing, note)
    raise TimeoutError(f"{name}: {note}; the world was killed and restarts on next use")


def expect_all_ranks_raise(n, fn, exc_type, match, *args, timeout=120.0, **kwargs):
    """Assert that ``fn`` raises ``exc_type`` matching regex ``match`` on EVERY rank.

    ``exc_type`` is a class or a name ("ValueError" or "pkg.mod.ValueError");
    subclasses count. Returns the per-rank RemoteFailure list.
    """
    if isinstance(exc_type, str):
        want = exc_type
    else:
        want = f"{exc_type.__module__}.{exc_type.__qualname__}"
    try:
        results = run_world(n, fn, *args, timeout=timeout, **kwargs)
    except WorkerError as err:
        problems = []
        for r in range(n):
            f = err.failures.get(r)
            if f is None:
                problems.append(f"rank {r} did not raise")
            elif want not in f.type_names:
                problems.append(f"rank {r} raised {f.type_name}, expected {want}")
            elif not re.search(match, f.message):
                problems.append(f"rank {r}: message {f.message!r} does not match {match!r}")
        if problems:
            raise AssertionError("\n".join(problems) + f"\n{err}") from None
        return [err.failures[r] for r in range(n)]
    raise AssertionError(f"{fn.__qualname__} raised on no rank (expected {want}); "
                         f"returned {results!r}")


def shutdown_worlds():
    """Stop every world gracefully; return a list of problems ([] if clean)."""
    problems = []
    # Tell every world to stop before waiting on any: their exits overlap.
    stopping = [(_WORLDS[n], _WORLDS[n].broadcast(("stop",))) for n in sorted(_WORLDS)]
    _WORLDS.clear()
    for world, dead in stopping:
        problems += world.finish_stop(dead)
    if not problems and _LOG_DIR is not None:
        shutil.rmtree(_LOG_DIR, ignore_errors=True)
    elif problems:
        problems.append(f"worker logs: {_LOG_DIR}")
    return problems


@atexit.register
def _kill_all_worlds():
    """Last resort at interpreter exit: kill whatever worlds are left."""
    for n in list(_WORLDS):
        _drop_world(n)
