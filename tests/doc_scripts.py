"""Runs doc snippets as a user runs them: each one a script in a fresh process,
under torchrun at its world size, with nothing set up beforehand.

    torchrun --standalone --nproc-per-node W tests/doc_scripts.py OUT a.py b.py ...
    python tests/doc_scripts.py OUT a.py b.py ...     # world 1: as `python a.py`

A process that imports torch costs seconds, and one torchrun per snippet and world
size would pay it dozens of times. So each rank torchrun starts imports torch once (and
torch's dynamo, which a wrap's `torch.compiler.disable` imports: a second of CPU per
process; no flexshard, no process group) and then, per script, forks a child that runs the script
as `__main__`: a new process with torchrun's environment, its own MASTER_PORT (its
process group is its own; rank 0's child hosts the store, as under torchrun with
TORCHELASTIC_USE_AGENT_STORE unset), `sys.path[0]` the script's folder, and flexshard
imported by the script itself. Per script and rank it writes OUT/<script>.<rank>.out
(stdout and stderr), OUT/<script>.<rank>.rc (the exit status; "timeout" when the
script ran past TIMEOUT_S and was killed) and OUT/<script>.<rank>.cpu (its CPU seconds).
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import socket
import sys
import time
import traceback

TIMEOUT_S = 180.0
POLL_S = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_for(out: str, name: str, rank: int) -> int:
    """A fresh port per script, chosen by rank 0 and read by the others from a file."""
    path = os.path.join(out, f"{name}.port")
    if rank == 0:
        with open(path + ".tmp", "w") as f:
            f.write(str(_free_port()))
        os.replace(path + ".tmp", path)
    deadline = time.monotonic() + TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 never chose a port for {name}")
        time.sleep(POLL_S)
    with open(path) as f:
        return int(f.read())


def _child(script: str, log: str, port) -> None:
    """Run `script` as __main__ in this (forked) process; never returns."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int) -> tuple:
    """(exit status or "timeout", CPU seconds the script took)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status)), usage.ru_utime + usage.ru_stime
        time.sleep(POLL_S)
    os.kill(pid, signal.SIGKILL)
    _, _, usage = os.wait4(pid, 0)
    return "timeout", usage.ru_utime + usage.ru_stime


def main(out: str, scripts: list) -> None:
    rank = int(os.environ.get("RANK", 0))
    launched = "RANK" in os.environ
    import torch  # noqa: F401  (paid once per rank, not once per script)
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.compiler.disable imports it on first use)

    for script in scripts:
        name = os.path.basename(script)
        port = _port_for(out, name, rank) if launched else None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(script, os.path.join(out, f"{name}.{rank}.out"), port)
        status, cpu = _wait(pid)
        with open(os.path.join(out, f"{name}.{rank}.rc"), "w") as f:
            f.write(status)
        with open(os.path.join(out, f"{name}.{rank}.cpu"), "w") as f:
            f.write(f"{cpu:.2f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
